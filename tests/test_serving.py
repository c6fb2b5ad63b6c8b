"""Serving (issue 11): `fp8ax.to_serving` stores quantized weights, and the serving model
computes what the training model computes, bit for bit, for every recipe.

- Output equality with `assert_array_equal` under `jit`, on Haliax `Linear` and `Stacked`
  and on `eqx.nn.Linear`/`MLP`, bf16 and f32, each recipe (delayed: state as it stands).
- The stored weight against an independent reference (numpy + ml_dtypes), the frozen
  activation scale against the history by hand.
- Checkpoints: 1 byte per weight value, round trip into `fp8ax.serving_template`.
- Guard rails: gradients, converting twice, never-observed state, wrong checkpoints.
- PTQ: a plain model, calibrated (weights untouched), served.
"""

import io

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import Batch, Deep, HaliaxMLP, In, Mid, Out, mse, sgd_step, sqnr
from recipe_registry import REGISTRY

pytestmark = pytest.mark.needs_hax_dot

# Training an eqx MLP per example with per-example scales warns, once per recipe and
# process (tests/test_per_example.py); these tests are about serving.
pytestmark = [pytestmark, pytest.mark.filterwarnings("ignore:.*a layer with per-example scales:UserWarning")]

RECIPES = {name: entry.recipe for name, entry in REGISTRY.items()}  # tests/recipe_registry.py


def _eqx_mlp(key):
    return eqx.nn.MLP(In.size, Out.size, width_size=Mid.size, depth=2, key=key)


def _eqx_loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _trained(kind, config, dtype, getkey, steps=2):
    """A model of `kind` converted with `config`, cast to `dtype`, trained `steps` SGD
    steps; and an input batch."""
    if kind == "eqx":
        model, loss = _eqx_mlp(getkey()), _eqx_loss
        x = jax.random.normal(getkey(), (Batch.size, In.size)).astype(dtype)
        y = jax.random.normal(getkey(), (Batch.size, Out.size)).astype(dtype)
    else:
        model = HaliaxMLP.init(key=getkey()) if kind == "haliax" else Deep.init(key=getkey())
        loss = mse
        x = hax.random.normal(getkey(), (Batch, In)).astype(dtype)
        y = hax.random.normal(getkey(), (Batch, Out)).astype(dtype)
    model = fp8ax.cast_floating(fp8ax.fp8_linear_layers(model, config), dtype)
    step = sgd_step(loss)
    for _ in range(steps):
        model = step(model, x, y)
    return model, x


@eqx.filter_jit
def _forward(model, x):
    if isinstance(x, hax.NamedArray):
        return model(x).array
    return jax.vmap(model)(x)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
@pytest.mark.parametrize(
    "kind, dtype",
    [("haliax", jnp.float32), ("stacked", jnp.bfloat16), ("eqx", jnp.bfloat16)],
    ids=["haliax-f32", "stacked-bf16", "eqx-bf16"],
)
def test_serving_output_equals_training_output(recipe, kind, dtype, getkey):
    model, x = _trained(kind, fp8ax.Fp8Config(recipe=recipe), dtype, getkey)
    serving = fp8ax.to_serving(model)
    want = _forward(model, x)
    got = _forward(serving, x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.any(np.asarray(want, np.float32) != 0)


@pytest.mark.parametrize(
    "config",
    [
        fp8ax.Fp8Config(mode="qdq"),
        fp8ax.Fp8Config(compute_dtype=jnp.bfloat16),
        fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), lhs_recipe="off"),
        fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), lhs_recipe=fp8ax.Int8Scaling(), rhs_recipe=fp8ax.Int8Scaling()),
        fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), high_precision_gemms=("drhs",)),
    ],
    ids=["qdq", "compute-bf16", "lhs-off", "int8-operands", "hp-drhs"],
)
def test_serving_output_equals_training_output_for_gemm_settings(config, getkey):
    model, x = _trained("stacked", config, jnp.float32, getkey)
    x = x.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(_forward(fp8ax.to_serving(model), x)), np.asarray(_forward(model, x)))


def test_unbatched_and_weight_first_calls_equal_training(getkey):
    # eqx: one example at a time (no vmap).
    model, x = _trained("eqx", fp8ax.Fp8Config(), jnp.float32, getkey)
    serving = fp8ax.to_serving(model)
    np.testing.assert_array_equal(np.asarray(eqx.filter_jit(serving)(x[0])), np.asarray(eqx.filter_jit(model)(x[0])))
    # Haliax: an input with no batch axis; and one that shares an axis (Heads) with the
    # weight, where `hax.dot` passes the weight as the first operand of the dot general.
    Heads = hax.Axis("Heads", 4)
    for recipe in (fp8ax.CurrentScaling("row"), fp8ax.DelayedScaling()):
        lin = fp8ax.fp8_linear_layers(
            hax.nn.Linear.init(In, (Heads, Out), key=getkey()), fp8ax.Fp8Config(recipe=recipe)
        )
        x = hax.random.normal(getkey(), (Batch, Heads, In))
        lin = fp8ax.calibrate(lin, lambda m, x: hax.sum(m(x)).scalar(), [(x,)]) if recipe.stateful else lin
        serving = fp8ax.to_serving(lin)
        one = x["Batch", 0]["Heads", 0]
        np.testing.assert_array_equal(np.asarray(_forward(serving, one)), np.asarray(_forward(lin, one)))
        if recipe.stateful:
            with pytest.raises(ValueError, match=r"`\(the model itself\)`: `hax\.dot` passed the weight as the first"):
                serving(x)
        else:
            np.testing.assert_array_equal(np.asarray(_forward(serving, x)), np.asarray(_forward(lin, x)))


def test_stored_weight_and_frozen_scale_match_an_independent_reference(getkey):
    model, x = _trained("haliax", fp8ax.Fp8Config(), jnp.float32, getkey)
    serving = fp8ax.to_serving(model)
    for name in ("up_proj", "down_proj"):
        trained, served = getattr(model, name), getattr(serving, name)
        dg, sdg = trained.dot_general, served.dot_general
        # Delayed scaling, "max" over the history, margin 0: scale = max(history) / 448.
        w_scale = np.float32(np.max(np.asarray(dg.rhs.amax_history))) * np.float32(1 / 448)
        x_scale = np.float32(np.max(np.asarray(dg.lhs.amax_history))) * np.float32(1 / 448)
        assert np.asarray(sdg.weight_scale) == w_scale
        assert np.asarray(sdg.input_scale) == x_scale
        w = np.asarray(trained.weight.array, np.float32)
        ref = np.clip(w * (np.float32(1) / w_scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert served.weight.array.dtype == jnp.uint8 and served.weight.axes == trained.weight.axes
        np.testing.assert_array_equal(np.asarray(served.weight.array), ref.view(np.uint8))


def test_state_is_frozen_at_conversion(getkey):
    model, x = _trained("stacked", fp8ax.Fp8Config(), jnp.float32, getkey)
    serving = fp8ax.to_serving(model)
    before = _forward(serving, x)
    later = sgd_step(mse)(model, x * 4.0, hax.zeros((Batch, Out)))  # new state in the training model
    np.testing.assert_array_equal(np.asarray(_forward(serving, x)), np.asarray(before))
    assert not np.array_equal(np.asarray(_forward(later, x)), np.asarray(before))


def _nbytes(tree) -> int:
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, tree)
    return len(buf.getvalue())


@pytest.mark.parametrize("recipe", ["delayed", "int8", "mx", "mx-fp4", "nvfp4"])
def test_checkpoint_round_trip_and_size(recipe, getkey):
    In_, Mid_ = hax.Axis("In", 256), hax.Axis("Mid", 512)
    plain = HaliaxMLP.init(In_, Mid_, In_, key=getkey())
    x = hax.random.normal(getkey(), (Batch, In_))
    if recipe == "delayed":  # a bf16 model too (numpy writes bf16 as raw 2-byte records)
        plain, x = fp8ax.cast_floating(plain, jnp.bfloat16), x.astype(jnp.bfloat16)
    config = fp8ax.Fp8Config(recipe=RECIPES[recipe])
    model = fp8ax.fp8_linear_layers(plain, config)
    if recipe == "delayed":
        model = fp8ax.calibrate(model, lambda m, x: hax.sum(m(x)).scalar(), [(x,)])
    serving = fp8ax.to_serving(model)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, serving)
    buf.seek(0)
    like = fp8ax.serving_template(fp8ax.fp8_linear_layers(plain, config))
    loaded = fp8ax.tree_deserialise_leaves(buf, like)
    np.testing.assert_array_equal(np.asarray(_forward(loaded, x)), np.asarray(_forward(serving, x)))
    fp4 = RECIPES[recipe].fwd_dtype == jnp.float4_e2m1fn
    # 1 byte per value (FP4: two values per byte), plus scales (MXFP4's E8M0 scale per 8
    # values: a quarter more) and biases.
    weights = 2 * In_.size * Mid_.size // (2 if fp4 else 1)
    f32, bf16 = _nbytes(fp8ax.cast_floating(plain, jnp.float32)), _nbytes(fp8ax.cast_floating(plain, jnp.bfloat16))
    served = len(buf.getvalue())
    assert weights <= served < weights * (1.3 if fp4 else 1.2), (served, weights)
    assert served < 0.3 * f32 and served < (0.35 if fp4 else 0.6) * bf16, (served, f32, bf16)


def test_no_float_weight_is_kept(getkey):
    model, _ = _trained("eqx", fp8ax.Fp8Config(), jnp.bfloat16, getkey)
    serving = fp8ax.to_serving(model)
    for layer in serving.layers:
        assert isinstance(layer, fp8ax.ServingLinear)
        shapes = [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(layer)]
        assert (layer.weight.shape, jnp.dtype(jnp.uint8)) in shapes
        assert not any(s == layer.weight.shape and jnp.issubdtype(d, jnp.floating) for s, d in shapes), shapes


def test_gradients_are_refused_with_the_layer_name(getkey):
    model, x = _trained("stacked", fp8ax.Fp8Config(), jnp.float32, getkey)
    serving = fp8ax.to_serving(model)
    with pytest.raises(
        TypeError, match=r"`blocks\.stacked\.mlp\.up_proj` is a serving layer.*cannot be differentiated"
    ):
        eqx.filter_grad(lambda m: hax.sum(m(x)).scalar())(serving)
    with pytest.raises(TypeError, match=r"serving layer.*its input"):
        jax.grad(lambda a: hax.sum(serving(hax.NamedArray(a, x.axes))).scalar())(x.array)
    model, x = _trained("eqx", fp8ax.Fp8Config(recipe=fp8ax.Int8Scaling()), jnp.float32, getkey)
    with pytest.raises(TypeError, match=r"`layers\.0` is a serving layer"):
        eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x))))(fp8ax.to_serving(model))


def test_converting_twice_is_an_error(getkey):
    model, _ = _trained("haliax", fp8ax.Fp8Config(), jnp.float32, getkey)
    with pytest.raises(ValueError, match=r"`up_proj` is already a serving layer"):
        fp8ax.to_serving(fp8ax.to_serving(model))


def test_never_observed_state_is_an_error(getkey):
    fresh = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    with pytest.raises(
        ValueError,
        match=r"`blocks\.stacked\.mlp\.up_proj` \(stacked entries \[\(0,\), \(1,\), \(2,\)\].*"
        r"empty activation amax history.*fp8ax\.calibrate",
    ):
        fp8ax.to_serving(fresh)
    # Both causes are named: the training step dropped the state, or the layer never ran.
    with pytest.raises(ValueError) as excinfo:
        fp8ax.to_serving(fresh)
    msg = str(excinfo.value)
    assert "`eqx.apply_updates(model, updates)`" in msg and "fp8ax.apply_updates(model, updates, overwrite)" in msg
    assert msg.index("dropped") < msg.index("never saw a nonzero") < msg.index("fp8ax.calibrate")
    # A layer the data never reached: the head of a model whose loss ignores it.
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x = hax.random.normal(getkey(), (Batch, In))
    model = fp8ax.calibrate(model, lambda m, x: hax.sum(m.up_proj(x)).scalar(), [(x,)])
    with pytest.raises(ValueError, match=r"Layer `down_proj` has an empty activation"):
        fp8ax.to_serving(model)


@pytest.mark.parametrize("role, what", [("lhs", "activation"), ("rhs", "weight")])
def test_corrupt_state_is_an_error(role, what, getkey):
    # A state that went through an optimizer (`eqx.apply_updates` on the raw gradient)
    # would freeze a scale from values fp8ax never wrote.
    model, _ = _trained("haliax", fp8ax.Fp8Config(), jnp.float32, getkey)
    dg = model.down_proj.dot_general
    state = getattr(dg, role)
    bad = fp8ax.ScalingState(state.scale, state.amax_history.at[2].set(-0.5))
    broken = eqx.tree_at(lambda m: m.down_proj.dot_general, model, dg.with_states(**{role: bad}))
    with pytest.raises(
        ValueError, match=rf"Layer `down_proj`, {what} state.*negative or non-finite.*fp8ax\.apply_updates"
    ):
        fp8ax.to_serving(broken)


def test_plain_model_and_haliax_fp8_are_errors(getkey):
    plain = HaliaxMLP.init(key=getkey())
    with pytest.raises(ValueError, match=r"found no FP8 layer.*fp8_linear_layers"):
        fp8ax.to_serving(plain)
    import haliax.quantization as haxq

    hq = haxq.quantize_linear_layers(plain, haxq.QuantizationConfig(fp8=True))
    with pytest.raises(ValueError, match=r"`up_proj` uses Haliax's own Fp8DotGeneralOp"):
        fp8ax.to_serving(hq)
    with pytest.raises(ValueError, match=r"`up_proj` keeps its weight in high precision"):
        fp8ax.to_serving(
            fp8ax.fp8_linear_layers(plain, fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), rhs_recipe="off"))
        )


def test_cast_floating_leaves_serving_scales_alone(getkey):
    model, x = _trained("haliax", fp8ax.Fp8Config(), jnp.float32, getkey)
    serving = fp8ax.to_serving(model)
    cast = fp8ax.cast_floating(serving, jnp.bfloat16)
    assert cast.up_proj.dot_general.weight_scale.dtype == jnp.float32
    assert cast.up_proj.bias.array.dtype == jnp.bfloat16
    # The stored values stay; the layer computes in bfloat16, as the cast training layer.
    assert cast.up_proj.weight.array.dtype == serving.up_proj.weight.array.dtype
    assert _forward(cast, x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    blunt = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, serving)
    with pytest.raises(TypeError, match=r"`up_proj`: `weight_scale` has dtype bfloat16.*fp8ax\.cast_floating"):
        blunt(x)


def test_ptq_from_a_plain_model(getkey):
    plain = Deep.init(key=getkey())
    batches = [(hax.random.normal(getkey(), (Batch, In)),) for _ in range(3)]
    x = hax.random.normal(getkey(), (Batch, In))
    config = fp8ax.Fp8Config(targets=["up_proj", "down_proj"])  # the head stays plain (exempt)
    calibrated = fp8ax.calibrate(fp8ax.fp8_linear_layers(plain, config), lambda m, x: hax.sum(m(x)).scalar(), batches)
    assert eqx.tree_equal(fp8ax.strip_fp8(calibrated), plain)  # no weight changed
    serving = fp8ax.to_serving(calibrated)
    assert isinstance(serving.blocks.stacked.mlp.up_proj, fp8ax.ServingHaliaxLinear)
    assert type(serving.head) is hax.nn.Linear
    np.testing.assert_array_equal(np.asarray(_forward(serving, x)), np.asarray(_forward(calibrated, x)))
    assert (s := sqnr(_forward(plain, x), _forward(serving, x))) >= 20.0, f"PTQ output SQNR {s:.1f} dB is too low"


def test_deserialise_names_the_layer_and_what_to_call(getkey):
    plain = HaliaxMLP.init(key=getkey())
    x = hax.random.normal(getkey(), (Batch, In))
    fp8 = fp8ax.calibrate(fp8ax.fp8_linear_layers(plain), lambda m, x: hax.sum(m(x)).scalar(), [(x,)])
    serving = fp8ax.to_serving(fp8)

    def saved(tree):
        buf = io.BytesIO()
        eqx.tree_serialise_leaves(buf, tree)
        buf.seek(0)
        return buf

    cases = [
        (plain, fp8, r"layer `up_proj`.*holds a plain layer.*fp8ax\.strip_fp8\(like\)"),
        (fp8, plain, r"layer `up_proj`.*holds an FP8 training layer.*fp8ax\.fp8_linear_layers\(like, config\)"),
        (serving, fp8, r"layer `up_proj`.*holds a serving layer.*fp8ax\.serving_template"),
        (fp8, serving, r"layer `up_proj`.*holds an FP8 training layer.*fp8ax\.to_serving"),
        ((plain, jnp.zeros(3)), plain, r"holds 5 arrays but `like` has 4"),
    ]
    for tree, like, message in cases:
        with pytest.raises(ValueError, match=message):
            fp8ax.tree_deserialise_leaves(saved(tree), like)
    loaded = fp8ax.tree_deserialise_leaves(saved(fp8), fp8)
    assert eqx.tree_equal(loaded, fp8)


def test_eqx_gives_worse_errors_without_the_check(getkey):
    # Why `fp8ax.tree_deserialise_leaves` exists: Equinox names a leaf, not the kind.
    plain = HaliaxMLP.init(key=getkey())
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, (plain, jnp.zeros(3)))
    buf.seek(0)
    assert eqx.tree_equal(eqx.tree_deserialise_leaves(buf, plain), plain)  # trailing arrays are ignored
