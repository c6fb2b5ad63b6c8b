"""Per-example calls under `jax.vmap` (the Equinox idiom): one batched GEMM per pass.

`jax.vmap` of a custom VJP vmaps its backward pass, which computes one weight gradient
per example (an outer product each) and sums them. fp8ax's backward pass has a `vmap`
rule that folds the examples into one GEMM when every example is quantized with the
same scale (delayed scaling), and warns once otherwise.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from fp8ax._gemm import dense as _dense

B, IN, OUT = 64, 32, 16


def _largest_intermediate(jaxpr) -> tuple[int, str]:
    """The largest array any equation of `jaxpr` (sub-jaxprs included) produces, leaving
    out the FP8 state (last axis 1024 + 2, a `ScalingState`'s array with the default
    history length, or 1024, its history: a layer's states are stacked into one
    (3, 1026) array, which is state, not data), and the vectors the custom VJP packs its
    small residuals into (`_gemm/residuals.py`: rank 1, holding such states and scalars,
    made by a `concatenate` and leaving the pass's `jit`; an outer product of examples
    has rank 3)."""
    best = (0, "")

    def visit(jx):
        nonlocal best
        for eqn in jx.eqns:
            for v in eqn.outvars:
                shape = getattr(v.aval, "shape", ())
                if shape[-1:] in ((1024,), (1026,)):
                    continue
                if len(shape) == 1 and shape[0] >= 1026:
                    continue
                size = int(np.prod(shape))
                if size > best[0]:
                    best = (size, f"{eqn.primitive.name} -> {v.aval}")
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if isinstance(inner, jax.extend.core.Jaxpr):
                        visit(inner)

    visit(jaxpr.jaxpr)
    return best


def _grads(model, x, per_example: bool):
    def loss(m):
        y = jax.vmap(m)(x) if per_example else m(x)
        return jnp.sum(y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) / y.size)

    return eqx.filter_grad(loss)(model)


def _linear(getkey, recipe=None):
    lin = eqx.nn.Linear(IN, OUT, key=getkey())
    return fp8ax.fp8_linear_layers(lin, fp8ax.Fp8Config(recipe=recipe))


@pytest.mark.parametrize("calibrated", [False, True], ids=["fresh", "calibrated"])
def test_per_example_weight_gradient_is_one_gemm(calibrated, getkey):
    # No per-example weight gradient (B x OUT x IN) is ever formed; the largest array of
    # the step is the input batch. Before the vmap rule, the backward pass built
    # a (64, 16, 32) array of outer products and summed it.
    lin = _linear(getkey)
    x = jax.random.normal(getkey(), (B, IN))
    if calibrated:
        lin = fp8ax.calibrate(lin, lambda m, xb: jnp.mean(jax.vmap(m)(xb) ** 2), [x])
    jaxpr = jax.make_jaxpr(lambda m: _grads(m, x, per_example=True))(lin)
    size, where = _largest_intermediate(jaxpr)
    assert size <= B * IN, where


@pytest.mark.parametrize(
    "recipe", [None, fp8ax.DelayedScaling(calibrate_first_call=False)], ids=["default", "no-calibration"]
)
def test_per_example_gradients_equal_the_batched_call(recipe, getkey):
    # Bit for bit: the fold runs the same quantized values through one bigger GEMM, and
    # the new state is the same merged observation.
    lin = _linear(getkey, recipe)
    x = jax.random.normal(getkey(), (B, IN))
    for _ in range(2):  # a fresh layer (calibrating on its first call) and one with filled histories
        g_ex = jax.jit(lambda m: _grads(m, x, per_example=True))(lin)
        g_b = jax.jit(lambda m: _grads(m, x, per_example=False))(lin)
        for a, b in zip(jax.tree.leaves(g_ex), jax.tree.leaves(g_b)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        overwrite, rest = fp8ax.partition_for_grad_overwrite(g_ex)
        lin = fp8ax.apply_updates(lin, jax.tree.map(lambda g: -0.01 * g, rest), overwrite)
    assert float(lin.dot_general.grad.amax_history[1]) > 0  # two observations recorded


def test_nested_per_example_calls_fold_twice(getkey):
    # eqx.nn.MultiheadAttention-style: vmap over the batch, then over positions.
    lin = _linear(getkey)
    x = jax.random.normal(getkey(), (8, 8, IN))

    def loss(m, per_example):
        y = jax.vmap(jax.vmap(m))(x) if per_example else m(x)
        return jnp.sum(y**2)

    jaxpr = jax.make_jaxpr(eqx.filter_grad(lambda m: loss(m, True)))(lin)
    size, where = _largest_intermediate(jaxpr)
    assert size <= x.size, where
    g1 = eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, True)))(lin)
    g2 = eqx.filter_jit(eqx.filter_grad(lambda m: loss(m, False)))(lin)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        # The forward GEMM contracts the same values in the same order; the weight
        # gradient's GEMM sums 64 rows in one dot either way, up to f32 reassociation.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_per_example_scales_warn_once(getkey, monkeypatch):
    # Current scaling quantizes each example with its own scale, so the examples cannot
    # share one GEMM: fp8ax says so once, and computes per example as before.
    monkeypatch.setattr(_dense, "_WARNED", set())
    jax.clear_caches()  # the warning is given while a pass is traced, and JAX caches that
    lin = _linear(getkey, fp8ax.CurrentScaling())
    x = jax.random.normal(getkey(), (8, IN))
    with pytest.warns(UserWarning, match=r"per example under `jax.vmap`.*DelayedScaling") as record:
        g = jax.jit(lambda m: _grads(m, x, per_example=True))(lin)
    # One readable line: the recipe by its name, not its multi-line repr.
    message = str(next(w.message for w in record if "per example" in str(w.message)))
    assert "\n" not in message and "per-example scales (CurrentScaling) is called" in message, message
    # Reference: the sum of the examples' weight gradients, one separate call each.
    wy = jnp.arange(x.shape[0] * OUT, dtype=jnp.float32).reshape(x.shape[0], OUT) / (x.shape[0] * OUT)
    ref = sum(
        np.asarray(eqx.filter_grad(lambda m, i=i: jnp.sum(m(x[i]) * wy[i]))(lin).weight, dtype=np.float64)
        for i in range(x.shape[0])
    )
    # Each example quantized on its own scales in both: the same products, summed over
    # the examples in float32 (in another order) here and in float64 there.
    np.testing.assert_allclose(np.asarray(g.weight, np.float64), ref, rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda m: _grads(m, 2 * x, per_example=True))(lin)  # a new trace: no second warning


def test_ensembles_keep_their_own_state(getkey):
    # A state mapped by vmap (eqx.filter_vmap ensembles) is not folded: each member
    # records its own observation.
    keys = jax.random.split(getkey(), 3)
    ens = eqx.filter_vmap(lambda k: eqx.nn.Linear(IN, OUT, key=k))(keys)
    ens = fp8ax.fp8_linear_layers(ens)
    xs = jax.random.normal(getkey(), (3, 8, IN)) * jnp.array([1.0, 2.0, 4.0])[:, None, None]

    def loss(m):
        return jnp.sum(eqx.filter_vmap(lambda lin, x: jax.vmap(lin)(x))(m, xs) ** 2)

    overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_jit(eqx.filter_grad(loss))(ens))
    lhs_amax = np.asarray(overwrite.dot_general.lhs.amax_history)[:, 0]
    np.testing.assert_allclose(lhs_amax, np.max(np.abs(np.asarray(xs)), axis=(1, 2)), rtol=0)
