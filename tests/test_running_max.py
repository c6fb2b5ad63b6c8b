"""A stateful recipe fp8ax does not know (tests/running_max.py) through everything that
reads FP8 state: training and `apply_updates`, `calibrate`, `scaling_stats`,
`plot_amax_history`, `to_serving` and checkpoints. Each expected number is replayed by
hand from the data (a running max of amaxes, NumPy)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from helpers import adam_trained
from running_max import RunningMax, RunningMaxScaling


def _mlp(key):
    model = eqx.nn.MLP(16, 8, 32, 1, key=key)
    return fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(recipe=RunningMaxScaling()))


def _loss(x):
    return lambda m: jnp.mean(jax.vmap(m)(x) ** 2)


def test_the_state_is_the_recipes(getkey):
    model = _mlp(getkey())
    dg = model.layers[0].dot_general
    assert all(isinstance(s, RunningMax) for s in (dg.lhs, dg.rhs, dg.grad))
    assert jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(dg.lhs)[0][0][0]) == ".amax"
    assert repr(dg.lhs) == "RunningMax(amax=f32[])"
    with pytest.raises(TypeError, match=r"takes 1 arrays \('amax',\), got 2"):
        RunningMax(jnp.zeros(()), jnp.zeros(()))
    with pytest.raises(AttributeError, match="immutable"):
        dg.lhs.amax = jnp.ones(())


def test_a_bad_state_type_is_refused_where_it_is_declared():
    with pytest.raises(TypeError, match=r"`Bad.entry_ndims` must give one int per field \(2\)"):

        class Bad(fp8ax.AbstractState):
            fields = ("a", "b")
            entry_ndims = (0,)

    with pytest.raises(TypeError, match="is a base class"):
        fp8ax.AbstractState()


def test_training_records_the_running_max(getkey):
    # The first layer sees `x` on every step: its input state is max|x| over the steps;
    # a step with a larger batch raises it, a smaller one leaves it.
    model = _mlp(getkey())
    x = jax.random.normal(getkey(), (8, 16))
    model = adam_trained(model, _loss(x), 2)
    np.testing.assert_array_equal(np.asarray(model.layers[0].dot_general.lhs.amax), np.max(np.abs(np.asarray(x))))
    model = adam_trained(model, _loss(3 * x), 1)
    model = adam_trained(model, _loss(0.5 * x), 1)
    np.testing.assert_array_equal(np.asarray(model.layers[0].dot_general.lhs.amax), np.max(np.abs(3 * np.asarray(x))))
    # The weight's: the largest amax of the weight the steps quantized (before each update).
    assert float(model.layers[0].dot_general.rhs.amax) > 0 and float(model.layers[1].dot_general.grad.amax) > 0


def test_calibrate_stats_and_plot(getkey, tmp_path):
    model = _mlp(getkey())
    xs = [jax.random.normal(getkey(), (8, 16)) * s for s in (1.0, 4.0, 2.0)]
    calibrated = fp8ax.calibrate(model, lambda m, x: _loss(x)(m), [(x,) for x in xs])
    want = max(float(np.max(np.abs(np.asarray(x)))) for x in xs)
    assert float(calibrated.layers[0].dot_general.lhs.amax) == want
    stats = fp8ax.scaling_stats(calibrated)
    assert stats["layers.0/lhs/running_amax"] == want
    assert {k.rsplit("/", 1)[1] for k in stats} == {"running_amax"}
    assert len(stats) == 6  # two layers, three states each
    path = fp8ax.plot_amax_history(calibrated, tmp_path / "amax.png")
    assert path.stat().st_size > 0


def test_serving_freezes_the_recipes_scale(getkey):
    plain_model = eqx.nn.MLP(16, 8, 32, 1, key=getkey())
    model = fp8ax.fp8_linear_layers(plain_model, fp8ax.Fp8Config(recipe=RunningMaxScaling()))
    x = jax.random.normal(getkey(), (8, 16))
    with pytest.raises(ValueError, match=r"`layers\.0` has an empty activation amax history"):
        fp8ax.to_serving(model)
    model = adam_trained(model, _loss(x), 2)
    serving = fp8ax.to_serving(model)
    # The frozen input scale is the recipe's: max|x| / 448 (float32), and serving computes
    # what the trained layer computes on the same input.
    got = np.asarray(serving.layers[0].dot_general.input_scale)
    np.testing.assert_array_equal(got, np.max(np.abs(np.asarray(x))) * np.float32(1 / 448))
    np.testing.assert_array_equal(np.asarray(jax.vmap(serving)(x)), np.asarray(jax.vmap(model)(x)))


def test_corrupt_state_is_refused_by_serving(getkey):
    model = adam_trained(_mlp(getkey()), _loss(jax.random.normal(getkey(), (8, 16))), 1)
    dg = model.layers[1].dot_general
    bad = eqx.tree_at(lambda m: m.layers[1].dot_general, model, dg.with_states(rhs=RunningMax(jnp.float32(-1.0))))
    with pytest.raises(ValueError, match=r"Layer `layers\.1`, weight state \(`rhs`\): .*went through an optimizer"):
        fp8ax.to_serving(bad)


def test_checkpoints(getkey, tmp_path):
    key = getkey()
    model = adam_trained(_mlp(key), _loss(jax.random.normal(getkey(), (8, 16))), 1)
    eqx.tree_serialise_leaves(tmp_path / "m.eqx", model)
    loaded = fp8ax.tree_deserialise_leaves(tmp_path / "m.eqx", _mlp(key))
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A delayed-scaling checkpoint in a running-max template: both are FP8 training
    # layers, whose states differ.
    delayed = fp8ax.fp8_linear_layers(eqx.nn.MLP(16, 8, 32, 1, key=key))
    eqx.tree_serialise_leaves(tmp_path / "d.eqx", delayed)
    with pytest.raises(ValueError, match=r"an FP8 training layer.*same kind in both but its arrays differ.*recipe"):
        fp8ax.tree_deserialise_leaves(tmp_path / "d.eqx", _mlp(key))
    # A plain checkpoint in a running-max template.
    eqx.tree_serialise_leaves(tmp_path / "p.eqx", eqx.nn.MLP(16, 8, 32, 1, key=key))
    with pytest.raises(ValueError, match=r"The checkpoint holds a plain layer"):
        fp8ax.tree_deserialise_leaves(tmp_path / "p.eqx", _mlp(key))


def test_a_recipe_without_serving_scale_is_refused_by_name(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(16, 8, 32, 1, key=getkey()), fp8ax.Fp8Config(recipe=_Wrapped("")))
    model = adam_trained(model, _loss(jax.random.normal(getkey(), (8, 16))), 1)
    with pytest.raises(ValueError, match=r"stateful recipe _Wrapped, which does not say how to freeze.*serving_scale"):
        fp8ax.to_serving(model)


class _Wrapped(fp8ax.AbstractStatefulRecipe):
    """RunningMaxScaling as a user's half-written recipe: no `serving_scale`, and one
    mistake (`broken`)."""

    broken: str = eqx.field(static=True)
    inner: RunningMaxScaling = RunningMaxScaling()
    fwd_dtype = property(lambda self: self.inner.fwd_dtype)
    grad_dtype = property(lambda self: self.inner.grad_dtype)
    stateful = property(lambda self: True)
    scale_layout = property(lambda self: "tensor")

    def init_state(self, batch_shape=()):
        return self.inner.init_state(batch_shape)

    def quantize_operand(self, *args, **kwargs):
        q, new = self.inner.quantize_operand(*args, **kwargs)
        if self.broken == "bare state":
            return q, new[0]
        if self.broken == "state shape":
            return q, (jnp.stack([new[0], new[0]]),)
        if self.broken == "values":
            return q.values, new
        return q, new

    def state_observed(self, state):
        return self.inner.state_observed(state)


@pytest.mark.parametrize(
    "broken, error, match",
    [
        (
            "bare state",
            TypeError,
            r"_Wrapped must return the new state as a tuple of 1 arrays .*got an array of shape \(\) and dtype float32\.",
        ),
        ("state shape", ValueError, r"_Wrapped returned a new state array of shape \(2,\) for one of shape \(\)"),
        (
            "values",
            TypeError,
            r"_Wrapped must quantize to an `fp8ax.QuantizedArray`, got an array of shape \(4, 16\) and dtype float8_e4m3fn",
        ),
    ],
)
def test_a_half_written_recipe_fails_where_it_is_wrong(broken, error, match, getkey):
    dg = fp8ax.Fp8DotGeneral.init(_Wrapped(broken))
    x, w = jax.random.normal(getkey(), (4, 16)), jax.random.normal(getkey(), (16, 8))
    with pytest.raises(error, match=match):
        jax.grad(lambda x: jnp.sum(dg(x, w, (((1,), (0,)), ((), ())))))(x)


def test_a_stateful_recipe_without_state_observed_says_so():
    # `init_state`, `quantize_operand` and `state_observed` are what a stateful recipe
    # must define: without one it is not built.
    class _Unobserved(fp8ax.AbstractStatefulRecipe):
        fwd_dtype = property(lambda self: np.dtype(jnp.float8_e4m3fn))
        grad_dtype = property(lambda self: np.dtype(jnp.float8_e5m2))
        scale_layout = property(lambda self: "tensor")

        def init_state(self, batch_shape=()):
            return RunningMaxScaling().init_state(batch_shape)

        def quantize_operand(self, *args, **kwargs):
            return RunningMaxScaling().quantize_operand(*args, **kwargs)

    with pytest.raises(TypeError, match="state_observed"):
        _Unobserved()


def test_a_stateful_recipe_on_the_stateless_contract_is_refused_by_name():
    # The state's members live on `AbstractStatefulRecipe`; a recipe that says it keeps
    # state but derives from the common base is told which base to use.
    class _OnTheCommonBase(fp8ax.AbstractScalingRecipe):
        fwd_dtype = property(lambda self: np.dtype(jnp.float8_e4m3fn))
        grad_dtype = property(lambda self: np.dtype(jnp.float8_e5m2))
        stateful = property(lambda self: True)
        scale_layout = property(lambda self: "tensor")

        def quantize_operands(self, operands):
            return RunningMaxScaling().quantize_operands(operands)

    with pytest.raises(
        TypeError, match=r"_OnTheCommonBase keeps state .*derive it from `fp8ax.AbstractStatefulRecipe`"
    ):
        _OnTheCommonBase()
