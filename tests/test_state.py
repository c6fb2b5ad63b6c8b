"""The FP8 state is the state of one merged observation, however often a layer is used.

Each test compares against an independent expectation: the same layer used once on the
concatenation of everything the several uses saw.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax

DIMS = (((1,), (0,)), ((), ()))


def _state(grads):
    return {
        name: (np.asarray(getattr(grads, name).scale), np.asarray(getattr(grads, name).amax_history))
        for name in ("lhs", "rhs", "grad")
    }


def _assert_same_state(a, b):
    for name in a:
        np.testing.assert_array_equal(a[name][0], b[name][0], err_msg=f"{name}.scale")
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=f"{name}.amax_history")


def _single_use(dg, xs, w, gys):
    x, gy = jnp.concatenate(xs), jnp.concatenate(gys)
    return _state(eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))(dg))


def _trained(getkey, recipe=None):
    # A layer with a non-empty history, so the delayed scales are in play.
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    x, w, gy = (jax.random.normal(getkey(), s) for s in ((4, 8), (8, 3), (4, 3)))
    grads = eqx.filter_grad(lambda dg: jnp.sum(dg(x * 2, w, DIMS) * gy))(dg)
    return fp8ax.apply_updates(dg, None, fp8ax.partition_for_grad_overwrite(grads)[0])


@pytest.mark.parametrize("trained", [False, True])
def test_layer_called_twice(trained, getkey):
    dg = _trained(getkey) if trained else fp8ax.Fp8DotGeneral.init()
    w = jax.random.normal(getkey(), (8, 3))
    x1, x2 = jax.random.normal(getkey(), (4, 8)), 5 * jax.random.normal(getkey(), (4, 8))
    g1, g2 = 3 * jax.random.normal(getkey(), (4, 3)), jax.random.normal(getkey(), (4, 3))

    def twice(dg):
        return jnp.sum(dg(x1, w, DIMS) * g1) + jnp.sum(dg(x2, w, DIMS) * g2)

    got = _state(eqx.filter_grad(twice)(dg))
    _assert_same_state(got, _single_use(dg, [x1, x2], w, [g1, g2]))
    # Regression: with summed cotangents (what plain float32 state gives) the kernel's
    # scale and newest amax would double, since both uses see the same kernel.
    once = _state(eqx.filter_grad(lambda dg: jnp.sum(dg(x1, w, DIMS) * g1))(dg))
    assert got["rhs"][1][0] == once["rhs"][1][0] != 2 * once["rhs"][1][0]
    assert got["rhs"][0] == once["rhs"][0]
    # ...and the history is shifted once, not once per use.
    np.testing.assert_array_equal(got["lhs"][1][1:], np.asarray(dg.lhs.amax_history)[:-1])


def test_tied_weights_in_two_layers(getkey):
    # Two calls with the same kernel through the same module, jitted.
    dg = _trained(getkey)
    w = jax.random.normal(getkey(), (8, 8))
    x = jax.random.normal(getkey(), (4, 8))
    gy = jax.random.normal(getkey(), (4, 8))

    @eqx.filter_jit
    def grads(dg):
        return eqx.filter_grad(lambda dg: jnp.sum(dg(jnp.tanh(dg(x, w, DIMS)), w, DIMS) * gy))(dg)

    g = _state(grads(dg))
    # Both uses see the same kernel: its newest amax is max|w|, not 2 max|w|, and the
    # scale is the one a single use computes from the history.
    assert g["rhs"][1][0] == np.float32(np.max(np.abs(np.asarray(w))))
    once = _state(eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))(dg))
    assert g["rhs"][0] == once["rhs"][0]


@pytest.mark.parametrize("jit", [False, True])
def test_layer_inside_scan_over_time(jit, getkey):
    dg = _trained(getkey)
    w = jax.random.normal(getkey(), (8, 3))
    xs = jax.random.normal(getkey(), (6, 4, 8)) * jnp.arange(1.0, 7.0)[:, None, None]
    gys = jax.random.normal(getkey(), (6, 4, 3)) * jnp.arange(6.0, 0.0, -1.0)[:, None, None]

    def rnn(dg):
        def body(carry, xg):
            x, gy = xg
            return carry + jnp.sum(dg(x, w, DIMS) * gy), None

        return jax.lax.scan(body, jnp.float32(0), (xs, gys))[0]

    grad_fn = eqx.filter_grad(rnn)
    got = _state((eqx.filter_jit(grad_fn) if jit else grad_fn)(dg))
    _assert_same_state(got, _single_use(dg, list(xs), w, list(gys)))


def test_layer_under_vmap_and_scan(getkey):
    # Per-example calls (vmap) inside a loop (scan): still one merged observation.
    dg = _trained(getkey)
    w = jax.random.normal(getkey(), (8, 3))
    xs = jax.random.normal(getkey(), (3, 4, 8)) * jnp.array([1.0, 9.0, 2.0])[:, None, None]
    gys = jax.random.normal(getkey(), (3, 4, 3))
    d1 = (((0,), (0,)), ((), ()))

    def loss(dg):
        def body(carry, xg):
            x, gy = xg
            return carry + jnp.sum(jax.vmap(lambda xi: dg(xi, w, d1))(x) * gy), None

        return jax.lax.scan(body, jnp.float32(0), (xs, gys))[0]

    _assert_same_state(_state(eqx.filter_grad(loss)(dg)), _single_use(dg, list(xs), w, list(gys)))


@pytest.mark.parametrize("operand", ["lhs", "rhs", "grad"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_never_enter_the_state(operand, bad, getkey):
    dg = _trained(getkey)
    x, w, gy = (
        jax.random.normal(getkey(), (4, 8)),
        jax.random.normal(getkey(), (8, 3)),
        jax.random.normal(getkey(), (4, 3)),
    )
    clean = {"lhs": x, "rhs": w, "grad": gy}
    poisoned = dict(clean)
    poisoned[operand] = clean[operand].at[1, 2].set(bad)

    def loss(dg, t):
        return jnp.sum(dg(t["lhs"], t["rhs"], DIMS) * t["grad"])

    # The result is non-finite exactly where plain JAX's is (an inf may come out as NaN,
    # as E4M3 has no inf).
    if operand != "grad":
        y = dg(poisoned["lhs"], poisoned["rhs"], DIMS)
        plain = jax.lax.dot_general(poisoned["lhs"], poisoned["rhs"], DIMS)
        np.testing.assert_array_equal(np.isfinite(np.asarray(y)), np.isfinite(np.asarray(plain)))
    else:
        dx = eqx.filter_grad(lambda x: jnp.sum(dg(x, w, DIMS) * poisoned["grad"]))(x)
        plain = jax.grad(lambda x: jnp.sum(jax.lax.dot_general(x, w, DIMS) * poisoned["grad"]))(x)
        np.testing.assert_array_equal(np.isfinite(np.asarray(dx)), np.isfinite(np.asarray(plain)))
    new = fp8ax.apply_updates(dg, None, fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(dg, poisoned))[0])
    want = fp8ax.apply_updates(dg, None, fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(dg, clean))[0])
    for name in ("lhs", "rhs", "grad"):
        # The poisoned operand's state is untouched; the others update as on clean data.
        expect = getattr(dg if name == operand else want, name)
        for a, b in zip(jax.tree.leaves(expect), jax.tree.leaves(getattr(new, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    # The next finite step is normal: it records the clean amax.
    newer = fp8ax.apply_updates(new, None, fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(new, clean))[0])
    assert float(getattr(newer, operand).amax_history[0]) == float(jnp.max(jnp.abs(clean[operand])))
    assert bool(jnp.all(jnp.isfinite(newer(x, w, DIMS))))


@pytest.mark.parametrize("loop", ["python", "fori_loop"])
def test_layer_in_a_pipeline_style_loop(loop, getkey):
    # The same layer applied repeatedly to its own output (shared-parameter stages).
    # Expectation: one use on the concatenation of what every stage saw, where the inputs
    # come from the forward pass and each stage's output gradient from a zero probe.
    dg = _trained(getkey)
    w = 0.5 * jax.random.normal(getkey(), (8, 8))
    x0 = jax.random.normal(getkey(), (4, 8))
    stages = 4

    def run(dg, probes):
        def stage(i, x):
            return jnp.tanh(dg(x, w, DIMS) + probes[i]) * (i + 1.0)

        if loop == "python":
            x, xs = x0, []
            for i in range(stages):
                xs.append(x)
                x = stage(i, x)
            return jnp.sum(x**2), xs
        return jax.lax.fori_loop(0, stages, stage, x0) ** 2, None

    zeros = jnp.zeros((stages, 4, 8))
    if loop == "python":
        _, xs = run(dg, zeros)
    else:
        # Each stage's input from a loop compiled as fori_loop's is (`lax.scan`, which
        # fori_loop with static bounds lowers to): the same fused `tanh`, bit for bit. Op by
        # op, outside a loop, XLA:CPU at -O0 (tests/conftest.py) rounded one input's tanh an
        # ulp away on jax 0.12.
        def stage_and_input(x, probe_and_factor):
            probe, factor = probe_and_factor
            return jnp.tanh(dg(x, w, DIMS) + probe) * factor, x

        factors = jnp.arange(1, stages + 1, dtype=jnp.float32)  # `i + 1.0`
        xs = list(jax.lax.scan(stage_and_input, x0, (zeros, factors))[1])
    gys = jax.grad(lambda p: jnp.sum(run(dg, p)[0]))(zeros)
    got = _state(eqx.filter_grad(lambda dg: jnp.sum(run(dg, zeros)[0]))(dg))
    _assert_same_state(got, _single_use(dg, xs, w, list(gys)))


def test_all_zero_tensor_keeps_the_scale(getkey):
    dg = _trained(getkey)
    w = jax.random.normal(getkey(), (8, 3))
    gy = jax.random.normal(getkey(), (4, 3))
    grads = eqx.filter_grad(lambda dg: jnp.sum(dg(jnp.zeros((4, 8)), w, DIMS) * gy))(dg)
    new = fp8ax.apply_updates(dg, None, fp8ax.partition_for_grad_overwrite(grads)[0])
    np.testing.assert_array_equal(np.asarray(new.lhs.scale), np.asarray(dg.lhs.scale))
    np.testing.assert_array_equal(np.asarray(new.lhs.amax_history), np.asarray(dg.lhs.amax_history))


def test_values_above_the_delayed_range_saturate(getkey):
    dg = _trained(getkey)  # history says |x| <~ 8
    w = jnp.ones((8, 3))
    y = dg(jnp.full((4, 8), 1e6), w, DIMS)
    # Every element of x clips to 448 (no inf); w's ones quantize to 1/rhs_scale (within
    # E4M3's 3 mantissa bits: 7% tolerance), so y = 8 * 448 * lhs_scale.
    assert bool(jnp.all(jnp.isfinite(y)))
    lhs_scale = float(jnp.max(dg.lhs.amax_history)) / 448.0
    np.testing.assert_allclose(np.asarray(y), 8 * 448.0 * lhs_scale, rtol=0.07)


def test_nan_in_a_large_tensor_observes_nothing(getkey):
    # On CPU, XLA reduces large arrays with a kernel that skips NaNs; a NaN must still
    # make the call observe nothing (regression: 256x1024 recorded the finite max).
    dg = _trained(getkey)
    x = jax.random.normal(getkey(), (256, 1024)).at[3, 4].set(jnp.nan)
    w = jax.random.normal(getkey(), (1024, 3))
    gy = jax.random.normal(getkey(), (256, 3))
    got = _state(eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))(dg))
    # The input observed nothing: its "new state" is the no-observation marker (unit 0,
    # stored scale 0, nothing recorded in front), which `apply_updates` turns into the
    # old state.
    lhs = eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))(dg).lhs
    data = np.asarray(jax.tree.leaves(lhs)[0])
    assert float(lhs.unit) == 0 and data[0] == 0 and data[1] == 0 and data[2] == 0
    new = fp8ax.apply_updates(
        dg, None, fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))(dg))[0]
    )
    np.testing.assert_array_equal(np.asarray(new.lhs.amax_history), np.asarray(dg.lhs.amax_history))
    np.testing.assert_array_equal(np.asarray(new.lhs.scale), np.asarray(dg.lhs.scale))
    # The weight's observation is unaffected.
    assert got["rhs"][1][0] == np.abs(np.asarray(w)).max()


def test_scaling_state_arguments_are_checked_and_its_parts_are_not_leaves():
    # One array holds unit, scale and history: shapes that do not fit are refused with
    # both named, and `eqx.tree_at` on a derived attribute says to replace the state.
    with pytest.raises(
        ValueError, match=r"`amax_history` must have shape `\(\*scale.shape, history_length\)`.*\(2, 4\)"
    ):
        fp8ax.ScalingState(jnp.ones(()), jnp.zeros((2, 4)))
    state = fp8ax.ScalingState(jnp.full((), 2.0), jnp.arange(4, dtype=jnp.float32), 0.5)
    # Read through the unit: the stored values over 0.5, against NumPy.
    np.testing.assert_array_equal(np.asarray(state.scale), np.float32(2.0) / np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(state.amax_history), np.arange(4, dtype=np.float32) / np.float32(0.5))
    assert float(state.unit) == 0.5 and jax.tree.leaves(state)[0].shape == (6,)
    with pytest.raises(AttributeError, match=r"replace the state: `dg.with_states\(lhs=fp8ax.ScalingState"):
        eqx.tree_at(lambda s: s.scale, state, jnp.ones(()))


def test_a_trained_layer_pickles_and_deep_copies(getkey):
    # Ray and `copy.deepcopy` go through pickle's protocol: the immutable state is rebuilt
    # with its values, bit for bit, and the copy trains on as the original does.
    import copy
    import pickle

    dg = _trained(getkey)
    x, w, gy = (jax.random.normal(getkey(), s) for s in ((4, 8), (8, 3), (4, 3)))
    step = eqx.filter_grad(lambda dg: jnp.sum(dg(x, w, DIMS) * gy))
    for copied in (pickle.loads(pickle.dumps(dg)), copy.deepcopy(dg)):
        assert jax.tree.structure(copied) == jax.tree.structure(dg)
        _assert_same_state(_state(copied), _state(dg))
        _assert_same_state(_state(step(copied)), _state(step(dg)))


def test_a_trace_leaves_no_tracer_alive(getkey):
    # The table that maps a state's float32 tracers to their max-accumulating value dies
    # with its trace. A table of the whole process kept every trace alive (a step traced
    # twice held both traces' tracers, thousands on a deep model), so memory grew with
    # every retrace and Python's collector made full passes over it.
    import gc

    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 8, 16, 2, key=getkey()))
    x = jax.random.normal(getkey(), (4, 8))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    @eqx.filter_jit
    def step(m, x):
        return fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(m, x))

    def live_tracers():
        jax.clear_caches()  # (what another test left in JAX's caches goes first)
        gc.collect()
        return sum(isinstance(o, jax.core.Tracer) for o in gc.get_objects())

    before = live_tracers()
    for _ in range(2):
        jax.clear_caches()
        overwrite, _ = step(model, x)
        jax.block_until_ready(overwrite)
    assert live_tracers() == before
