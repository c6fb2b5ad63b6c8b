"""fp8ax under rematerialisation: every recipe of the registry, under every checkpoint
policy JAX ships, every `gradient_checkpointing` option of Haliax's `Stacked` and
`eqx.filter_checkpoint`, computes the step it computes without remat.

A policy that saves residuals makes JAX round each saved floating-point residual with
`lax.reduce_precision` to the format its `finfo` describes, which changes E4M3, E2M1 and
E8M0 values (src/fp8ax/_gemm/residuals.py; docs/faq.md has the JAX-only repro). Before
fp8ax carried its low-precision residuals as bits, every saving policy gave a NaN loss on
the first step.

Tolerances: the new FP8 state and, under Haliax's `Stacked`, everything are compared bit
for bit. Loss and parameter gradients under a `jax.checkpoint` policy: rtol 1e-5, atol
1e-6 against the step without remat (XLA fuses the recomputed forward pass differently,
so a float32 gradient may differ in its last bits; measured: at most 3.6e-7 absolute, on
int8's gradients). The step without remat is itself checked against independent
references by tests/test_recipe_conformance.py and, for the state, by the reuse matrix
(tests/_reuse.py), which runs the saving policies as boundaries too.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import fp8ax
from fp8ax._gemm.residuals import bits_dtype, pack, protect, restore, unpack
from recipe_registry import REGISTRY

# Per-example scales under `vmap` warn once per recipe (tests/test_per_example.py).
pytestmark = pytest.mark.filterwarnings("ignore:.*a layer with per-example scales:UserWarning")

_cp = jax.checkpoint_policies
# Every policy of `jax.checkpoint_policies` that is a policy (not a combinator). The named
# ones name the MLP's hidden activation, as a user names an activation to keep.
POLICIES = {
    "everything_saveable": _cp.everything_saveable,
    "nothing_saveable": _cp.nothing_saveable,
    "dots_saveable": _cp.dots_saveable,
    "dots_with_no_batch_dims_saveable": _cp.dots_with_no_batch_dims_saveable,
    "save_anything_except_these_names": _cp.save_anything_except_these_names("hidden"),
    "save_only_these_names": _cp.save_only_these_names("hidden"),
    "save_and_offload_only_these_names": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=("hidden",),
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "offload_dot_with_no_batch_dims": _cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
}

# Every floating-point dtype narrower than 32 bits that XLA:CPU holds (its FP6 types it
# cannot: fp8ax stores FP6 elements in E4M3 containers, `_mx.element_storage_dtype`).
SMALL_FLOATS = [
    jnp.float8_e4m3fn,
    jnp.float8_e4m3,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e4m3b11fnuz,
    jnp.float8_e3m4,
    jnp.float8_e8m0fnu,
    jnp.float4_e2m1fn,
    jnp.bfloat16,
    jnp.float16,
]


def _every_value(dtype):
    bits = jnp.finfo(dtype).bits
    pattern = jnp.arange(2**bits, dtype=jnp.uint16 if bits == 16 else jnp.uint8)
    if bits == 4:
        return lax.bitcast_convert_type(pattern.astype(jnp.uint4), dtype)
    return lax.bitcast_convert_type(pattern, dtype)


def _bits(x):
    return np.asarray(lax.bitcast_convert_type(x, bits_dtype(x.dtype) or jnp.uint16).astype(jnp.uint32))


@pytest.mark.parametrize("dtype", SMALL_FLOATS, ids=lambda d: np.dtype(d).name)
def test_what_remat_rounding_changes_is_carried_as_bits(dtype):
    # The rounding JAX inserts on a saved residual, applied to every value of the dtype:
    # a dtype it changes must be carried as bits, and the bits must come back unchanged.
    x = _every_value(dtype)
    finfo = jnp.finfo(dtype)
    rounded = jax.jit(lambda x: lax.reduce_precision(x, exponent_bits=finfo.nexp, mantissa_bits=finfo.nmant))(x)
    a, b = np.asarray(x.astype(jnp.float32)), np.asarray(rounded.astype(jnp.float32))
    changed = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    if changed.any():
        assert bits_dtype(dtype) is not None, f"{np.dtype(dtype).name}: {a[changed][:4]} -> {b[changed][:4]}"
    if bits_dtype(dtype) is not None:
        back = jax.jit(lambda x: restore(protect(x)))(x)
        assert back.dtype == x.dtype
        np.testing.assert_array_equal(_bits(back), _bits(x))
    else:  # carried as it is, so the rounding must not change it
        assert not changed.any()


def test_protect_leaves_other_leaves_alone():
    f32, i8 = jnp.arange(3.0), jnp.arange(3, dtype=jnp.int8)
    e4m3 = f32.astype(jnp.float8_e4m3fn)
    out = protect((f32, i8, None, e4m3))
    assert out[0] is f32 and out[1] is i8 and out[2] is None
    leaf = jax.tree.leaves(out[3])
    assert len(leaf) == 1 and leaf[0].dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(restore(out)[3].astype(jnp.float32)), [0.0, 1.0, 2.0])


def test_pack_round_trips_small_residuals_exactly():
    # Scalars, vectors and flags of float32 (NaN, inf, -0.0 and a subnormal included) go
    # into one float32 vector and come back bit for bit; everything else stays a leaf.
    scalar = jnp.float32(-0.0)
    vector = jnp.asarray([1.0, np.nan, -np.inf, 1e-45, 3.5], jnp.float32)
    flag = jnp.asarray(True)
    matrix, ints = jnp.ones((2, 3), jnp.float32), jnp.arange(4, dtype=jnp.int32)
    tree = {"a": (scalar, None, vector), "b": [flag, matrix, ints], "c": jnp.asarray([False, True])}
    packed = jax.jit(pack)(tree)
    assert [v.shape for v in packed.vectors] == [(1 + 5 + 1 + 2,)] and packed.vectors[0].dtype == jnp.float32
    back = jax.jit(unpack)(packed)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(
            np.atleast_1d(np.asarray(got)).view(np.uint8), np.atleast_1d(np.asarray(want)).view(np.uint8)
        )
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_a_scanned_layer_keeps_two_small_residuals(getkey):
    # Inside `lax.scan` each residual is a stacked output of the forward loop, one kernel
    # per iteration to write: a layer with delayed scaling keeps its small ones (scales,
    # new states, the gradient's state and plan, its flag "calibrates") in two vectors
    # instead of ten arrays (the count here before they were packed).
    layers, n = 3, 16
    dg = fp8ax.Fp8DotGeneral.init(batch_shape=(layers,))
    params, static = eqx.partition(dg, eqx.is_array)
    w = jax.random.normal(getkey(), (layers, n, n))
    x = jax.random.normal(getkey(), (8, n))

    def loss(params, w):
        def body(h, pw):
            p, wi = pw
            return eqx.combine(p, static)(h, wi, (((1,), (0,)), ((), ()))), None

        return jnp.sum(lax.scan(body, x, (params, w))[0] ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, w)
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    forward = scans[0]  # the forward loop, whose stacked outputs are the residuals
    small = [
        v.aval
        for v in forward.outvars[forward.params["num_carry"] :]
        if v.aval.dtype in (jnp.float32, jnp.bool_) and v.aval.ndim <= 2
    ]
    assert len(small) == 2, small


class _Model(eqx.Module):
    """One FP8 layer after a named activation (what the named policies save or offload)."""

    linear: eqx.nn.Linear

    def __call__(self, x):
        return self.linear(checkpoint_name(jnp.tanh(x), "hidden"))


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _check_like(variants, *, exact: bool):
    """Every variant's `(loss, gradients)` is finite and equals variant "none" (the state
    bit for bit; the rest bit for bit if `exact`, else to rtol 1e-5, atol 1e-6)."""
    want_state, want_rest = fp8ax.partition_for_grad_overwrite(variants["none"][1])
    for name, (loss, grads) in variants.items():
        state, rest = fp8ax.partition_for_grad_overwrite(grads)
        rest = (loss, rest)
        for got, want in zip(jax.tree.leaves(rest), jax.tree.leaves((variants["none"][0], want_rest)), strict=True):
            assert bool(jnp.all(jnp.isfinite(got))), f"{name}: non-finite loss or gradient"
            if exact:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
            else:
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)
        for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
            assert bool(jnp.all(jnp.isfinite(got))), f"{name}: non-finite new FP8 state"
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name}: new FP8 state")


# The registry's recipes, and the FP8 dtypes none of them stores by default.
RECIPES = {name: entry.recipe for name, entry in REGISTRY.items()} | {
    "current-fnuz": fp8ax.CurrentScaling(fwd_dtype=jnp.float8_e4m3fnuz, grad_dtype=jnp.float8_e5m2fnuz),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_every_jax_policy(name, getkey):
    recipe = RECIPES[name]
    model = fp8ax.fp8_linear_layers(_Model(eqx.nn.Linear(32, 16, key=getkey())), fp8ax.Fp8Config(recipe=recipe))
    x, y = jax.random.normal(getkey(), (16, 32)), jax.random.normal(getkey(), (16, 16))

    # One program for all variants (one compile per recipe).
    @eqx.filter_jit
    def steps(model, x, y):
        out = {"none": eqx.filter_value_and_grad(_loss)(model, x, y)}
        for p, policy in POLICIES.items():
            remat = jax.checkpoint(_loss, policy=policy)
            out[p] = eqx.filter_value_and_grad(remat)(model, x, y)
        out["eqx.filter_checkpoint"] = eqx.filter_value_and_grad(eqx.filter_checkpoint(_loss))(model, x, y)
        return out

    _check_like(steps(model, x, y), exact=False)


@pytest.mark.needs_hax_dot
@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_stacked_option(name, getkey):
    import haliax as hax
    from haliax.nn import ScanCheckpointPolicy

    options = {
        "none": False,
        "True": True,
        "save_all": "save_all",
        "recompute": "recompute",
        "nested": "nested",
        "offload": "offload",
        "ScanCheckpointPolicy(save_block_internals=True)": ScanCheckpointPolicy(save_block_internals=True),
    }
    key = getkey()
    config = fp8ax.Fp8Config(recipe=REGISTRY[name].recipe)
    Layers, Batch, Embed = hax.Axis("layers", 3), hax.Axis("batch", 16), hax.Axis("embed", 32)

    class Block(eqx.Module):  # one FP8 layer a block
        linear: hax.nn.Linear

        @staticmethod
        def init(*, key):
            return Block(hax.nn.Linear.init(Embed, Embed.alias("out"), key=key))

        def __call__(self, h):
            return h + hax.tanh(self.linear(h).rename({"out": "embed"}))

    keys = jax.random.split(key, Layers.size)
    models = {
        k: fp8ax.fp8_linear_layers(hax.nn.Stacked.init(Layers, Block, gradient_checkpointing=v)(key=keys), config)
        for k, v in options.items()
    }
    xb = hax.random.normal(getkey(), (Batch, Embed))

    def loss(m):
        return hax.mean(m.fold(xb) ** 2).scalar()

    variants = eqx.filter_jit(lambda ms: {k: eqx.filter_value_and_grad(loss)(m) for k, m in ms.items()})(models)
    _check_like(variants, exact=True)
