"""Checkpoints lose nothing (issue 3, item 5).

- `eqx.tree_serialise_leaves` saves a converted model's weights *and* FP8 state, and a
  training run resumed from a checkpoint continues bit-for-bit.
- Haliax state dicts (`haliax.state_dict`, the Hugging Face export path) of a converted
  model hold exactly the plain model's weights, and importing plain weights keeps the FP8
  state. Haliax's own FP8 quantization adds extra keys, which is what fp8ax avoids.
- `fp8ax.strip_fp8` gives back the plain model, so plain checkpoints load into converted
  models with one line.
"""

import io

import equinox as eqx
import haliax as hax
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from haliax.state_dict import from_state_dict, to_state_dict

import fp8ax
from helpers import Batch, Deep, HaliaxMLP, In, Layers, Mid, Out, mse, sgd_step, without_fp8

# --------------------------------------------------------------------------- models


def _eqx_mlp(key):
    return eqx.nn.MLP(In.size, Out.size, width_size=Mid.size, depth=1, key=key)


def _eqx_mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _haliax_data(getkey):
    return hax.random.normal(getkey(), (Batch, In)), hax.random.normal(getkey(), (Batch, Out))


def _eqx_data(getkey):
    return jax.random.normal(getkey(), (Batch.size, In.size)), jax.random.normal(getkey(), (Batch.size, Out.size))


def _states(model):
    """Every FP8 dot general in `model`."""
    is_dg = lambda x: isinstance(x, fp8ax.Fp8DotGeneral)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_dg) if is_dg(x)]


def _assert_trees_bit_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _trees_differ(a, b) -> bool:
    return any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _round_trip(tree, like):
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, tree)
    buf.seek(0)
    return eqx.tree_deserialise_leaves(buf, like)


# ------------------------------------------------ 1. tree_serialise_leaves round trip


@pytest.mark.needs_hax_dot
def test_serialise_round_trip_haliax(getkey):
    x, y = _haliax_data(getkey)
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    step = sgd_step(mse)
    for _ in range(3):
        model = step(model, x, y)
    # The state is non-trivial: three amaxes recorded, scales moved off 1.
    assert np.count_nonzero(np.asarray(model.up_proj.dot_general.lhs.amax_history)) == 3
    assert float(model.down_proj.dot_general.grad.scale) != 1.0

    template = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    assert _trees_differ(template, model)
    loaded = _round_trip(model, template)
    # The arrays are the saved ones, and nothing else is a leaf.
    assert len(jax.tree.leaves(loaded)) == len(jax.tree.leaves(eqx.filter(loaded, eqx.is_array)))
    _assert_trees_bit_equal(loaded, model)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, model)
    buf.seek(0)
    _assert_trees_bit_equal(fp8ax.tree_deserialise_leaves(buf, template), model)
    assert isinstance(loaded.up_proj.dot_general, fp8ax.Fp8DotGeneral)


def test_serialise_round_trip_equinox_mlp(getkey):
    x, y = _eqx_data(getkey)
    model = fp8ax.fp8_linear_layers(_eqx_mlp(getkey()))
    step = sgd_step(_eqx_mse)
    for _ in range(3):
        model = step(model, x, y)
    assert np.count_nonzero(np.asarray(model.layers[0].dot_general.rhs.amax_history)) == 3

    template = fp8ax.fp8_linear_layers(_eqx_mlp(getkey()))
    assert _trees_differ(template, model)
    loaded = _round_trip(model, template)
    _assert_trees_bit_equal(loaded, model)
    assert all(isinstance(layer, fp8ax.Fp8Linear) for layer in loaded.layers)


# --------------------------------------------------------------------- 2. resume


@pytest.mark.needs_hax_dot
def test_resume_from_checkpoint_is_bit_exact(getkey):
    opt = optax.adam(1e-2)
    batches = [_haliax_data(getkey) for _ in range(10)]

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(mse)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    def init(key):
        model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=key))
        return model, opt.init(fp8ax.partition_for_grad_overwrite(model)[1])

    def run(model, opt_state, batches):
        losses = []
        for x, y in batches:
            model, opt_state, loss = step(model, opt_state, x, y)
            losses.append(float(loss))
        return model, opt_state, losses

    model, opt_state, _ = run(*init(getkey()), batches[:5])
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, (model, opt_state))

    final_model, final_opt_state, losses = run(model, opt_state, batches[5:])

    buf.seek(0)
    fresh = init(getkey())
    assert _trees_differ(fresh[0], model)
    resumed_model, resumed_opt_state = eqx.tree_deserialise_leaves(buf, fresh)
    resumed_model, resumed_opt_state, resumed_losses = run(resumed_model, resumed_opt_state, batches[5:])

    assert resumed_losses == losses
    _assert_trees_bit_equal(resumed_model, final_model)
    _assert_trees_bit_equal(resumed_opt_state, final_opt_state)

    # Contrast: the same weights and optimizer state with *fresh* FP8 state do not
    # resume the run exactly, so the FP8 state in the checkpoint is load-bearing.
    reset = fp8ax.fp8_linear_layers(fp8ax.strip_fp8(model))
    _, _, reset_losses = run(reset, opt_state, batches[5:])
    assert reset_losses != losses


# ------------------------------------------------------------ 3. Haliax state dicts


def _assert_state_dicts_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_state_dict_export_equals_plain_model(getkey):
    for plain in (HaliaxMLP.init(key=getkey()), Deep.init(key=getkey())):
        converted = fp8ax.fp8_linear_layers(plain)
        assert _states(converted)
        _assert_state_dicts_equal(to_state_dict(converted), to_state_dict(plain))


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_state_dict_of_stacked_model_has_per_layer_keys(getkey):
    plain = Deep.init(key=getkey())
    sd = to_state_dict(fp8ax.fp8_linear_layers(plain))
    # One entry per stacked layer (Haliax unstacks the Block axis), and no FP8 state.
    per_layer = [
        f"blocks.{i}.mlp.{lin}.{p}"
        for i in range(Layers.size)
        for lin in ("up_proj", "down_proj")
        for p in ("weight", "bias")
    ]
    assert sorted(sd) == sorted(per_layer + ["head.weight", "head.bias"])
    np.testing.assert_array_equal(
        np.asarray(sd["blocks.1.mlp.up_proj.weight"]), np.asarray(plain.blocks.stacked.mlp.up_proj.weight.array[1])
    )


@pytest.mark.needs_hax_dot
def test_state_dict_import_keeps_fp8_state(getkey):
    for make in (HaliaxMLP.init, Deep.init):
        data = _haliax_data(getkey)
        plain = make(key=getkey())
        template = sgd_step(mse)(fp8ax.fp8_linear_layers(make(key=getkey())), *data)  # non-fresh state
        assert all(float(np.max(np.asarray(dg.lhs.amax_history))) > 0 for dg in _states(template))

        loaded = from_state_dict(template, to_state_dict(plain))
        # Weights and biases come from the plain state dict...
        _assert_trees_bit_equal(fp8ax.strip_fp8(loaded), plain)
        # ... the FP8 state is the template's.
        _assert_trees_bit_equal(_states(loaded), _states(template))


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_haliax_quantization_adds_state_dict_keys(getkey):
    # Regression contrast: Haliax's own FP8 puts its scales and histories into the
    # export, so a converted model's checkpoint would not match the plain model's.
    plain = HaliaxMLP.init(key=getkey())
    ours = set(to_state_dict(fp8ax.fp8_linear_layers(plain)))
    theirs = set(to_state_dict(haxq.quantize_linear_layers(plain, haxq.QuantizationConfig(fp8=True))))
    assert ours == set(to_state_dict(plain))
    assert theirs > ours
    extra = theirs - ours
    assert all(".dot_general." in k for k in extra)
    assert "up_proj.dot_general.input_amax_history" in extra


# ------------------------------------------- 4. plain checkpoint into converted model


@pytest.mark.parametrize("kind", [pytest.param("haliax", marks=pytest.mark.needs_hax_dot), "equinox"])
def test_plain_checkpoint_loads_into_converted_model(kind, getkey, tmp_path):
    config = fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(history_length=16, calibrate_first_call=True))
    make, loss, data = {
        "haliax": lambda: (HaliaxMLP.init, mse, _haliax_data(getkey)),
        "equinox": lambda: (_eqx_mlp, _eqx_mse, _eqx_data(getkey)),
    }[kind]()
    plain = make(key=getkey())
    path = tmp_path / "plain.eqx"
    eqx.tree_serialise_leaves(path, plain)

    converted = sgd_step(loss)(fp8ax.fp8_linear_layers(make(key=getkey()), config), *data)
    assert all(float(dg.lhs.scale) != 1.0 for dg in _states(converted))

    model = fp8ax.fp8_linear_layers(eqx.tree_deserialise_leaves(path, fp8ax.strip_fp8(converted)), config)

    assert jax.tree.structure(model) == jax.tree.structure(converted)
    _assert_trees_bit_equal(fp8ax.strip_fp8(model), plain)
    for dg in _states(model):
        for state in (dg.lhs, dg.rhs, dg.grad):
            np.testing.assert_array_equal(np.asarray(state.scale), np.float32(1.0))
            np.testing.assert_array_equal(np.asarray(state.amax_history), np.zeros(16, np.float32))


# ---------------------------------------------------------------------- 5. strip_fp8


@pytest.mark.parametrize("kind", [pytest.param("haliax", marks=pytest.mark.needs_hax_dot), "equinox"])
def test_strip_fp8_gives_back_the_plain_model(kind, getkey):
    if kind == "haliax":
        x_hax = hax.random.normal(getkey(), (Batch, In))
        cases = [
            (HaliaxMLP.init(key=getkey()), lambda m: m(x_hax).array),
            (Deep.init(key=getkey()), lambda m: m(x_hax).array),
        ]
    else:
        x_eqx = jax.random.normal(getkey(), (Batch.size, In.size))
        cases = [(_eqx_mlp(getkey()), lambda m: jax.vmap(m)(x_eqx))]
    for plain, apply in cases:
        converted = fp8ax.fp8_linear_layers(plain)
        assert jax.tree.structure(converted) != jax.tree.structure(plain)
        stripped = fp8ax.strip_fp8(converted)
        assert jax.tree.structure(stripped) == jax.tree.structure(plain)
        _assert_trees_bit_equal(stripped, plain)
        assert not _states(stripped)
        # Exactly the plain model's output; the FP8 model's differs (so this is not vacuous).
        np.testing.assert_array_equal(np.asarray(apply(stripped)), np.asarray(apply(plain)))
        assert not np.array_equal(np.asarray(apply(converted)), np.asarray(apply(plain)))


@pytest.mark.needs_hax_dot
def test_strip_fp8_keeps_trained_weights(getkey):
    x, y = _haliax_data(getkey)
    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    trained = sgd_step(mse)(model, x, y)
    assert _trees_differ(without_fp8(trained), without_fp8(model))
    stripped = fp8ax.strip_fp8(trained)
    for a, b in zip(jax.tree.leaves(stripped), jax.tree.leaves(without_fp8(trained)), strict=True):
        assert a is b


def test_strip_fp8_of_plain_model_is_a_no_op(getkey):
    for plain in (HaliaxMLP.init(key=getkey()), Deep.init(key=getkey()), _eqx_mlp(getkey())):
        stripped = fp8ax.strip_fp8(plain)
        assert jax.tree.structure(stripped) == jax.tree.structure(plain)
        assert all(a is b for a, b in zip(jax.tree.leaves(stripped), jax.tree.leaves(plain), strict=True))


def test_strip_fp8_of_haliax_quantized_model(getkey):
    plain = HaliaxMLP.init(key=getkey())
    quantized = haxq.quantize_linear_layers(plain, haxq.QuantizationConfig(fp8=True))
    assert isinstance(quantized.up_proj.dot_general, haxq.Fp8DotGeneralOp)
    stripped = fp8ax.strip_fp8(quantized)
    assert isinstance(stripped.up_proj.dot_general, haxq.DefaultDotGeneralOp)
    assert isinstance(stripped.down_proj.dot_general, haxq.DefaultDotGeneralOp)
    assert jax.tree.structure(stripped) == jax.tree.structure(plain)
    _assert_trees_bit_equal(stripped, plain)


# ------------------------------- 6. checkpoints named by path (Orbax): check_checkpoint_metadata


def _described(tree):
    # What a checkpointer that names arrays by path records: each array's shape and
    # dtype, in the saved tree's structure (Orbax: `.metadata(path).item_metadata`).
    return jax.eval_shape(lambda: eqx.filter(tree, eqx.is_array))


@pytest.mark.parametrize("kind", [pytest.param("haliax", marks=pytest.mark.needs_hax_dot), "equinox"])
def test_check_checkpoint_metadata_tells_the_kinds_apart(kind, getkey):
    make = {"haliax": HaliaxMLP.init, "equinox": _eqx_mlp}[kind]
    layer = {"haliax": "up_proj", "equinox": "layers.0"}[kind]
    plain = make(key=getkey())
    training = fp8ax.fp8_linear_layers(plain)
    serving = fp8ax.serving_template(training)
    opt_state = optax.adam(1e-3).init(eqx.filter(fp8ax.partition_for_grad_overwrite(training)[1], eqx.is_array))
    arrays = lambda t: eqx.filter(t, eqx.is_array)  # noqa: E731

    # Each kind fits its own template, also inside a bigger tree and as abstract arrays.
    for tree in (plain, training, serving):
        fp8ax.check_checkpoint_metadata(_described(tree), arrays(tree))
    saved = {"model": training, "opt_state": opt_state}
    fp8ax.check_checkpoint_metadata(_described(saved), _described(saved))

    def error(saved_tree, like):
        with pytest.raises(ValueError) as e:
            fp8ax.check_checkpoint_metadata(_described(saved_tree), arrays(like))
        return str(e.value)

    msg = error(training, serving)
    assert msg.startswith(f"The checkpoint does not fit `like` at layer `{layer}`: `like` has a serving layer"), msg
    assert "The checkpoint holds an FP8 training layer" in msg and "`fp8ax.to_serving`" in msg, msg
    msg = error(serving, training)
    assert f"at layer `{layer}`: `like` has an FP8 training layer" in msg, msg
    assert "The checkpoint holds a serving layer" in msg and "fp8ax.serving_template" in msg, msg
    msg = error(training, plain)  # every leaf of `like` is there, the state is left over
    assert f"at layer `{layer}`: `like` has a plain layer" in msg and "holds an FP8 training layer" in msg, msg
    assert "arrays that `like` has no place for" in msg, msg
    msg = error(plain, training)
    assert f"at layer `{layer}`: `like` has an FP8 training layer" in msg and "holds a plain layer" in msg, msg
    assert "fp8ax.strip_fp8" in msg, msg
    # Another model altogether: no layer to blame.
    msg = error({"model": training, "opt_state": opt_state}, {"model": training, "opt_state": None})
    assert msg.startswith("The checkpoint does not fit `like`: the checkpoint holds"), msg
    assert "It was saved from another model." in msg, msg


@pytest.mark.parametrize("switch", [False, True])
def test_checkpoints_of_earlier_layouts_load(switch, getkey):
    # Until 2026-12-08 each FP8 layer with state saved its three states (lhs, rhs, grad)
    # as three records, where it now saves one with a role axis; until 2026-11-26 it also
    # had one more leaf after them, a Python float `calibrating`, which
    # `eqx.tree_serialise_leaves` saved as a scalar record. Such files (written here in
    # the same layouts) load with fp8ax's loader, the states stacked and the scalar
    # skipped, bit for bit; Equinox's own fails.
    import jax.tree_util as jtu

    mlp = lambda k: eqx.nn.MLP(8, 4, 16, 1, key=k)  # noqa: E731
    model = fp8ax.fp8_linear_layers(mlp(getkey()))
    x = jax.random.normal(getkey(), (4, 8))
    overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model))
    model = fp8ax.apply_updates(model, None, overwrite)
    is_dg = lambda v: isinstance(v, fp8ax.Fp8DotGeneral)  # noqa: E731

    def old(v):
        three = (v.lhs, v.rhs, v.grad)
        return (three, 0.0) if switch else three

    old_layout = jtu.tree_map(lambda v: old(v) if is_dg(v) else v, model, is_leaf=is_dg)
    assert len(jax.tree.leaves(old_layout)) == len(jax.tree.leaves(model)) + (3 if switch else 2) * 2
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, old_layout)
    template = fp8ax.fp8_linear_layers(mlp(getkey()))
    buf.seek(0)
    loaded = fp8ax.tree_deserialise_leaves(buf, template)
    _assert_trees_bit_equal(loaded, model)
    assert loaded.layers[0].dot_general.state.data.shape == (3, 1026)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="changed shape"):
        eqx.tree_deserialise_leaves(buf, template)
    # A checkpoint of a plain model into that template is still refused with fp8ax's error.
    plain = io.BytesIO()
    eqx.tree_serialise_leaves(plain, mlp(getkey()))
    plain.seek(0)
    with pytest.raises(ValueError, match="The checkpoint does not fit `like`"):
        fp8ax.tree_deserialise_leaves(plain, template)


def test_the_checks_know_mixture_of_experts_layers(getkey, tmp_path):
    # The checkpoint checks find layers from the one list of layer kinds, which holds the
    # MoE layers too: a mismatch there is named at the layer, with the kinds and the fix,
    # in both checkers (records of `eqx.tree_serialise_leaves`, and metadata by path).
    Experts, Embed, Mlp = hax.Axis("Experts", 4), hax.Axis("Embed", 16), hax.Axis("Mlp", 32)
    plain = {"experts": hax.nn.MoELinear.init(Experts, Embed, Mlp, key=getkey())}
    training = fp8ax.fp8_linear_layers(plain)
    assert isinstance(training["experts"], fp8ax.Fp8MoELinear)
    serving = fp8ax.serving_template(training)

    def error(saved_tree, like):
        with pytest.raises(ValueError) as e:
            fp8ax.check_checkpoint_metadata(_described(saved_tree), eqx.filter(like, eqx.is_array))
        return str(e.value)

    msg = error(plain, training)
    assert "at layer `experts`: `like` has an FP8 training layer" in msg and "holds a plain layer" in msg, msg
    msg = error(training, serving)
    assert "at layer `experts`: `like` has a serving layer" in msg, msg
    assert "The checkpoint holds an FP8 training layer" in msg, msg

    path = tmp_path / "plain.eqx"
    eqx.tree_serialise_leaves(path, plain)
    with pytest.raises(ValueError, match="at layer `experts`") as e:
        fp8ax.tree_deserialise_leaves(path, training)
    assert "holds a plain layer" in str(e.value), str(e.value)
