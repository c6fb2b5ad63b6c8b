# Training loops written for Haliax's FP8, replayed with Haliax alone: what Levanter's
# trainer does to a model's FP8 state (its mixed-precision cast, its gradient accumulation,
# its generation's layer slicing, its update), each against fp8ax's own step or a hand
# replay. Levanter itself is not installed in CI; examples/levanter_llama.py runs its
# `Trainer` (docs/levanter.md says where it was run).

import copy
import gc
import pickle

import equinox as eqx
import haliax as hax
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import Batch, Deep, HaliaxMLP, In, Layers, Out

pytestmark = pytest.mark.needs_hax_dot

K = 4  # microbatches


def _bf16_cast(tree):
    # jmp's `cast_to_compute` (Levanter's `mp: p=f32,c=bfloat16`): every floating leaf.
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, tree)


def _state(tree, path):
    return np.asarray(path(tree))


def _loss(model, x, y):
    return hax.mean((model(x) - y) ** 2).scalar()


@pytest.fixture
def data(getkey):
    x = hax.random.normal(getkey(), (Batch, In)) * hax.named(jnp.linspace(0.2, 3.0, Batch.size), Batch)
    y = hax.random.normal(getkey(), (Batch, Out))
    return x, y


def test_bf16_cast_of_the_whole_model(getkey, data):
    # The loss casts the model, state included (Levanter's mixed precision). The step runs,
    # the weights' gradients are those of the state-preserving cast, and the new state is
    # the float32 new state rounded to bfloat16 (the cast's transpose), to nearest.
    x, y = data
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))

    def naive(m, x, y):
        return _loss(_bf16_cast(m), x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)).astype(jnp.float32)

    def kept(m, x, y):
        m = fp8ax.cast_floating(m, jnp.bfloat16)
        return _loss(m, x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)).astype(jnp.float32)

    got = eqx.filter_jit(eqx.filter_grad(naive))(model, x, y)
    want = eqx.filter_jit(eqx.filter_grad(kept))(model, x, y)
    got_state, got_grads = fp8ax.partition_for_grad_overwrite(got)
    want_state, want_grads = fp8ax.partition_for_grad_overwrite(want)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state), strict=True):
        b = np.asarray(b)
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), b.astype(ml_dtypes.bfloat16).astype(np.float32))
    # The states really are new (a fresh layer calibrates on its first step).
    assert float(got_state.up_proj.dot_general.lhs.amax_history[0]) > 0
    # A second step reads the written (bf16-exact) state back in float32: the same loss
    # as the state-preserving cast from that state.
    model = fp8ax.apply_updates(model, None, got_state)
    np.testing.assert_array_equal(
        np.asarray(eqx.filter_jit(naive)(model, x, y)), np.asarray(eqx.filter_jit(kept)(model, x, y))
    )


def test_float16_cast_is_refused(getkey, data):
    x, _ = data
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    cast = jax.tree.map(lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model)
    with pytest.raises(TypeError, match=r"must be float32 or bfloat16.*fp8ax.cast_floating"):
        cast(x.astype(jnp.float16))


def _split_batch(v, k):
    B = v.resolve_axis(Batch.name).resize(Batch.size // k)
    return [hax.named(v.array[i * B.size : (i + 1) * B.size], (B, *v.axes[1:])) for i in range(k)]


@pytest.mark.parametrize("k", [K, 3])
def test_levanter_gradient_accumulation(getkey, k):
    # The state survives Levanter's batch reshape (NamedArrays without the batch axis) and
    # its division by k: it reads as the last microbatch's new state, which for the weight
    # is the full batch's. Exact for k = 4 (a power of two); within two float32 roundings
    # for k = 3 (relative 2.4e-7).
    B = Batch.resize(12)
    x = hax.random.normal(getkey(), (B, In)) * hax.named(jnp.linspace(0.2, 3.0, B.size), B)
    y = hax.random.normal(getkey(), (B, Out))
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    grad_fn = eqx.filter_grad(_loss)

    # Levanter reshapes every plain array among the arguments, the model included, as
    # batch data; a NamedArray without the batch axis is left alone. The model has none.
    leaves = jax.tree.leaves(model, is_leaf=lambda a: isinstance(a, hax.NamedArray))
    assert leaves and all(isinstance(a, hax.NamedArray) for a in leaves)

    xs, ys = _split_batch(x, k), _split_batch(y, k)
    acc = None
    for xi, yi in zip(xs, ys):
        grads = grad_fn(model, xi, yi)
        overwrite, updates = haxq.partition_for_grad_overwrite(grads)
        acc = grads if acc is None else haxq.apply_updates(acc, updates, overwrite)
    averaged = jax.tree.map(lambda g: g / k, acc)
    overwrite, _ = haxq.partition_for_grad_overwrite(averaged)
    trained = haxq.apply_updates(model, jax.tree.map(lambda _: None, model), overwrite)

    last, _ = fp8ax.partition_for_grad_overwrite(grad_fn(model, xs[-1], ys[-1]))
    full, _ = fp8ax.partition_for_grad_overwrite(grad_fn(model, x, y))
    tol = {} if k == K else {"rtol": 2.4e-7}
    for name in ("up_proj", "down_proj"):
        for role in ("lhs", "rhs", "grad"):
            got = getattr(getattr(trained, name).dot_general, role)
            want = getattr(getattr(last, name).dot_general, role)
            np.testing.assert_allclose(np.asarray(got.amax_history), np.asarray(want.amax_history), **tol)
            np.testing.assert_allclose(np.asarray(got.scale), np.asarray(want.scale), **tol)
            np.testing.assert_allclose(np.asarray(got.unit), 1 / k, rtol=1e-7)
    # The weight is the same in every microbatch: its amax is the full batch's.
    np.testing.assert_allclose(
        np.asarray(trained.up_proj.dot_general.rhs.amax_history[0]),
        np.asarray(full.up_proj.dot_general.rhs.amax_history[0]),
        **tol,
    )
    # fp8ax check_state accepts it, and the next step runs on it as on the last state.
    fp8ax.check_state(trained, written=True)
    step_last = fp8ax.apply_updates(model, None, last)
    np.testing.assert_allclose(
        np.asarray(eqx.filter_jit(_loss)(trained, x, y)), np.asarray(eqx.filter_jit(_loss)(step_last, x, y)), rtol=1e-6
    )


def test_generation_slices_stacked_layers_by_name(getkey):
    # Levanter's decode takes layer i of a Stacked with `a["layer", i]` on every NamedArray.
    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    up = model.blocks.stacked.mlp.up_proj.dot_general
    assert isinstance(jax.tree.leaves(up.lhs, is_leaf=lambda a: isinstance(a, hax.NamedArray))[0], hax.NamedArray)
    x = hax.random.normal(getkey(), (Batch, In))
    model = fp8ax.apply_updates(
        model, None, fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda m: hax.sum(m(x)).scalar())(model))[0]
    )
    stacked = model.blocks.stacked
    h = x
    for i in range(Layers.size):
        block = hax.tree_util.tree_map(lambda a: a[Layers.name, i], stacked)
        state = block.mlp.up_proj.dot_general.lhs
        np.testing.assert_array_equal(np.asarray(state.amax_history), np.asarray(up_state(model).amax_history[i]))
        assert state.amax_history.shape == (1024,)
        h = block(h)
    # Layer by layer equals the scan over the stacked layers.
    np.testing.assert_allclose(np.asarray(h.array), np.asarray(model.blocks.fold(x).array), rtol=1e-6, atol=1e-6)


def up_state(model):
    return model.blocks.stacked.mlp.up_proj.dot_general.lhs


def test_named_state_axes_under_haliax_tools(getkey):
    # Axis names: the Stacked block axis, then the state array's own; Haliax's filtered scan
    # (Stacked.fold with remat) differentiates through it. (Meshes and axis mappings:
    # tests/test_sharding.py.)
    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey(), gradient_checkpointing=True))
    lhs = up_state(model)
    named = jax.tree.leaves(lhs, is_leaf=lambda a: isinstance(a, hax.NamedArray))
    names = [tuple(ax.name for ax in a.axes) for a in named]
    assert names == [(Layers.name, "fp8ax_data")]
    # The layer's one state: the three roles along `fp8ax_role`, between the two.
    whole = jax.tree.leaves(
        model.blocks.stacked.mlp.up_proj.dot_general, is_leaf=lambda a: isinstance(a, hax.NamedArray)
    )
    assert [tuple((ax.name, ax.size) for ax in a.axes) for a in whole] == [
        ((Layers.name, Layers.size), ("fp8ax_role", 3), ("fp8ax_data", 1026))
    ]
    assert isinstance(
        jax.tree.leaves(model.head.dot_general.lhs, is_leaf=lambda a: isinstance(a, hax.NamedArray))[0], hax.NamedArray
    )
    # An Equinox layer's state stays plain arrays.
    eqx_state = fp8ax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey())).dot_general.lhs
    assert not any(
        isinstance(a, hax.NamedArray)
        for a in jax.tree.leaves(eqx_state, is_leaf=lambda a: isinstance(a, hax.NamedArray))
    )
    x = hax.random.normal(getkey(), (Batch, In))
    y = hax.random.normal(getkey(), (Batch, Out))
    step = eqx.filter_jit(eqx.filter_grad(_loss))
    grads = step(model, x, y)
    assert jax.tree.structure(grads) == jax.tree.structure(eqx.filter(model, eqx.is_array))


def test_named_state_children_unflatten_without_haliax_checks(getkey, monkeypatch):
    # A state's NamedArray children are rebuilt at every unflatten of the model (two or three
    # per call of a jitted step). They are NamedArrays to Haliax's tools and keep a
    # NamedArray's tree path, but unflatten without `NamedArray.__init__`, whose checks cost
    # more than the rest of the state's host work (bench/state_cost.py, `stack16`).
    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    dg = model.blocks.stacked.mlp.up_proj.dot_general
    (child,) = jax.tree.leaves(dg.lhs, is_leaf=hax.is_named_array)
    assert hax.is_named_array(child) and type(child) is not hax.NamedArray
    plain = hax.named(child.array, child.axes)
    ((plain_path, _),) = jax.tree_util.tree_flatten_with_path(plain)[0]
    ((child_path, _),) = jax.tree_util.tree_flatten_with_path(child)[0]
    assert child_path == plain_path

    calls = []
    init = hax.NamedArray.__init__
    monkeypatch.setattr(hax.NamedArray, "__init__", lambda self, *a, **k: (calls.append(1), init(self, *a, **k))[1])
    leaves, treedef = jax.tree.flatten(dg)
    again = jax.tree.unflatten(treedef, leaves)
    assert calls == []
    assert jax.tree.structure(again) == treedef
    # What the rebuild keeps alive is the layer's one state and its child alone, no tuple
    # and no dictionary: every object a step's outputs keep is one more for Python's
    # collector to walk, and on a deep model its full passes cost more than the rebuilding
    # (bench/README.md, run O). (`lhs`, `rhs` and `grad` are made when read.)
    for state in (again.state,):
        assert not [r for r in gc.get_referents(state) if type(r) in (tuple, list, dict)]
        (kid,) = jax.tree.leaves(state, is_leaf=hax.is_named_array)
        assert not [r for r in gc.get_referents(kid) if isinstance(r, dict)]
    np.testing.assert_array_equal(np.asarray(again.lhs.amax_history), np.asarray(dg.lhs.amax_history))
    # Concrete children are kept: the next flatten hands out the same objects.
    kids = jax.tree.leaves(again, is_leaf=hax.is_named_array)
    assert all(a is b for a, b in zip(kids, jax.tree.leaves(again, is_leaf=hax.is_named_array), strict=True))
    # So are a filter's placeholders: the static half of `eqx.partition`, which
    # `eqx.filter_jit` flattens and rebuilds on every call, holds None in each child, and
    # the halves combine into the model.
    arrays, static = eqx.partition(again, eqx.is_array)
    rebuilt = jax.tree.unflatten(*reversed(jax.tree.flatten(static)))
    kids = jax.tree.leaves(rebuilt, is_leaf=hax.is_named_array)
    assert all(type(k) is type(child) and k.array is None for k in kids)
    assert all(a is b for a, b in zip(kids, jax.tree.leaves(rebuilt, is_leaf=hax.is_named_array), strict=True))
    assert calls == []
    combined = eqx.combine(arrays, rebuilt)
    assert jax.tree.structure(combined) == treedef
    assert all(a is b for a, b in zip(jax.tree.leaves(combined), leaves, strict=True))
    assert combined.lhs.batch_shape == dg.lhs.batch_shape
    monkeypatch.undo()

    # A Haliax op on a child returns a plain NamedArray; the state takes it back, and
    # flattens to the same structure as before.
    doubled = hax.tree_util.tree_map(lambda a: a * 2, dg)
    assert jax.tree.structure(doubled) == treedef
    np.testing.assert_array_equal(np.asarray(doubled.lhs.unit), 2 * np.asarray(dg.lhs.unit))
    stepped = eqx.filter_jit(lambda m: m)(model)
    assert jax.tree.structure(stepped) == jax.tree.structure(model)
    # Pickled (Ray) and deep-copied, the model and a child alone keep their structure.
    for copied in (pickle.loads(pickle.dumps(stepped)), copy.deepcopy(stepped)):
        assert jax.tree.structure(copied) == jax.tree.structure(model)
    assert type(pickle.loads(pickle.dumps(child))) is type(child)


def test_zero_state_written_by_haliax_reads_as_fresh(getkey, data):
    # Haliax's apply_updates writes the zero "gradient" of an unused layer over its state.
    # It reads as a fresh state: the next call calibrates (or, without first-call
    # calibration, uses scale 1), never scale 0; check_state calls it empty, not corrupt.
    x, _ = data
    for calibrate in (True, False):
        recipe = fp8ax.DelayedScaling(calibrate_first_call=calibrate)
        model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()), fp8ax.Fp8Config(recipe=recipe))
        zero = jax.tree.map(jnp.zeros_like, model.down_proj.dot_general)
        zeroed = eqx.tree_at(lambda m: m.down_proj.dot_general, model, zero)
        h = hax.nn.relu(model.up_proj(x))
        np.testing.assert_array_equal(np.asarray(zeroed.down_proj(h).array), np.asarray(model.down_proj(h).array))
        assert float(zeroed.down_proj.dot_general.lhs.scale) == 1.0
        fp8ax.check_state(zeroed)
        with pytest.raises(ValueError, match=r"`model.down_proj.dot_general.lhs`.*has observed nothing.*lm_head"):
            fp8ax.check_state(zeroed, written=True)


def test_unused_layer_is_named(getkey, data):
    # Levanter's language models never call `lm_head` in their loss (they take its
    # weight): the first trace of the step names it; the conversion report flags it.
    x, y = data

    class Lm(eqx.Module):
        body: hax.nn.Linear
        lm_head: hax.nn.Linear

        def get_lm_head(self):
            return self.lm_head.weight

    plain = Lm(hax.nn.Linear.init(In, Out, key=getkey()), hax.nn.Linear.init(Out, Out.alias("Vocab"), key=getkey()))
    rows = {r.path: r for r in fp8ax.conversion_report(plain).layers}
    assert rows["lm_head"].action == "convert" and "never call this layer" in rows["lm_head"].reason
    assert "never call" not in rows["body"].reason
    model = fp8ax.fp8_linear_layers(plain)

    def loss(m, x, y):  # the head's weight, not the layer
        logits = hax.dot(m.body(x), m.get_lm_head(), axis=Out)
        return hax.mean((logits.rename({"Vocab": Out.name}) - y) ** 2).scalar()

    with pytest.warns(fp8ax.UnusedLayerWarning, match=r"`lm_head` is never called.*path != \"lm_head\""):
        eqx.filter_jit(eqx.filter_grad(loss))(model, x, y)
    kept = fp8ax.fp8_linear_layers(plain, fp8ax.Fp8Config(targets=lambda path, layer: path != "lm_head"))
    eqx.filter_jit(eqx.filter_grad(loss))(kept, x, y)  # no warning (pytest turns warnings into errors)
