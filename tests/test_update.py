"""partition_for_grad_overwrite, apply_updates, cast_floating, and interop with Haliax's helpers."""

import subprocess
import sys
import warnings

import equinox as eqx
import haliax as hax
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8ax
from helpers import Batch, HaliaxMLP, In, Mid, Out, mse


def _data(getkey):
    return hax.random.normal(getkey(), (Batch, In)), hax.random.normal(getkey(), (Batch, Out))


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_partition_splits_state_from_parameters(getkey):
    m = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    overwrite, rest = fp8ax.partition_for_grad_overwrite(m)
    assert isinstance(overwrite.up_proj.dot_general, fp8ax.Fp8DotGeneral)
    assert overwrite.up_proj.weight.array is None
    assert rest.up_proj.weight.array is m.up_proj.weight.array
    # In place of the state, zeros: the state is not trained. `rest` has the structure of
    # the model's arrays, so an optimizer state built from them matches it.
    assert jax.tree.structure(rest) == jax.tree.structure(eqx.filter(m, eqx.is_array))
    dg = rest.up_proj.dot_general
    assert isinstance(dg, fp8ax.Fp8DotGeneral) and dg.settings == m.up_proj.dot_general.settings
    for leaf in jax.tree.leaves(dg):
        assert leaf.dtype == jnp.float32 and not np.any(np.asarray(leaf))


@pytest.mark.needs_hax_dot
def test_tldr_train_step_with_adamw(getkey):
    # The README's step, with an optimizer that reads `params` (weight decay).
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x, y = _data(getkey)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    opt_state = opt.init(trainable)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(mse)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    losses = []
    for _ in range(20):
        model, opt_state = step(model, opt_state, x, y)
        losses.append(float(mse(model, x, y)))
    assert losses[-1] < 0.5 * losses[0]
    dg = model.up_proj.dot_general
    # The state was written, not decayed or moved by Adam: the newest amax is exactly the
    # input's amax, as on every step.
    assert float(dg.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x.array)))
    assert float(dg.lhs.scale) == pytest.approx(float(jnp.max(jnp.abs(x.array))) / 448.0, rel=1e-6)


@pytest.mark.needs_hax_dot  # converts a Haliax model, which fp8ax refuses where hax.dot is broken
def test_parameters_keep_their_dtype(getkey):
    model = fp8ax.cast_floating(fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey())), jnp.bfloat16)
    assert model.up_proj.weight.dtype == jnp.bfloat16
    assert model.up_proj.dot_general.lhs.scale.dtype == jnp.float32
    updates = jax.tree.map(lambda w: jnp.ones(w.shape, jnp.float32), fp8ax.partition_for_grad_overwrite(model)[1])
    overwrite, _ = fp8ax.partition_for_grad_overwrite(model)
    new = fp8ax.apply_updates(model, updates, overwrite)
    assert new.up_proj.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(new.up_proj.weight.array, np.float32),
        np.asarray((model.up_proj.weight.array.astype(jnp.float32) + 1).astype(jnp.bfloat16), np.float32),
    )


@pytest.mark.needs_hax_dot
def test_gradients_passed_as_overwrite_are_refused(getkey):
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x, y = _data(getkey)
    grads = eqx.filter_grad(mse)(model, x, y)
    overwrite, rest = fp8ax.partition_for_grad_overwrite(grads)
    with pytest.raises(ValueError, match=r"`overwrite` holds a value for the ordinary parameter at `\.up_proj\.weight"):
        fp8ax.apply_updates(model, rest, grads)  # Haliax's docs make this mistake


@pytest.mark.needs_hax_dot
def test_what_the_optimizer_makes_of_the_state_is_ignored(getkey):
    # Weight decay turns the state's zero gradient into nonzero updates: the state is
    # written from `overwrite` alone, bit for bit, and the weights get their updates.
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x, y = _data(getkey)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(mse)(model, x, y))
    updates = jax.tree.map(lambda g, p: -0.1 * g - 0.5 * p, grads, eqx.filter(model, eqx.is_array))
    new = fp8ax.apply_updates(model, updates, overwrite)
    want = fp8ax.apply_updates(model, None, overwrite)
    for role in ("lhs", "rhs", "grad"):
        for a, b in zip(
            jax.tree.leaves(getattr(new.up_proj.dot_general, role)),
            jax.tree.leaves(getattr(want.up_proj.dot_general, role)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(
        np.asarray(new.up_proj.weight.array), np.asarray(model.up_proj.weight.array + updates.up_proj.weight.array)
    )


class TwoHeads(eqx.Module):
    trunk: hax.nn.Linear
    head_a: hax.nn.Linear
    head_b: hax.nn.Linear

    def __call__(self, x, head):
        h = hax.nn.relu(self.trunk(x))
        return (self.head_a if head == "a" else self.head_b)(h)


@pytest.mark.needs_hax_dot
def test_unused_layer_keeps_its_state(getkey):
    ks = jax.random.split(getkey(), 3)
    model = TwoHeads(
        hax.nn.Linear.init(In, Mid, key=ks[0]),
        hax.nn.Linear.init(Mid, Out, key=ks[1]),
        hax.nn.Linear.init(Mid, Out, key=ks[2]),
    )
    model = fp8ax.fp8_linear_layers(model)
    x, y = _data(getkey)

    def loss(m, head):
        return hax.mean((m(x, head) - y) ** 2).scalar()

    def step(m, head):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(m, head))
        return fp8ax.apply_updates(m, jax.tree.map(lambda g: -0.01 * g, grads), overwrite), overwrite

    # The first step names the head it does not call, when it is traced (a layer an earlier
    # step called is not reported again: the warning is for a layer no step calls).
    with pytest.warns(fp8ax.UnusedLayerWarning, match="`head_a` is never called"):
        model, _ = step(model, "b")  # give head_b some state
    before = jax.tree.leaves(model.head_b.dot_general)
    after_model, overwrite = step(model, "a")  # head_b unused this step
    for a, b in zip(before, jax.tree.leaves(after_model.head_b.dot_general)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(after_model.head_b.dot_general.lhs.scale) > 0.0
    # What the step delivered for head_b is zeros (unit 0: nothing written). Haliax's
    # `apply_updates` writes it over the state; it then reads as a fresh state (scale 1,
    # empty history, so the next call calibrates), never as a scale of 0.
    assert float(overwrite.head_b.dot_general.lhs.unit) == 0.0
    haliax_result = haxq.apply_updates(model, jax.tree.map(lambda _: None, model), overwrite)
    assert float(haliax_result.head_b.dot_general.lhs.unit) == 0.0
    assert float(haliax_result.head_b.dot_general.lhs.scale) == 1.0
    assert not np.any(np.asarray(haliax_result.head_b.dot_general.lhs.amax_history))


@pytest.mark.needs_hax_dot
def test_a_traced_update_merges_each_state_in_one_equation(getkey):
    # In a jitted step, `apply_updates` merges each state (its new value where written,
    # the old one elsewhere) inside a `jit` of its own: the step's trace records one
    # equation per state, not the dozen its reads, `written` and `select` take, and the
    # result is the eager one, bit for bit. A layer the step did not call (`head_a`)
    # keeps its state there too.
    ks = jax.random.split(getkey(), 3)
    model = fp8ax.fp8_linear_layers(
        TwoHeads(
            hax.nn.Linear.init(In, Mid, key=ks[0]),
            hax.nn.Linear.init(Mid, Out, key=ks[1]),
            hax.nn.Linear.init(Mid, Out, key=ks[2]),
        )
    )
    x, y = _data(getkey)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8ax.UnusedLayerWarning)
        grads = eqx.filter_jit(eqx.filter_grad(lambda m: hax.mean((m(x, "b") - y) ** 2).scalar()))(model)
    overwrite, _ = fp8ax.partition_for_grad_overwrite(grads)
    arrays, static = eqx.partition((model, overwrite), eqx.is_array)

    def update(arrays):
        m, o = eqx.combine(arrays, static)
        return fp8ax.apply_updates(m, None, o)

    eqns = jax.make_jaxpr(update)(arrays).jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    states = 3  # three layers, one state each (the three operands' rows)
    assert names.count("jit") == states and "select_n" not in names, names
    traced = eqx.filter_jit(lambda m, o: fp8ax.apply_updates(m, None, o))(model, overwrite)
    eager = fp8ax.apply_updates(model, None, overwrite)
    for a, b in zip(jax.tree.leaves(traced), jax.tree.leaves(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(traced.head_a), jax.tree.leaves(model.head_a), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.needs_hax_dot
def test_interop_with_haliax_helpers(getkey):
    ours = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    theirs = haxq.quantize_linear_layers(HaliaxMLP.init(key=getkey()), haxq.QuantizationConfig(fp8=True))
    # Haliax's partition finds fp8ax's modules, and fp8ax's finds Haliax's.
    assert isinstance(haxq.partition_for_grad_overwrite(ours)[0].up_proj.dot_general, fp8ax.Fp8DotGeneral)
    assert isinstance(fp8ax.partition_for_grad_overwrite(theirs)[0].up_proj.dot_general, haxq.Fp8DotGeneralOp)
    assert issubclass(fp8ax.OverwriteWithGradient, haxq.OverwriteWithGradient)
    # A training step written against Haliax's helpers runs an fp8ax model.
    x, y = _data(getkey)
    grads = eqx.filter_grad(mse)(ours, x, y)
    overwrite, grads = haxq.partition_for_grad_overwrite(grads)
    new = haxq.apply_updates(ours, jax.tree.map(lambda g: -0.01 * g, grads), overwrite)
    assert float(new.up_proj.dot_general.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x.array)))
    # And fp8ax's helpers run a Haliax-quantized model.
    grads = eqx.filter_grad(mse)(theirs, x, y)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    new = fp8ax.apply_updates(theirs, jax.tree.map(lambda g: -0.01 * g, grads), overwrite)
    assert float(new.up_proj.dot_general.input_amax_history[0]) == float(jnp.max(jnp.abs(x.array)))


@pytest.mark.needs_hax_dot
def test_clip_by_global_norm_does_not_see_state(getkey):
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    plain = HaliaxMLP.init(key=getkey())
    plain = eqx.tree_at(
        lambda m: (m.up_proj.weight, m.down_proj.weight), plain, (model.up_proj.weight, model.down_proj.weight)
    )
    x, y = _data(getkey)
    _, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(mse)(model, x, y))
    plain_grads = eqx.filter_grad(mse)(plain, x, y)
    # The global norm of what the optimizer sees covers the parameters only (the FP8
    # gradients are close to, not equal to, the float32 ones: 10% tolerance).
    assert float(optax.tree.norm(grads)) == pytest.approx(float(optax.tree.norm(plain_grads)), rel=0.1)
    # What it sees of the FP8 state is zero.
    state_leaves = jax.tree.leaves([grads.up_proj.dot_general, grads.down_proj.dot_general])
    assert state_leaves and not any(np.any(np.asarray(v)) for v in state_leaves)


@pytest.mark.needs_hax_dot
def test_cast_floating(getkey):
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    cast = fp8ax.cast_floating(model, jnp.bfloat16)
    assert cast.up_proj.weight.dtype == jnp.bfloat16 and cast.up_proj.bias.dtype == jnp.bfloat16
    for leaf in jax.tree.leaves(eqx.filter(cast.up_proj.dot_general, eqx.is_array)):
        assert leaf.dtype == jnp.float32
    with pytest.raises(TypeError, match="`dtype` must be a floating dtype, got int8"):
        fp8ax.cast_floating(model, jnp.int8)
    # A naive cast to bfloat16 (what jmp and Levanter's mixed precision do) casts the
    # state too, which the layer reads back in float32 (a fresh state is exact in bf16);
    # a cast to float16, which cannot hold every scale, is refused.
    x = hax.random.normal(getkey(), (Batch, In)).astype(jnp.bfloat16)
    naive = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
    np.testing.assert_array_equal(np.asarray(naive(x).array), np.asarray(cast(x).array))
    naive16 = jax.tree.map(lambda a: a.astype(jnp.float16) if eqx.is_inexact_array(a) else a, model)
    with pytest.raises(TypeError, match="must be float32 or bfloat16"):
        naive16(x.astype(jnp.float16))


def test_apply_updates_with_overwrite_none(getkey):
    # Forgetting the partition used to end in a pytree-structure error; it now names FP8.
    m = fp8ax.fp8_linear_layers(eqx.nn.MLP(4, 2, 8, 1, key=getkey()))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4))))(m)
    _, grads = fp8ax.partition_for_grad_overwrite(grads)
    with pytest.raises(
        ValueError,
        match=r"`overwrite` is None, but the model has FP8 layers \(.layers\[0\]"
        r".dot_general.*fp8ax.partition_for_grad_overwrite",
    ):
        fp8ax.apply_updates(m, grads, None)
    # A model without FP8 layers: None is fine and means "no state", as eqx.apply_updates.
    plain = eqx.nn.MLP(4, 2, 8, 1, key=getkey())
    updates = jax.tree.map(lambda x: 0.5 * x, eqx.filter(plain, eqx.is_inexact_array))
    got = fp8ax.apply_updates(plain, updates, None)
    want = eqx.apply_updates(plain, updates)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The optimizer state as Equinox's examples build it, from the whole model:
# `opt.init(eqx.filter(model, eqx.is_array))`, FP8 state included.

_OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}


def _trained_with(model, loss, opt, init_from, steps):
    """`model` after `steps` jitted fp8ax steps, the optimizer state built from
    `init_from`; checks that the optimizer state keeps its structure and shapes, and
    returns the model and how many times the step was traced."""
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
        state = opt.init(eqx.filter(init_from, eqx.is_array))
    shapes = jax.tree.map(jnp.shape, state)
    traces = []

    @eqx.filter_jit
    def step(m, s):
        traces.append(None)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(m))
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s, eqx.filter(m, eqx.is_array))
        return fp8ax.apply_updates(m, updates, overwrite), s

    for _ in range(steps):
        model, state = step(model, state)
        assert jax.tree.map(jnp.shape, state) == shapes
    return model, len(traces)


def _assert_same_arrays(a, b):
    for u, v in zip(
        jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_an_optimizer_state_built_from_the_whole_model_works(getkey, name):
    # It used to fail inside optax with a pytree structure error: the gradients held None
    # where the optimizer state held the FP8 state, and the first step changed a static
    # setting of every layer. It now trains exactly as an optimizer state built without
    # the FP8 state does, and the step compiles once (the first step is the same program).
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    y = jax.random.normal(getkey(), (32, 4))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    whole, traces = _trained_with(model, loss, _OPTIMIZERS[name](), model, 4)
    assert traces == 1  # one program, the first step's included
    trainable = fp8ax.partition_for_grad_overwrite(model)[1]
    want, _ = _trained_with(model, loss, _OPTIMIZERS[name](), trainable, 4)
    _assert_same_arrays(whole, want)
    dg = whole.layers[0].dot_general
    assert dg.recipe == model.layers[0].dot_general.recipe
    # The state was written, not moved by the optimizer: the newest amax is the input's.
    assert float(dg.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert float(jnp.max(jnp.abs(whole.layers[0].weight - model.layers[0].weight))) > 0


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_skip_fp8_state_trains_the_same_with_no_moments_for_the_state(getkey, name):
    # `fp8ax.skip_fp8_state(opt)` gives the same parameters and FP8 state, bit for bit,
    # as `opt` with moments for the state (whose updates `apply_updates` ignores), and
    # its optimizer state holds nothing of the size of an amax history.
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    y = jax.random.normal(getkey(), (32, 4))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    skipping = fp8ax.skip_fp8_state(_OPTIMIZERS[name]())
    got, traces = _trained_with(model, loss, skipping, model, 4)
    want, _ = _trained_with(model, loss, _OPTIMIZERS[name](), model, 4)
    assert traces == 1
    _assert_same_arrays(got, want)
    with jax.numpy_dtype_promotion("standard"):
        state = skipping.init(eqx.filter(model, eqx.is_array))
        full = _OPTIMIZERS[name]().init(eqx.filter(model, eqx.is_array))
    stored = jax.tree.leaves(model.layers[0].dot_general)[0].shape  # (role, unit + scale + history)
    assert stored == (3, 1024 + 2)
    assert not any(jnp.shape(v) == stored for v in jax.tree.leaves(state))
    assert any(jnp.shape(v) == stored for v in jax.tree.leaves(full))
    # One state array per FP8 layer (the three operands' rows), two layers: Adam's two
    # moments of each are gone.
    if name == "adam":
        assert len(jax.tree.leaves(full)) - len(jax.tree.leaves(state)) == 2 * 2


def test_skip_fp8_state_needs_an_optimizer():
    with pytest.raises(TypeError, match=r"`optimizer` must be an `optax.GradientTransformation`.*got function"):
        fp8ax.skip_fp8_state(optax.adam)


@pytest.mark.needs_hax_dot
def test_a_stacked_haliax_model_with_the_whole_model_in_the_optimizer(getkey):
    # `params=model` for weight decay: the FP8 state gets no update from it.
    from helpers import Deep

    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    x, y = _data(getkey)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(m, s):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(mse)(m, x, y))
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s, params=m)
        return fp8ax.apply_updates(m, updates, overwrite), s

    structure = jax.tree.structure(model)
    losses = []
    for _ in range(5):
        model, state = step(model, state)
        losses.append(float(mse(model, x, y)))
    assert jax.tree.structure(model) == structure
    assert losses[-1] < losses[0]
    stacked = jax.tree.leaves(model.blocks, is_leaf=lambda v: isinstance(v, fp8ax.Fp8DotGeneral))
    dgs = [v for v in stacked if isinstance(v, fp8ax.Fp8DotGeneral)]
    assert dgs and all(fp8ax.check_state(dg, written=True) is None for dg in dgs)


def test_writing_the_state_changes_values_only(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model))
    new = fp8ax.apply_updates(model, None, overwrite)
    assert jax.tree.structure(new) == jax.tree.structure(model)
    assert new.layers[0].dot_general.settings == model.layers[0].dot_general.settings
    # Every leaf of a converted model is an array, before and after: nothing can change
    # type under `jax.device_put`, a scan carry or `jax.tree.map(jnp.asarray, ...)`.
    for m in (model, new):
        assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(m.layers[0].dot_general))
    for recipe in (fp8ax.CurrentScaling(), fp8ax.DelayedScaling(calibrate_first_call=False)):
        assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(fp8ax.Fp8DotGeneral.init(recipe)))


# `eqx.apply_updates` on the raw gradient: the state goes through the optimizer.


def _eqx_flow(getkey, recipe=None):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()), fp8ax.Fp8Config(recipe=recipe))
    x = jax.random.normal(getkey(), (32, 8))
    y = jax.random.normal(getkey(), (32, 4))
    opt = optax.adam(1e-2)

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    @eqx.filter_jit
    def wrong_step(m, s):  # the mistake: the state's gradient treated as a gradient
        grads = eqx.filter_grad(loss)(m)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, s = opt.update(grads, s)
        return eqx.apply_updates(m, updates), s

    return model, opt, loss, wrong_step


def _fresh_like(model):
    """`model` with every FP8 state fresh (scale 1, empty history)."""
    is_state = lambda x: isinstance(x, fp8ax.ScalingState)  # noqa: E731
    return jax.tree.map(
        lambda s: fp8ax.ScalingState.init(s.amax_history.shape[-1], s.scale.shape) if is_state(s) else s,
        model,
        is_leaf=is_state,
    )


def _assert_outputs_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("calibrate", [False, True], ids=["default", "calibrate_first_call"])
def test_raw_gradient_through_the_optimizer_calibrates_and_check_state_reports_it(calibrate, getkey):
    # The mistake (no `partition_for_grad_overwrite`: the state goes through Adam and is
    # added to) cannot raise inside a compiled step without a host callback, which would
    # keep JAX's persistent cache from storing the step. The step reads the corrupt
    # history as one that gives no amax instead, and fp8ax reports the mistake wherever
    # it reads the state: `check_state`, an eager call, `calibrate`.
    model, opt, loss, wrong_step = _eqx_flow(getkey, fp8ax.DelayedScaling(calibrate_first_call=calibrate))
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    model, state = wrong_step(model, state)
    hist = np.asarray(model.layers[0].dot_general.lhs.amax_history)
    assert (hist < 0).any()  # what the mistake does: Adam's step made the amax history negative
    model, state = wrong_step(model, state)  # runs
    forward = eqx.filter_jit(loss)
    if calibrate:
        # The corrupt history counts as empty: each cast takes its scale from its
        # tensor's amax, as on a fresh state, bit for bit.
        _assert_outputs_equal(forward(model), forward(_fresh_like(model)))
    else:
        # The call keeps the state's scale: the stored scale over the stored unit, which
        # Adam moved alike (both by about its learning rate, 0.02 in two steps), so it
        # reads within a few float32 ulps of a fresh state's 1, not exactly 1. The
        # outputs match a fresh state's to 1e-6 (relative; bit for bit where the quotient
        # rounds to 1, which depends on the data).
        scales = [np.asarray(layer.dot_general.lhs.scale) for layer in model.layers]
        np.testing.assert_allclose(scales, 1.0, rtol=1e-6)
        np.testing.assert_allclose(forward(model), forward(_fresh_like(model)), rtol=1e-6)
    with pytest.raises(ValueError, match=r"negative or non-finite.*fp8ax\.apply_updates"):
        fp8ax.check_state(model)
    with pytest.raises(ValueError, match=r"`model\.layers\[0\]\.dot_general\.lhs`"):
        fp8ax.check_state(model)
    with pytest.raises(ValueError, match=r"fp8ax\.partition_for_grad_overwrite"):
        loss(model)  # an eager call reads the state
    with pytest.raises(ValueError, match=r"fp8ax\.partition_for_grad_overwrite"):
        fp8ax.calibrate(model, lambda m: loss(m), [()])
    with pytest.raises(ValueError, match=r"FP8 state `layers\.0/lhs`.*fp8ax\.partition_for_grad_overwrite"):
        fp8ax.scaling_stats(model)


def _replaced(state, *, scale=None, amax_history=None):
    """`state` with its scale or amax history replaced (a `ScalingState` keeps both in
    one array)."""
    return fp8ax.ScalingState(
        state.scale if scale is None else scale, state.amax_history if amax_history is None else amax_history
    )


@pytest.mark.parametrize("bad", ["nan", "negative-scale", "zero-scale", "inf-history", "negative-entry"])
def test_corrupt_state_values_calibrate_in_a_trace_and_are_an_error_eagerly(bad, getkey):
    dg = fp8ax.Fp8DotGeneral.init()
    x, w = jax.random.normal(getkey(), (4, 8)), jax.random.normal(getkey(), (8, 3))
    dims = (((1,), (0,)), ((), ()))
    dg(x, w, dims)  # a fresh state is fine
    role, field, value = {
        "nan": ("rhs", "amax_history", jnp.full((1024,), jnp.nan)),
        "negative-scale": ("lhs", "scale", jnp.float32(-0.5)),
        "zero-scale": ("grad", "scale", jnp.float32(0.0)),
        "inf-history": ("lhs", "amax_history", jnp.zeros(1024).at[3].set(jnp.inf)),
        # One negative entry in a filled history: its max is positive and finite.
        "negative-entry": ("rhs", "amax_history", jnp.full((1024,), 2.0).at[5].set(-1e-3)),
    }[bad]
    broken = dg.with_states(**{role: _replaced(getattr(dg, role), **{field: value})})
    fresh = fp8ax.Fp8DotGeneral.init()

    def value_and_grads(d):  # the gradient's state is read in the backward pass
        return jax.value_and_grad(lambda x, d: jnp.sum(d(x, w, dims) ** 2), argnums=(0, 1))(x, d)

    (out, (dx, new)), (want_out, (want_dx, want_new)) = (eqx.filter_jit(value_and_grads)(d) for d in (broken, fresh))
    _assert_outputs_equal(out, want_out)
    _assert_outputs_equal(dx, want_dx)
    # The new state of the corrupt operand is what a fresh one records (the history shifts
    # the corrupt entries along; the next write keeps them, and the check still reports them).
    _assert_outputs_equal(getattr(new, role).amax_history[0], getattr(want_new, role).amax_history[0])
    _assert_outputs_equal(getattr(new, role).scale, getattr(want_new, role).scale)
    with pytest.raises(ValueError, match=f"FP8 state `{role}`.*fp8ax.apply_updates"):
        broken(x, w, dims)
    with pytest.raises(ValueError, match=f"`model.{role}`"):
        fp8ax.check_state(broken)


def test_check_state_passes_every_state_fp8ax_writes(getkey):
    # Fifteen correct steps, one of them on an all-zero batch (an invalid observation that
    # leaves the state as it was), are accepted, and the histories fill.
    model, opt, loss, _ = _eqx_flow(getkey)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    state = opt.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(m, s, scale):
        grads = eqx.filter_grad(lambda m: loss(m) * scale)(m)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s)
        return fp8ax.apply_updates(m, updates, overwrite), s

    fp8ax.check_state(model)  # a fresh model is fine
    with pytest.raises(ValueError, match="has observed nothing"):
        fp8ax.check_state(model, written=True)  # ... but has written nothing yet
    for i in range(15):
        model, state = step(model, state, jnp.float32(0.0 if i == 3 else 1.0))
    hist = np.asarray(model.layers[0].dot_general.grad.amax_history)
    assert (hist >= 0).all() and (hist > 0).sum() == 14
    assert fp8ax.check_state(model, written=True) is None


def _is_state(x):
    return isinstance(x, fp8ax.ScalingState)


def _mlp_task(getkey, n_batches=5, width=16):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, width, 2, key=getkey()))
    batches = [(jax.random.normal(getkey(), (32, 8)), jax.random.normal(getkey(), (32, 4))) for _ in range(n_batches)]

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    return model, loss, batches


def _haliax_task(getkey, n_batches=5):
    model = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    batches = [
        (hax.random.normal(getkey(), (Batch, In)), hax.random.normal(getkey(), (Batch, Out))) for _ in range(n_batches)
    ]

    def loss(m, x, y):
        return hax.mean((m(x) - y) ** 2).array

    return model, loss, batches


@pytest.mark.parametrize(
    "task, opt",
    [
        ("mlp", optax.adam(1e-3)),
        ("mlp", optax.sgd(1e-2)),
        pytest.param("haliax", optax.adam(1e-3), marks=pytest.mark.needs_hax_dot),
    ],
    ids=["mlp-adam", "mlp-sgd", "haliax-adam"],
)
def test_a_dropped_state_trains_as_calibrated_and_check_state_names_it(getkey, task, opt):
    # The other mistake: the new state is split off, then dropped (`eqx.apply_updates`).
    # Every step then calibrates on its own tensors, in the one compiled program: right,
    # but never delayed scaling. `check_state(written=True)` says so, with the fix.
    model, loss, batches = (_mlp_task if task == "mlp" else _haliax_task)(getkey)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def make_step(write):
        @eqx.filter_jit
        def step(m, s, *batch):
            grads = eqx.filter_grad(loss)(m, *batch)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            with jax.numpy_dtype_promotion("standard"):
                updates, s = opt.update(grads, s, params=m)
            if write:
                return fp8ax.apply_updates(m, updates, overwrite), s
            return eqx.apply_updates(m, updates), s  # the mistake: the new state is dropped

        return step

    dropping, writing = make_step(False), make_step(True)
    dropped, written, s1, s2 = model, model, state, state
    for batch in batches[:3]:
        dropped, s1 = dropping(dropped, s1, *batch)
        written, s2 = writing(written, s2, *batch)
    states = [x for x in jax.tree.leaves(dropped, is_leaf=_is_state) if _is_state(x)]
    assert states and all(float(jnp.max(s.amax_history)) == 0.0 for s in states)  # never written
    fp8ax.check_state(dropped)  # nothing corrupt
    with pytest.raises(
        ValueError, match=r"eqx\.apply_updates.*model = fp8ax\.apply_updates\(model, updates, overwrite\)"
    ):
        fp8ax.check_state(dropped, written=True)
    fp8ax.check_state(written, written=True)
    # The first step is the same program for both, so the same weights after it; the
    # dropped run then keeps calibrating, the written one uses its histories.
    w1, _ = dropping(model, state, *batches[0])
    w2, _ = writing(model, state, *batches[0])
    for a, b in zip(jax.tree.leaves(fp8ax.strip_fp8(w1)), jax.tree.leaves(fp8ax.strip_fp8(w2)), strict=True):
        if eqx.is_array(a):
            _assert_outputs_equal(a, b)


def test_check_state_refuses_what_it_cannot_read(getkey):
    with pytest.raises(TypeError, match="holds no FP8 layer with state"):
        fp8ax.check_state(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    with pytest.raises(TypeError, match="holds no FP8 layer with state"):
        fp8ax.check_state(
            fp8ax.fp8_linear_layers(
                eqx.nn.MLP(8, 4, 16, 1, key=getkey()), fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling())
            )
        )
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    with pytest.raises(TypeError, match="`written` must be a bool"):
        fp8ax.check_state(model, written=1)
    with pytest.raises(ValueError, match="outside `jax.jit`"):
        eqx.filter_jit(lambda m: fp8ax.check_state(m))(model)


_PLAIN_EQUINOX_STEP = """
import equinox as eqx, jax, jax.numpy as jnp, optax, fp8ax
model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0)))
x, y = jax.random.normal(jax.random.key(1), (32, 8)), jax.random.normal(jax.random.key(2), (32, 4))
opt = optax.adam(1e-2)
opt_state = opt.init(eqx.filter(model, eqx.is_array))

@eqx.filter_jit
def step(model, opt_state):  # the Equinox docs' step, unchanged
    grads = eqx.filter_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state

for _ in range(3):
    model, opt_state = step(model, opt_state)
jax.block_until_ready(model)
print("trained", bool(jnp.all(jnp.isfinite(model.layers[0].weight))))
fp8ax.check_state(model)
"""


def test_a_plain_equinox_step_trains_and_check_state_says_what_went_wrong(tmp_path):
    # The state goes through Adam and is added to the weights' way. The steps run (each
    # calibrates), and `check_state` fails with fp8ax's message as the first line of the
    # error.
    script = tmp_path / "plain_step.py"
    script.write_text(_PLAIN_EQUINOX_STEP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "trained True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("ValueError: FP8 state `model.layers[0].dot_general.lhs`"), proc.stderr[-2000:]
    assert "negative or non-finite" in last and "fp8ax.apply_updates(model, updates, overwrite)" in last


def _ensemble_flow(getkey, n=3):
    keys = jax.random.split(getkey(), n)
    ens = eqx.filter_vmap(lambda k: eqx.nn.MLP(8, 4, 16, 1, key=k))(keys)
    ens = fp8ax.fp8_linear_layers(ens)
    xs, ys = jax.random.normal(getkey(), (n, 32, 8)), jax.random.normal(getkey(), (n, 32, 4))

    def loss(m):
        return jnp.sum(eqx.filter_vmap(lambda m, x, y: jnp.mean((jax.vmap(m)(x) - y) ** 2))(m, xs, ys))

    @eqx.filter_jit
    def step(m):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(loss)(m))
        return fp8ax.apply_updates(m, jax.tree.map(lambda g: -0.01 * g, grads), overwrite)

    return ens, loss, step


def test_an_ensemble_fills_every_member_s_history(getkey):
    ens, _, step = _ensemble_flow(getkey)
    for _ in range(10):
        ens = step(ens)
    assert (np.asarray(ens.layers[0].dot_general.lhs.amax_history)[:, :10] > 0).all()
    fp8ax.check_state(ens, written=True)


def test_a_corrupt_ensemble_member_calibrates_alone_and_is_named(getkey):
    ens, loss, step = _ensemble_flow(getkey)
    ens = step(ens)  # filled histories
    rhs = ens.layers[1].dot_general.rhs
    dg = ens.layers[1].dot_general
    broken = eqx.tree_at(
        lambda m: m.layers[1].dot_general,
        ens,
        dg.with_states(rhs=_replaced(rhs, amax_history=rhs.amax_history.at[2, 4].set(-1.0))),
    )
    # Member 2's weight calibrates on itself, the others keep their delayed scales: the
    # loss differs from the intact ensemble's in member 2's term only.
    per_member = eqx.filter_jit(
        lambda m: eqx.filter_vmap(lambda m, x: jax.vmap(m)(x))(m, jnp.ones((3, 32, 8), jnp.float32))
    )
    got, want = per_member(broken), per_member(ens)
    _assert_outputs_equal(got[:2], want[:2])
    with pytest.raises(ValueError, match=r"`model\.layers\[1\]\.dot_general\.rhs`"):
        fp8ax.check_state(broken)


def test_an_optimizer_that_keeps_state_for_the_fp8_state_is_named_once(getkey, monkeypatch):
    # A bare optimizer with moments, built from the whole model, keeps them for the zeros
    # where the FP8 state is; `apply_updates` says so once per process, with the size
    # and the fix, while the step is traced. `skip_fp8_state`, a stateless update (optax's
    # SGD, or one written by hand) and no updates say nothing.
    import fp8ax._update as update

    monkeypatch.setattr(update, "_WARNED_OPTIMIZER", [])
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)

    def step(opt):
        @eqx.filter_jit
        def run(model, opt_state):
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return fp8ax.apply_updates(model, updates, overwrite), opt_state

        with jax.numpy_dtype_promotion("standard"):  # (optax's step count is an int32)
            return run(model, opt.init(eqx.filter(model, eqx.is_array)))

    with warnings.catch_warnings():
        warnings.simplefilter("error", fp8ax.OptimizerStateWarning)
        step(fp8ax.skip_fp8_state(optax.adam(1e-3)))
        step(optax.sgd(1e-3))
        eqx.filter_jit(lambda m: fp8ax.apply_updates(m, jax.tree.map(lambda g: -1e-3 * g, grads), overwrite))(model)
        fp8ax.apply_updates(model, None, overwrite)
    # Two layers, three state arrays each of 1024 + 2 float32.
    with pytest.warns(
        fp8ax.OptimizerStateWarning, match=r"\(2 arrays, 24,624 bytes each time\).*fp8ax\.skip_fp8_state"
    ):
        step(optax.adam(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp8ax.OptimizerStateWarning)
        step(optax.sgd(1e-3, momentum=0.9))  # once per process


def test_gradients_that_still_hold_the_new_state_are_named_once(getkey, monkeypatch):
    # Equinox's plain step with `skip_fp8_state` and `eqx.apply_updates`: nothing splits
    # the new FP8 state off, so nothing writes it, and every step would cast with the
    # initial scales. The optimizer's `update` says so once per process, with the fix,
    # while the step is traced. Gradients split by `partition_for_grad_overwrite` (NumPy
    # zeros in the state's place) or by Haliax's partition (None there) say nothing.
    import fp8ax._update as update

    monkeypatch.setattr(update, "_WARNED_UNWRITTEN", [])
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))

    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    opt = fp8ax.skip_fp8_state(optax.adam(1e-3))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    grads = eqx.filter_grad(loss)(model)
    is_op = lambda v: isinstance(v, fp8ax.Fp8DotGeneral)  # noqa: E731
    with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
        warnings.simplefilter("error", fp8ax.StateNotWrittenWarning)
        opt.update(fp8ax.partition_for_grad_overwrite(grads)[1], opt_state, params=model)
        opt.update(eqx.partition(grads, is_op, is_leaf=is_op)[1], opt_state, params=model)

    @eqx.filter_jit
    def plain_step(model, opt_state):
        updates, opt_state = opt.update(eqx.filter_grad(loss)(model), opt_state, params=model)
        return eqx.apply_updates(model, updates), opt_state

    with jax.numpy_dtype_promotion("standard"):
        with pytest.warns(
            fp8ax.StateNotWrittenWarning,
            match=r"new FP8 state of 2 layers \(\.layers\[0\]\.dot_general, \.layers\[1\]\.dot_general\).*"
            r"partition_for_grad_overwrite",
        ):
            new, _ = plain_step(model, opt_state)
        assert float(new.layers[0].dot_general.lhs.amax_history[0]) == 0  # indeed not written
        with warnings.catch_warnings():
            warnings.simplefilter("error", fp8ax.StateNotWrittenWarning)
            opt.update(grads, opt_state, params=model)  # once per process
