"""Microbatch gradient accumulation: k microbatches then one update == one full-batch step.

The independent expectation is the single step on the concatenated batch. Parameters
agree to float32 rounding (the sum of k partial gradients is rounded differently from
one full-batch gradient: tolerance rtol 1e-5, atol 1e-6 on gradients of size ~1e-1);
the FP8 state must be bit-identical.
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from helpers import HaliaxMLP, In, Out

N, K = 32, 4
Batch = hax.Axis("Batch", N)


def _sum_loss(model, x, y):
    # Sum over the (micro)batch divided by the *full* batch size: per-example gradients
    # are then those of the full-batch mean loss.
    return hax.sum((model(x) - y) ** 2).scalar() / N


def _mean_loss(model, x, y):
    return hax.mean((model(x) - y) ** 2).scalar()


def _split(a: hax.NamedArray, k: int) -> list[hax.NamedArray]:
    n = a.axes[0].size // k
    return [hax.NamedArray(a.array[i * n : (i + 1) * n], (a.axes[0].resize(n), *a.axes[1:])) for i in range(k)]


def _leaves(tree):
    return [(jax.tree_util.keystr(p), np.asarray(v)) for p, v in jax.tree_util.tree_leaves_with_path(tree)]


def _assert_step_equal(got, want):
    """Ordinary gradients to f32 rounding, FP8 state bit for bit."""
    got_state, got_rest = fp8ax.partition_for_grad_overwrite(got)
    want_state, want_rest = fp8ax.partition_for_grad_overwrite(want)
    for (path, a), (_, b) in zip(_leaves(got_state), _leaves(want_state), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)
    for (path, a), (_, b) in zip(_leaves(got_rest), _leaves(want_rest), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.fixture
def setup(getkey):
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    # Inputs of different magnitude per microbatch, so each sees a different amax.
    mag = jnp.repeat(jnp.array([1.0, 7.0, 0.5, 3.0]), N // K)
    x = hax.random.normal(getkey(), (Batch, In)) * hax.named(mag, Batch)
    y = hax.random.normal(getkey(), (Batch, Out))
    # One step first, so the delayed scales (not the first-step calibration) are in play.
    grads = eqx.filter_grad(_sum_loss)(model, x, y)
    model = fp8ax.apply_updates(model, None, fp8ax.partition_for_grad_overwrite(grads)[0])
    return model, x, y


@pytest.mark.needs_hax_dot
def test_accumulate_gradients_equals_full_batch(setup):
    model, x, y = setup
    full = eqx.filter_grad(_sum_loss)(model, x, y)
    acc = None
    for xs, ys in zip(_split(x, K), _split(y, K)):
        acc = fp8ax.accumulate_gradients(acc, eqx.filter_grad(_sum_loss)(model, xs, ys))
    _assert_step_equal(acc, full)
    # Applying both gives the same model: parameters to f32 rounding, state bit for bit.
    step = lambda g: fp8ax.apply_updates(  # noqa: E731
        model,
        jax.tree.map(lambda u: -0.1 * u, fp8ax.partition_for_grad_overwrite(g)[1]),
        fp8ax.partition_for_grad_overwrite(g)[0],
    )
    _assert_step_equal(step(acc), step(full))


@pytest.mark.needs_hax_dot
def test_microbatched_scan_equals_full_batch(setup):
    model, x, y = setup
    full = eqx.filter_jit(eqx.filter_value_and_grad(_sum_loss))(model, x, y)
    got = eqx.filter_jit(fp8ax.microbatched(eqx.filter_value_and_grad(_sum_loss), K))(model, x, y)
    np.testing.assert_allclose(float(got[0]), float(full[0]), rtol=1e-6)
    _assert_step_equal(got[1], full[1])
    # The scan really ran K microbatches (not one): the jaxpr has a scan of length K.
    jaxpr = jax.make_jaxpr(lambda m: fp8ax.microbatched(eqx.filter_grad(_sum_loss), K)(m, x, y))(model)
    assert any(e.primitive.name == "scan" and e.params["length"] == K for e in jaxpr.eqns)


@pytest.mark.needs_hax_dot
def test_average_for_mean_losses_does_not_divide_the_state(setup):
    model, x, y = setup
    got = eqx.filter_jit(fp8ax.microbatched(eqx.filter_grad(_mean_loss), K, average=True))(model, x, y)
    # Gradients: those of the full batch's mean loss.
    full = eqx.filter_grad(_mean_loss)(model, x, y)
    _, got_rest = fp8ax.partition_for_grad_overwrite(got)
    for (path, a), (_, b) in zip(_leaves(got_rest), _leaves(fp8ax.partition_for_grad_overwrite(full)[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=path)
    # State: the output gradients of a microbatch's *mean* loss really are K times those
    # of the full batch's, and the state records what was quantized. So it equals the
    # full batch with its loss multiplied by K (a power of two: exact), not divided back.
    want, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda *a: K * _mean_loss(*a))(model, x, y))
    for (path, a), (_, b) in zip(_leaves(fp8ax.partition_for_grad_overwrite(got)[0]), _leaves(want), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)


@pytest.mark.needs_hax_dot
def test_first_step_state(getkey):
    # With an empty history each microbatch calibrates on its own amax. The weights' and
    # the model input's states only depend on those tensors: the max over microbatches
    # is the full batch's, bit for bit. The other tensors passed through layers that
    # used per-microbatch scales, so they differ by quantization noise (E4M3 steps are
    # 6-12% apart; tolerance 15%).
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x = hax.random.normal(getkey(), (Batch, In)) * hax.named(jnp.linspace(0.1, 5.0, N), Batch)
    y = hax.random.normal(getkey(), (Batch, Out))
    full, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(_sum_loss)(model, x, y))
    got, _ = fp8ax.partition_for_grad_overwrite(fp8ax.microbatched(eqx.filter_grad(_sum_loss), K)(model, x, y))
    for (path, a), (_, b) in zip(_leaves(got), _leaves(full), strict=True):
        if ".rhs." in path or path.startswith(".up_proj.dot_general.lhs"):
            np.testing.assert_array_equal(a, b, err_msg=path)
        else:
            np.testing.assert_allclose(a, b, rtol=0.15, err_msg=path)


@pytest.mark.needs_hax_dot
def test_summing_or_last_microbatch_would_be_wrong(setup):
    # What a plain tree sum and Levanter's accumulation (the last microbatch's state,
    # divided by k with every gradient) give. The state's unit is summed (divided) with
    # it, so neither scales the state: a sum reads as the mean of the microbatches'
    # states, and the last microbatch divided by k reads as the last microbatch's own.
    model, x, y = setup
    parts = [eqx.filter_grad(_sum_loss)(model, xs, ys) for xs, ys in zip(_split(x, K), _split(y, K))]
    full_state, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(_sum_loss)(model, x, y))
    summed = jax.tree.map(lambda *g: sum(g[1:], g[0]), *parts)
    summed_state, _ = fp8ax.partition_for_grad_overwrite(summed)
    last_state, _ = fp8ax.partition_for_grad_overwrite(jax.tree.map(lambda g: g / K, parts[-1]))
    part_state, _ = fp8ax.partition_for_grad_overwrite(parts[-1])
    want = full_state.up_proj.dot_general.rhs
    # The kernel is the same in every microbatch: its mean is the real state (K = 4: the
    # sum and the division are exact).
    np.testing.assert_array_equal(np.asarray(summed_state.up_proj.dot_general.rhs.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(np.asarray(summed_state.up_proj.dot_general.rhs.unit), K)
    # An activation's amax differs between microbatches: the mean is below the full
    # batch's, which is the max over microbatches (what `accumulate_gradients` keeps).
    full_amax = float(full_state.up_proj.dot_general.lhs.amax_history[0])
    assert float(summed_state.up_proj.dot_general.lhs.amax_history[0]) < full_amax
    np.testing.assert_array_equal(
        np.asarray(last_state.up_proj.dot_general.lhs.amax_history),
        np.asarray(part_state.up_proj.dot_general.lhs.amax_history),
    )
    assert float(last_state.up_proj.dot_general.lhs.amax_history[0]) <= full_amax
    merged = None
    for p in parts:
        merged = fp8ax.accumulate_gradients(merged, p)
    merged_state = fp8ax.partition_for_grad_overwrite(merged)[0].up_proj.dot_general
    np.testing.assert_array_equal(np.asarray(merged_state.rhs.scale), np.asarray(want.scale))
    np.testing.assert_array_equal(np.asarray(merged_state.lhs.amax_history[0]), full_amax)


def test_plain_arrays_and_an_unused_layer(getkey):
    # A bare Fp8DotGeneral on jnp arrays, and a second layer no microbatch uses.
    class Two(eqx.Module):
        used: fp8ax.Fp8DotGeneral
        unused: fp8ax.Fp8DotGeneral

    dims = (((1,), (0,)), ((), ()))
    model = Two(fp8ax.Fp8DotGeneral.init(), fp8ax.Fp8DotGeneral.init())
    w = jax.random.normal(getkey(), (8, 3))
    x = jax.random.normal(getkey(), (12, 8)) * jnp.arange(1.0, 13.0)[:, None]
    gy = jax.random.normal(getkey(), (12, 3))

    def loss(m, x, gy):
        return jnp.sum(m.used(x, w, dims) * gy)

    got = fp8ax.microbatched(eqx.filter_grad(loss), 3)(model, x, gy)
    full = eqx.filter_grad(loss)(model, x, gy)
    for (path, a), (_, b) in zip(_leaves(got), _leaves(full), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=path)
    assert float(got.unused.lhs.unit) == 0.0 and not bool(got.unused.lhs.written())  # "no observation"
    new = fp8ax.apply_updates(model, None, fp8ax.partition_for_grad_overwrite(got)[0])
    assert float(new.unused.lhs.scale) == 1.0 and float(new.used.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x)))


@pytest.mark.needs_hax_dot
def test_errors(setup):
    model, x, y = setup
    g = eqx.filter_grad(_sum_loss)(model, x, y)
    with pytest.raises(ValueError, match="same tree structure as `acc`"):
        fp8ax.accumulate_gradients(g, g.up_proj)
    with pytest.raises(ValueError, match=r"`num_microbatches` \(5\) must divide the leading axis of `batch\[0\]`"):
        fp8ax.microbatched(eqx.filter_grad(_sum_loss), 5)(model, x, y)
    with pytest.raises(ValueError, match="`num_microbatches` must be >= 1, got 0"):
        fp8ax.microbatched(eqx.filter_grad(_sum_loss), 0)
    with pytest.raises(TypeError, match="`num_microbatches` must be an int"):
        fp8ax.microbatched(eqx.filter_grad(_sum_loss), 2.0)
    with pytest.raises(TypeError, match="`fn` must be callable"):
        fp8ax.microbatched("grad", 2)
    with pytest.raises(TypeError, match="`average` must be a bool"):
        fp8ax.microbatched(eqx.filter_grad(_sum_loss), 2, average=1)


def test_module_accumulate_merges_state_by_max():
    # Newer marin-haliax (`CustomGradientAccumulation`) calls `.accumulate` on the state
    # "gradient" of each microbatch, the first time on an all-zero accumulator.
    rng = np.random.default_rng(0)
    base = fp8ax.Fp8DotGeneral.init()
    a = jax.tree.map(lambda v: jnp.asarray(rng.uniform(0, 2, v.shape), v.dtype), base)
    b = jax.tree.map(lambda v: jnp.asarray(rng.uniform(0, 2, v.shape), v.dtype), base)
    merged = a.accumulate(b)
    assert type(merged) is fp8ax.Fp8DotGeneral
    for m, x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(m), np.maximum(np.asarray(x), np.asarray(y)))
    zero = jax.tree.map(jnp.zeros_like, base)
    for m, x in zip(jax.tree.leaves(zero.accumulate(a)), jax.tree.leaves(a), strict=True):
        np.testing.assert_array_equal(np.asarray(m), np.asarray(x))
