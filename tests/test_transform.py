"""fp8_linear_layers, Fp8Config and Fp8Linear."""

import dataclasses

import equinox as eqx
import haliax as hax
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from helpers import Batch, Block, Deep, HaliaxMLP, In, Layers, Mid, Out, mse, sgd_step, sqnr


def _converted_paths(model):
    out = []

    def visit(path, node):
        if isinstance(node, hax.nn.Linear) and isinstance(node.dot_general, fp8ax.Fp8DotGeneral):
            out.append(fp8ax._model.path_str(path))
        if isinstance(node, fp8ax.Fp8Linear):
            out.append(fp8ax._model.path_str(path))
        return node

    jax.tree_util.tree_map_with_path(visit, model, is_leaf=fp8ax._model.is_linear)
    return out


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_converts_every_haliax_linear(getkey):
    m = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    assert _converted_paths(m) == ["up_proj", "down_proj"]
    assert m.up_proj.dot_general.lhs.scale.dtype == jnp.float32
    assert m.up_proj.dot_general.lhs.amax_history.shape == (1024,)


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_input_tree_is_unchanged(getkey):
    model = HaliaxMLP.init(key=getkey())
    before = jax.tree.leaves(model)
    fp8ax.fp8_linear_layers(model)
    assert isinstance(model.up_proj.dot_general, haxq.DefaultDotGeneralOp)
    assert all(a is b for a, b in zip(before, jax.tree.leaves(model)))


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
@pytest.mark.parametrize(
    "targets,expected",
    [
        (["up_proj"], ["blocks.stacked.mlp.up_proj"]),
        (["mlp.down_proj", "head"], ["blocks.stacked.mlp.down_proj", "head"]),
        (["blocks.stacked.mlp.up_proj"], ["blocks.stacked.mlp.up_proj"]),
        (r"blocks\..*", ["blocks.stacked.mlp.up_proj", "blocks.stacked.mlp.down_proj"]),
        (r"head", ["head"]),
        (lambda path, layer: layer.Out == Mid, ["blocks.stacked.mlp.up_proj"]),
    ],
)
def test_target_selection(targets, expected, getkey):
    m = fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(targets=targets))
    assert _converted_paths(m) == expected


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_list_entries_match_whole_path_components(getkey):
    # "proj" is not a suffix component of "up_proj": nothing matches.
    with pytest.raises(ValueError, match=r"matches none of the 3 linear layers.*'blocks.stacked.mlp.up_proj'"):
        fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(targets=["proj"]))


def test_every_list_entry_must_match(getkey):
    # A misspelt entry next to a valid one used to be ignored: "linear_1" converted,
    # "lnear2" silently skipped.
    mlp = eqx.nn.MLP(4, 2, 8, 2, key=getkey())  # layers.0, layers.1, layers.2
    with pytest.raises(ValueError, match=r"entries 'layer.2' \(close: 'layers.2', .*\) match none of the 3"):
        fp8ax.fp8_linear_layers(mlp, fp8ax.Fp8Config(targets=["layers.0", "layer.2"]))
    with pytest.raises(ValueError, match=r"'nothing_like_it' match none"):
        fp8ax.fp8_linear_layers(mlp, fp8ax.Fp8Config(targets=["layers.1", "nothing_like_it"]))
    # Every entry matching is fine, and a duplicate is not an error.
    m = fp8ax.fp8_linear_layers(mlp, fp8ax.Fp8Config(targets=["layers.0", "2", "layers.0"]))
    assert [isinstance(layer, fp8ax.Fp8Linear) for layer in m.layers] == [True, False, True]


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_regex_must_fullmatch(getkey):
    with pytest.raises(ValueError, match="matches none"):
        fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(targets="mlp"))


def test_no_linear_layer_is_an_error():
    with pytest.raises(ValueError, match="found no linear layer"):
        fp8ax.fp8_linear_layers({"w": jnp.ones(3)})


@pytest.mark.needs_hax_dot
def test_stacked_layers_get_their_own_state(getkey):
    m = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    dg = m.blocks.stacked.mlp.up_proj.dot_general
    assert dg.lhs.scale.shape == (Layers.size,)
    assert dg.rhs.amax_history.shape == (Layers.size, 1024)
    assert m.head.dot_general.lhs.scale.shape == ()

    x = hax.random.normal(getkey(), (Batch, In))
    y = hax.random.normal(getkey(), (Batch, Out))
    m = sgd_step(mse)(m, x, y)
    dg = m.blocks.stacked.mlp.up_proj.dot_general
    # lax.scan over the Block axis: each layer records the amax of its own input. Layer
    # 0 sees x itself; the others see the residual stream, which differs.
    assert float(dg.lhs.amax_history[0, 0]) == pytest.approx(float(jnp.max(jnp.abs(x.array))), rel=0)
    assert len(set(np.asarray(dg.lhs.amax_history[:, 0]).tolist())) == Layers.size
    assert np.all(np.asarray(dg.rhs.scale) > 0)


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_blockseq_layers_get_their_own_state(getkey):
    seq = hax.nn.BlockSeq.init(Layers, Block)(key=jax.random.split(getkey(), Layers.size))
    m = fp8ax.fp8_linear_layers(seq)
    assert _converted_paths(m)[:2] == ["blocks.0.mlp.up_proj", "blocks.0.mlp.down_proj"]
    assert len(_converted_paths(m)) == 2 * Layers.size
    assert m.blocks[1].mlp.up_proj.dot_general.lhs.scale.shape == ()


@pytest.mark.needs_hax_dot
def test_idempotent_keeps_state(getkey):
    m = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x = hax.random.normal(getkey(), (Batch, In))
    y = hax.random.normal(getkey(), (Batch, Out))
    m = sgd_step(mse)(m, x, y)
    again = fp8ax.fp8_linear_layers(m)
    for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(again)):
        assert a is b
    assert float(again.up_proj.dot_general.lhs.amax_history[0]) > 0


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_haliax_quantized_layers_are_left_alone(getkey):
    m = haxq.quantize_linear_layers(HaliaxMLP.init(key=getkey()), haxq.QuantizationConfig(fp8=True))
    out = fp8ax.fp8_linear_layers(m)
    assert isinstance(out.up_proj.dot_general, haxq.Fp8DotGeneralOp)


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_min_features_skips_small_layers(getkey):
    m = fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(min_features=9))
    # head is In(16) -> Out(8): skipped; the MLP layers are 16 <-> 32.
    assert _converted_paths(m) == ["blocks.stacked.mlp.up_proj", "blocks.stacked.mlp.down_proj"]


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_min_features_skipping_everything_is_an_error(getkey):
    with pytest.raises(ValueError, match=r"`config.min_features` \(256\) skips all 3 selected linear layers"):
        fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(min_features=256))


def test_equinox_mlp(getkey):
    mlp = eqx.nn.MLP(12, 5, width_size=24, depth=2, key=getkey())
    m = fp8ax.fp8_linear_layers(mlp)
    assert all(isinstance(layer, fp8ax.Fp8Linear) for layer in m.layers)
    # Same parameters under the same paths.
    assert m.layers[0].weight is mlp.layers[0].weight and m.layers[2].bias is mlp.layers[2].bias
    plain_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(mlp)]
    fp8_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(m)]
    assert set(plain_paths) <= set(fp8_paths)
    x = jax.random.normal(getkey(), (64, 12))
    # Three FP8 GEMMs in a row compound their error: ~24.8 dB measured, require >= 20 dB;
    # one layer alone must reach the per-GEMM bound of 25 dB.
    assert sqnr(jax.vmap(mlp)(x), jax.vmap(m)(x)) >= 20.0
    assert sqnr(jax.vmap(mlp.layers[0])(x), jax.vmap(m.layers[0])(x)) >= 25.0


def test_fp8_linear_batched_input_equals_vmap(getkey):
    lin = fp8ax.Fp8Linear.from_linear(eqx.nn.Linear(8, 4, key=getkey()))
    x = jax.random.normal(getkey(), (5, 8))
    np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(jax.vmap(lin)(x)), rtol=1e-6)
    scalar = fp8ax.Fp8Linear.from_linear(eqx.nn.Linear("scalar", "scalar", key=getkey()))
    assert scalar(jnp.float32(2.0)).shape == ()
    with pytest.raises(ValueError, match=r"`x` must have shape \(\.\.\., 8\), got \(7,\)"):
        lin(jnp.ones(7))
    with pytest.raises(TypeError, match="`linear` must be an `equinox.nn.Linear`"):
        fp8ax.Fp8Linear.from_linear(lin)


def test_fp8_linear_round_trips_to_linear(getkey):
    lin = eqx.nn.Linear(8, 4, key=getkey())
    back = fp8ax.Fp8Linear.from_linear(lin).to_linear()
    assert isinstance(back, eqx.nn.Linear)
    x = jnp.ones(8)
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(lin(x)))


def test_ensemble_of_equinox_linears_gets_per_member_state(getkey):
    keys = jax.random.split(getkey(), 3)
    ens = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 4, key=k))(keys)
    m = fp8ax.fp8_linear_layers(ens)
    assert m.dot_general.lhs.scale.shape == (3,)
    xs = jax.random.normal(getkey(), (3, 10, 8)) * jnp.array([1.0, 10.0, 100.0])[:, None, None]

    def loss(m):
        return jnp.sum(eqx.filter_vmap(lambda lin, x: jax.vmap(lin)(x))(m, xs))

    grads = eqx.filter_grad(loss)(m)
    amax = np.max(np.abs(np.asarray(xs)), axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(grads.dot_general.lhs.amax_history[:, 0]), amax)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(targets=3), TypeError, "`targets` must be None, a list of layer names"),
        (dict(targets=["up_proj", 3]), TypeError, "`targets` as a list must hold layer names"),
        (dict(targets=[]), ValueError, "`targets` is an empty list"),
        (dict(targets="("), ValueError, "`targets` is a string, so it must be a regular expression"),
        (dict(recipe="delayed"), TypeError, "`recipe` must be an fp8ax recipe"),
        (dict(mode="fast"), ValueError, "`mode` must be one of"),
        (dict(min_features=-1), ValueError, "`min_features` must be >= 0"),
        (dict(compute_dtype=jnp.int32), TypeError, "`compute_dtype` must be a floating dtype"),
    ],
)
def test_config_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fp8ax.Fp8Config(**kwargs)


def test_config_type_is_checked(getkey):
    with pytest.raises(TypeError, match="`config` must be an `fp8ax.Fp8Config`, got dict"):
        fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()), {"targets": None})


def test_config_is_immutable():
    c = fp8ax.Fp8Config()
    with pytest.raises(AttributeError):
        c.mode = "qdq"  # type: ignore[misc]


@pytest.mark.needs_hax_dot
def test_named_axis_dot_with_injected_dot_general(getkey):
    x = hax.random.normal(getkey(), (Batch, In))
    w = hax.random.normal(getkey(), (In, Out))
    dg = fp8ax.Fp8DotGeneral.init()
    y = hax.dot(x, w, axis=In, dot_general=dg)
    y_ref = hax.dot(x, w, axis=In)
    assert y.axes == y_ref.axes
    assert sqnr(y_ref.array, y.array) >= 25.0
    y2 = x.dot(w, axis=In, dot_general=dg)
    np.testing.assert_array_equal(np.asarray(y2.array), np.asarray(y.array))


@pytest.mark.needs_hax_dot
def test_fp8_all_gather_config(getkey):
    m = fp8ax.fp8_linear_layers(Deep.init(key=getkey()), fp8ax.Fp8Config(fp8_all_gather=True))
    # The weight's own axis names (not the stacked Layers axis), in the weight's order.
    up = m.blocks.stacked.mlp.up_proj
    assert up.dot_general.fp8_all_gather_axes == tuple(a.name for a in up.weight.axes if a.name != "Layers")
    assert fp8ax.fp8_linear_layers(Deep.init(key=getkey())).head.dot_general.fp8_all_gather_axes is None
    with pytest.raises(TypeError, match="`fp8_all_gather` must be a bool, got 'yes'"):
        fp8ax.Fp8Config(fp8_all_gather="yes")
    with pytest.raises(TypeError, match="`fp8_all_gather_axes` must be None or a sequence of axis names"):
        fp8ax.Fp8DotGeneral.init(fp8_all_gather_axes="In")
    # Outside an axis mapping the flag changes nothing.
    x = hax.random.normal(getkey(), (Batch, In))
    plain = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    dg = plain.blocks.stacked.mlp.up_proj.dot_general
    flagged = eqx.tree_at(
        lambda t: t.blocks.stacked.mlp.up_proj.dot_general,
        plain,
        dataclasses.replace(dg, fp8_all_gather_axes=up.dot_general.fp8_all_gather_axes),
    )
    assert flagged.blocks.stacked.mlp.up_proj.dot_general.fp8_all_gather_axes is not None
    np.testing.assert_array_equal(np.asarray(flagged(x).array), np.asarray(plain(x).array))
