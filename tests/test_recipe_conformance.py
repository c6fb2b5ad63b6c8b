"""Every recipe of the registry (tests/recipe_registry.py), through the same tests:
quantization and the three GEMMs against the entry's independent NumPy reference,
jit/scan/vmap, a stacked Haliax model, a checkpoint round trip, the state invariants,
and SQNR bounds."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import Batch, Deep, In, Out, adam_trained, sqnr
from recipe_registry import REGISTRY

DIMS = (((1,), (0,)), ((), ()))
NAMES = list(REGISTRY)

# Per-example scales under `vmap` warn once per recipe (tests/test_per_example.py).
pytestmark = pytest.mark.filterwarnings("ignore:.*a layer with per-example scales:UserWarning")


def _wide(key, shape):
    """Normal values spread over about 2**-9 to 2**9 (a few per mille reach further)."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp(2.0 * jax.random.normal(k2, shape))


def _dequantized(q) -> np.ndarray:
    """A `QuantizedArray` dequantized in float64 NumPy (exactly, without the float32
    subnormal flushing of XLA:CPU): values times their scale."""
    scale = np.asarray(q.expanded_scale())
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        scale = scale.astype(np.float64) * (2.0**-6 if q.values.dtype == jnp.int8 else 1.0)
    values = np.asarray(q.values).astype(np.float64)
    outer = 1.0 if q.outer_scale is None else np.float64(q.outer_scale)  # two-level scales (NVFP4)
    return values * scale.astype(np.float64) * 2.0**q.int_exponent * outer


def _quantized(recipe, x, axes, role):
    """`x` quantized as operand `role`, as the pipeline asks (a fresh state for a stateful
    recipe), dequantized."""
    state = recipe.init_state()
    op = fp8ax.Operand(
        x,
        tuple(axes),
        recipe.dtype_for(role),
        None if state is None else tuple(jax.tree.leaves(state)),
        jax.random.key(0) if recipe.stochastic(role) else None,
        role=role,
    )
    return _dequantized(recipe.quantize_operands([op])[0][0])


CASES = {  # role: (shape, contracting axes)
    "lhs": ((24, 40), (1,)),
    "rhs": ((40, 16), (0,)),
    "grad": ((24, 16), (1,)),
    "lhs-for-drhs": ((24, 40), (0,)),
    "rhs-for-dlhs": ((40, 16), (1,)),
    "grad-for-drhs": ((24, 16), (0,)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_quantization_matches_reference(name, case, getkey):
    entry = REGISTRY[name]
    role = case.split("-")[0]
    if entry.recipe.stochastic(role):
        pytest.skip("stochastic rounding: tests/test_rounding.py checks it statistically")
    shape, axes = CASES[case]
    for x in (_wide(getkey(), shape), 4e-36 * jax.random.normal(getkey(), shape), jnp.zeros(shape)):
        got = _quantized(entry.recipe, x, axes, role)
        want = entry.reference(np.asarray(x, np.float32), axes, role)
        # Bit for bit: every reference rounds once, as the recipe must.
        np.testing.assert_array_equal(got, want, err_msg=f"{name} {case} amax {float(jnp.max(jnp.abs(x)))}")


@pytest.mark.parametrize("name", NAMES)
def test_gemms_match_reference(name, getkey):
    """Forward, input and weight gradient against float64 GEMMs of the reference's
    quantized operands (each GEMM's own contraction). Left: float32 accumulation
    (within 4e-6 of the largest entry)."""
    entry = REGISTRY[name]
    recipe, ref = entry.recipe, entry.reference
    x, w, g = _wide(getkey(), (24, 40)), _wide(getkey(), (40, 16)), _wide(getkey(), (24, 16))
    dg = fp8ax.Fp8DotGeneral.init(recipe)

    @jax.jit
    def gemms(x, w, g):
        out, vjp = jax.vjp(lambda x, w: dg(x, w, DIMS), x, w)
        return (out, *vjp(g))

    out, dx, dw = gemms(x, w, g)
    xn, wn, gn = (np.asarray(a, np.float32) for a in (x, w, g))
    checks = [(out, ref(xn, (1,), "lhs") @ ref(wn, (0,), "rhs"))]
    if not recipe.stochastic("grad"):
        checks += [
            (dx, ref(gn, (1,), "grad") @ ref(wn, (1,), "rhs").T),
            (dw, ref(xn, (0,), "lhs").T @ ref(gn, (0,), "grad")),
        ]
    for got, want in checks:
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < 4e-6, (name, err)


@pytest.mark.parametrize("name", NAMES)
def test_full_contraction_and_its_gradient(name, getkey):
    # A vector dot product: the output and its gradient are 0-d.
    dg = fp8ax.Fp8DotGeneral.init(REGISTRY[name].recipe)
    a, b = jax.random.normal(getkey(), (64,)), jax.random.normal(getkey(), (64,))
    ga, gb = jax.jit(jax.grad(lambda a, b: dg(a, b, (((0,), (0,)), ((), ()))), argnums=(0, 1)))(a, b)
    assert ga.shape == a.shape and gb.shape == b.shape
    np.testing.assert_allclose(np.asarray(ga), np.asarray(b), rtol=0.15, atol=0.15)


@pytest.mark.parametrize("name", NAMES)
def test_under_transforms(name, getkey, monkeypatch):
    # jit, scan and vmap, each against the same computation without the transform (bit
    # for bit: the same ops on the same values).
    recipe = REGISTRY[name].recipe
    x = jax.random.normal(getkey(), (4, 16))
    w = jax.random.normal(getkey(), (16, 8))
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    call = jax.jit(lambda x: dg(x, w, DIMS))
    np.testing.assert_array_equal(np.asarray(call(x)), np.asarray(dg(x, w, DIMS)))
    xs = jnp.stack([x, 2 * x, -x])
    ys = jax.jit(lambda xs: jax.lax.scan(lambda c, xi: (c, dg(xi, w, DIMS)), 0.0, xs)[1])(xs)
    np.testing.assert_array_equal(np.asarray(ys[1]), np.asarray(call(2 * x)))
    if not recipe.stateful:  # (a stateful layer under vmap calibrates on the whole batch)
        yv = jax.jit(jax.vmap(lambda xi: dg(xi, w, DIMS)))(xs)
        np.testing.assert_array_equal(np.asarray(yv[2]), np.asarray(call(-x)))
    # Per example: scales from the state are shared, and the weight gradient is one GEMM;
    # per-example scales make it one GEMM per example, and fp8ax says so.
    monkeypatch.setattr(fp8ax._gemm.dense, "_WARNED", set())
    jax.clear_caches()  # the warning is given while a pass is traced, and JAX caches that

    def per_example(w):
        return jnp.sum(jax.vmap(lambda xi: dg(xi, w, DIMS))(xs) ** 2)

    if recipe.stateful:
        g = jax.jit(jax.grad(per_example))(w)
    else:
        with pytest.warns(UserWarning, match="per example under `jax.vmap`"):
            g = jax.jit(jax.grad(per_example))(w)
    assert g.shape == w.shape and bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.needs_hax_dot
@pytest.mark.parametrize("name", NAMES)
def test_in_a_stacked_haliax_model(name, getkey):
    recipe = REGISTRY[name].recipe
    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(recipe=recipe))
    xb = hax.random.normal(getkey(), (Batch, In))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: hax.mean(m(xb) ** 2).scalar()))(model)
    overwrite, rest = fp8ax.partition_for_grad_overwrite(grads)
    assert (jax.tree.leaves(overwrite) == []) == (not recipe.stateful)
    assert rest.blocks.stacked.mlp.up_proj.weight.array.shape == model.blocks.stacked.mlp.up_proj.weight.array.shape
    new = fp8ax.apply_updates(model, jax.tree.map(lambda a: -0.1 * a, rest), overwrite)
    assert new.head(xb).axes == (Batch, Out)


def _trained_mlp(recipe, getkey, steps=3):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(16, 8, 32, 2, key=getkey()), fp8ax.Fp8Config(recipe=recipe))
    x, y = jax.random.normal(getkey(), (8, 16)), jax.random.normal(getkey(), (8, 8))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    model = adam_trained(model, loss, steps)
    return model, x


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip(name, getkey, tmp_path):
    recipe = REGISTRY[name].recipe
    model, x = _trained_mlp(recipe, getkey)
    eqx.tree_serialise_leaves(tmp_path / "model.eqx", model)
    template = fp8ax.fp8_linear_layers(eqx.nn.MLP(16, 8, 32, 2, key=getkey()), fp8ax.Fp8Config(recipe=recipe))
    loaded = fp8ax.tree_deserialise_leaves(tmp_path / "model.eqx", template)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # One jitted program for both (eagerly, an MX model's vmapped call compiles each op
    # alone: about 45 s on 2 cores).
    forward = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    np.testing.assert_array_equal(np.asarray(forward(loaded, x)), np.asarray(forward(model, x)))


@pytest.mark.parametrize("name", NAMES)
def test_state_invariants(name, getkey):
    """A layer used twice in a step records the larger of the two observations (its state
    is that of the larger use alone, not a sum), a layer the step does not use keeps its
    state, and a NaN input records nothing; a stateless recipe has no state at all."""
    recipe = REGISTRY[name].recipe
    used, unused = fp8ax.Fp8DotGeneral.init(recipe), fp8ax.Fp8DotGeneral.init(recipe)
    if not recipe.stateful:
        assert used.lhs is None and used.rhs is None and used.grad is None
        return
    x, w = jax.random.normal(getkey(), (8, 16)), jax.random.normal(getkey(), (16, 4))
    model = (used, unused)

    def loss(model, x):
        a, _ = model
        return jnp.sum(a(x, w, DIMS)) + jnp.sum(a(3 * x, w, DIMS))

    def stepped(loss, model, x):
        grads = jax.grad(loss)(model, x)
        overwrite, rest = fp8ax.partition_for_grad_overwrite(grads)
        return fp8ax.apply_updates(model, jax.tree.map(jnp.zeros_like, rest), overwrite)

    new = stepped(loss, model, x)
    once = stepped(lambda m, x: jnp.sum(m[0](3 * x, w, DIMS)), model, x)
    for a, b in zip(jax.tree.leaves(new[0]), jax.tree.leaves(once[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert recipe.state_observed(tuple(np.asarray(v) for v in jax.tree.leaves(new[0].lhs)))
    for a, b in zip(jax.tree.leaves(new[1]), jax.tree.leaves(unused), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grads = jax.grad(loss)(new, x.at[0, 0].set(jnp.nan))
    overwrite, rest = fp8ax.partition_for_grad_overwrite(grads)
    after = fp8ax.apply_updates(new, jax.tree.map(jnp.zeros_like, rest), overwrite)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(after))


@pytest.mark.parametrize("name", NAMES)
def test_sqnr(name, getkey):
    entry = REGISTRY[name]
    x = jax.random.normal(getkey(), (64, 256))
    w = jax.random.normal(getkey(), (256, 64))
    gy = jax.random.normal(getkey(), (64, 64))
    dg = fp8ax.Fp8DotGeneral.init(entry.recipe)

    @jax.jit
    def fwd_bwd(x, w, gy):
        y, vjp = jax.vjp(lambda x, w: dg(x, w, DIMS), x, w)
        return (y, *vjp(gy))

    y, dx, dw = fwd_bwd(x, w, gy)
    got = (sqnr(x @ w, y), sqnr(gy @ w.T, dx), sqnr(x.T @ gy, dw))
    print(name, [f"{v:.1f}" for v in got])
    assert got[0] > entry.fwd_db and min(got[1:]) > entry.grad_db, got
