"""The max-accumulating float32 dtype (`fp8ax._maxgrad.MAXF32`) on its own.

These tests check the JAX mechanism fp8ax relies on, independently of the FP8 layers:
cotangents of a MAXF32 value accumulate with `max` (through `lax.scan` too), eager MAXF32
results work with `jax_debug_nans`/`jax_debug_infs`, and a JAX without the extended-dtype
protocol fails at import with an error that names its version.
"""

import pickle
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8ax
from fp8ax import _maxgrad
from fp8ax._maxgrad import MAXF32, raw_to_max, to_f32, to_max

DIMS = (((1,), (0,)), ((), ()))


def _observer(state_is_max: bool):
    """`observe(state, x)` returns `x`; its backward reports the columnwise amax of `x`
    as the cotangent of `state` (as an FP8 layer reports its new state), in `state`'s dtype."""

    @jax.custom_vjp
    def observe(state, x):
        return x

    def fwd(state, x):
        return x, x

    def bwd(x, g):
        amax = jnp.max(jnp.abs(x), axis=0)
        return (raw_to_max(amax) if state_is_max else amax), g

    observe.defvjp(fwd, bwd)
    return observe


def _scan_loss(state_is_max: bool, unroll: int):
    observe = _observer(state_is_max)

    def loss(state, xs):
        held = to_max(state) if state_is_max else state

        def body(carry, x):
            # `held` is closed over by the body and used on every iteration.
            return carry + jnp.sum(observe(held, x) ** 2), None

        return lax.scan(body, jnp.float32(0), xs, unroll=unroll)[0]

    return loss


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("unroll", [1, 2])
def test_scan_accumulates_a_closed_over_max_tangent_with_max(jit, unroll, getkey):
    steps, rows, cols = 5, 4, 3
    scales = np.array([1.0, 7.0, 0.5, 3.0, 2.0], np.float32)[:, None, None]
    xs = jax.random.normal(getkey(), (steps, rows, cols)) * scales
    state = jnp.zeros(cols, jnp.float32)

    grad = jax.grad(_scan_loss(True, unroll), argnums=(0, 1))
    g_state, g_xs = (jax.jit(grad) if jit else grad)(state, xs)

    # By hand: iteration t reports amax_t[c] = max_r |xs[t, r, c]|; the closed-over value
    # gets the elementwise max over the iterations, not their sum.
    per_step = np.max(np.abs(np.asarray(xs)), axis=1)  # (steps, cols)
    assert g_state.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g_state), per_step.max(axis=0))
    assert not np.allclose(per_step.max(axis=0), per_step.sum(axis=0))
    # The ordinary input's cotangent is untouched: d/dx sum(x**2) = 2x.
    np.testing.assert_allclose(np.asarray(g_xs), 2 * np.asarray(xs), rtol=1e-6)

    # Regression contrast: the same program with a float32 state sums the iterations.
    g_sum = jax.grad(_scan_loss(False, unroll))(state, xs)
    np.testing.assert_allclose(np.asarray(g_sum), per_step.sum(axis=0), rtol=1e-6)


def test_scan_carry_of_max_dtype_and_reverse_scan(getkey):
    # The same value, also used outside the scan and in a reversed scan: one max over all.
    xs = jax.random.normal(getkey(), (4, 2, 3)) * jnp.array([2.0, 5.0, 1.0, 3.0])[:, None, None]
    x_out = 9 * jax.random.normal(getkey(), (2, 3))
    observe = _observer(True)

    def loss(state):
        held = to_max(state)
        fwd = lax.scan(lambda c, x: (c + jnp.sum(observe(held, x)), None), jnp.float32(0), xs)[0]
        rev = lax.scan(lambda c, x: (c + jnp.sum(observe(held, -x)), None), jnp.float32(0), xs, reverse=True)[0]
        return fwd + rev + jnp.sum(observe(held, x_out))

    got = jax.jit(jax.grad(loss))(jnp.zeros(3, jnp.float32))
    want = np.maximum(np.abs(np.asarray(xs)).max(axis=(0, 1)), np.abs(np.asarray(x_out)).max(axis=0))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_conversions():
    x = jnp.array([0.0, 1.5, 4.0], jnp.float32)
    m = to_max(x)
    assert m.dtype == MAXF32 and m.shape == x.shape and _maxgrad.is_max(m)
    np.testing.assert_array_equal(np.asarray(to_f32(m)), np.asarray(x))
    # Only float32, the physical dtype, converts to and from MAXF32.
    with pytest.raises(ValueError):
        lax.convert_element_type(jnp.zeros(3, jnp.float16), MAXF32)
    with pytest.raises(ValueError):
        lax.convert_element_type(m, jnp.float16)
    # The rules JAX reads: `allow_conversion` (a legacy `convert_to`/`convert_from` would win over it).
    assert MAXF32._rules.allow_conversion is True
    assert not hasattr(MAXF32._rules, "convert_to") and not hasattr(MAXF32._rules, "convert_from")


def test_eager_adder_takes_the_max():
    from jax._src import ad_util

    a, b = to_max(jnp.array([1.0, 5.0, 0.0])), to_max(jnp.array([3.0, 2.0, 0.0]))
    for _ in range(2):  # the second call takes jit's C++ fast path
        out = ad_util.add_jaxvals(a, b)
        assert out.dtype == MAXF32
        np.testing.assert_array_equal(np.asarray(to_f32(out)), [3.0, 5.0, 0.0])


def test_an_eager_adder_already_registered_is_kept():
    code = textwrap.dedent(
        """
        from jax._src import ad_util, earray

        def mine(x, y):
            raise AssertionError("not called here")

        ad_util.raw_jaxval_adders[earray.EArray] = mine
        import fp8ax
        assert ad_util.raw_jaxval_adders[earray.EArray] is mine
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture
def debug_nans_and_infs():
    with jax.debug_nans(True), jax.debug_infs(True):
        yield


def test_eager_max_arrays_with_debug_nans_and_infs(debug_nans_and_infs):
    # Eager results of MAXF32 type go through the dtype's result handler (with the debug
    # flags, JAX calls its `pre_wrap`) and, from the second call on, through jit's fast path
    # (which reads their `addressable_shards`). Neither may fail on finite values...
    for _ in range(3):
        m = to_max(jnp.array([1.0, 2.0]))
        np.testing.assert_array_equal(np.asarray(to_f32(m)), [1.0, 2.0])
    # ...and both still check the float32 buffer.
    for bad in (np.nan, np.inf):
        for _ in range(2):
            with pytest.raises(FloatingPointError):
                to_max(jnp.array([1.0, bad]))


def _eqx_model_and_data(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 3, width_size=16, depth=1, key=getkey()))
    x = jax.random.normal(getkey(), (6, 8))
    y = jax.random.normal(getkey(), (6, 3))
    return model, x, y


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _train(model, x, y, steps, jit):
    def step(model):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(_loss)(model, x, y))
        return fp8ax.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads), overwrite)

    step = eqx.filter_jit(step) if jit else step
    for _ in range(steps):
        model = step(model)
    return model


def test_eager_training_with_debug_nans_and_infs(getkey):
    # An un-jitted grad of a converted Equinox model, three steps, with both flags on:
    # the same model as the jitted steps without the flags.
    model, x, y = _eqx_model_and_data(getkey)
    with jax.debug_nans(True), jax.debug_infs(True):
        eager = _train(model, x, y, 3, jit=False)
    jitted = _train(model, x, y, 3, jit=True)
    for layer_e, layer_j in zip(eager.layers, jitted.layers):
        for name in ("lhs", "rhs", "grad"):
            se, sj = getattr(layer_e.dot_general, name), getattr(layer_j.dot_general, name)
            np.testing.assert_allclose(np.asarray(se.scale), np.asarray(sj.scale), rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(
                np.asarray(se.amax_history), np.asarray(sj.amax_history), rtol=1e-6, err_msg=name
            )
        np.testing.assert_allclose(np.asarray(layer_e.weight), np.asarray(layer_j.weight), rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(np.asarray(eager.layers[0].dot_general.lhs.amax_history)) == 3


def test_eager_grad_of_a_layer_used_twice_with_debug_nans_and_infs(debug_nans_and_infs, getkey):
    # Two uses in one eager grad: their MAXF32 cotangents are added eagerly, with max.
    dg = fp8ax.Fp8DotGeneral.init()
    w = jax.random.normal(getkey(), (8, 3))
    x1, x2 = jax.random.normal(getkey(), (4, 8)), 5 * jax.random.normal(getkey(), (4, 8))
    g1, g2 = jax.random.normal(getkey(), (4, 3)), 3 * jax.random.normal(getkey(), (4, 3))

    def twice(dg):
        return jnp.sum(dg(x1, w, DIMS) * g1) + jnp.sum(dg(x2, w, DIMS) * g2)

    for _ in range(2):
        got = eqx.filter_grad(twice)(dg)
        assert float(got.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x2)))  # max(|x1|, |x2|), not the sum
        assert float(got.rhs.amax_history[0]) == float(jnp.max(jnp.abs(w)))  # the kernel once, not twice
        assert float(got.grad.amax_history[0]) == float(jnp.maximum(jnp.max(jnp.abs(g1)), jnp.max(jnp.abs(g2))))


@pytest.mark.parametrize("module,name", [("dtypes", "extended"), ("dtypes", "ExtendedDType"), ("earray", "EArray")])
def test_missing_extended_dtype_protocol_is_a_clear_import_error(module, name):
    code = textwrap.dedent(
        f"""
        import equinox, haliax, jax, optax  # what fp8ax imports: JAX itself uses the protocol
        from jax._src import {module} as m
        delattr(m, {name!r})  # as in a JAX that has dropped or renamed it
        try:
            import fp8ax
        except ImportError as e:
            print("ImportError:", e)
        else:
            print("imported")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("ImportError:"), out
    assert f"jax {jax.__version__}" in out and f"jax._src.{module}.{name}" in out, out
    assert "jax>=0.10,<0.13" in out, out


def test_conversions_linearise_without_jax_fallback(getkey, monkeypatch):
    # `jax.grad` linearises the state's conversions and its use watch with rules of their
    # own (JAX's fallback traces the JVP rule into a jaxpr at every use: a fifth of a deep
    # model's trace). On every JAX fp8ax supports the rule is registered, the gradients and
    # the new state are those the fallback gives, and an unused layer is still reported.
    from jax._src.interpreters import ad

    prims = (_maxgrad._to_f32_p, _maxgrad._to_max_p, _maxgrad._watch_p)
    assert _maxgrad._linearization_protocol() in (4, 5)
    assert all(p in ad.primitive_linearizations for p in prims)

    x, w, gy = (jax.random.normal(getkey(), s) for s in ((4, 8), (8, 3), (4, 3)))
    model = fp8ax.fp8_linear_layers(
        eqx.nn.Sequential([eqx.nn.Linear(8, 8, key=getkey()), eqx.nn.Linear(8, 3, key=getkey())])
    )

    def loss(m):  # the first layer twice (merged by max), the second once
        first = jax.vmap(m.layers[0])
        return jnp.sum(jax.vmap(m.layers[1])(first(first(x * 2))) * gy)

    def grads():
        g = eqx.filter_grad(loss)(model)
        return [np.asarray(a) for a in jax.tree.leaves(g)]

    fallbacks = []
    fallback = ad.fallback_linearize_rule
    monkeypatch.setattr(
        ad, "fallback_linearize_rule", lambda p, *a, **k: (fallbacks.append(p), fallback(p, *a, **k))[1]
    )
    with_rules = grads()
    assert not [p for p in fallbacks if p in prims]
    for p in prims:
        monkeypatch.delitem(ad.primitive_linearizations, p)
    without = grads()
    assert [p for p in fallbacks if p in prims]
    assert len(with_rules) == len(without)
    for a, b in zip(with_rules, without):
        np.testing.assert_array_equal(a, b)
    monkeypatch.undo()

    # (A label no other test uses: a layer any earlier trace called is not reported.)
    pair = fp8ax.fp8_linear_layers(
        {"linearised": eqx.nn.Linear(8, 8, key=getkey()), "never": eqx.nn.Linear(8, 8, key=getkey())}
    )
    with pytest.warns(fp8ax.UnusedLayerWarning, match="`never` is never called"):
        eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m["linearised"])(x)))(pair)


def test_layer_names_do_not_enter_the_tree_structure():
    from fp8ax._state import LayerName

    a, b = LayerName("encoder.0"), LayerName("decoder.3")
    assert a == b and hash(a) == hash(b) and a != "encoder.0" and a != None  # noqa: E711
    assert pickle.loads(pickle.dumps(a)).name == "encoder.0" and repr(a) == "'encoder.0'"
    with pytest.raises(AttributeError):
        a.name = "x"


def test_layers_alike_share_a_jit_and_the_unused_one_is_named(getkey):
    # A layer's name is static data equal to every other one (`LayerName`), so layers
    # alike (the same settings and shapes) flatten to one tree structure, and a `jit`
    # traced for one is reused for the others (as `hax.dot`'s `eqx.filter_jit` is, one per
    # layer call). The warning about an unused layer cannot rely on the layers' own
    # traces then: it names the one layer the step leaves out, and no other, from the
    # cotangents of the views of their states that the jitted calls were given. (Labels
    # no other test uses: a layer any earlier trace used is not reported.)
    names = ("alike_used_a", "alike_used_b", "alike_used_c", "alike_left_out")
    model = fp8ax.fp8_linear_layers({k: eqx.nn.Linear(8, 8, key=getkey()) for k in names})
    assert len({jax.tree.structure(model[k]) for k in names}) == 1
    traces = []

    @eqx.filter_jit
    def apply(layer, x):
        traces.append(None)
        return layer(x)

    def loss(m, x):
        for k in names[:3]:
            x = apply(m[k], x)
        return jnp.sum(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = eqx.filter_grad(loss)(model, jnp.ones((8,)))
    assert len(traces) == 1
    unused = [str(w.message) for w in caught if issubclass(w.category, fp8ax.UnusedLayerWarning)]
    assert len(unused) == 1 and "`alike_left_out` is never called" in unused[0]
    # The reused trace writes each layer's own state.
    overwrite, _ = fp8ax.partition_for_grad_overwrite(grads)
    amaxes = [float(overwrite[k].dot_general.rhs.amax_history[0]) for k in names[:3]]
    want = [float(jnp.max(jnp.abs(model[k].weight))) for k in names[:3]]
    assert amaxes == want
