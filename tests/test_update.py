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
from helpers import Batch, HaliaxMLP, In, Mid, Out, mse, with_settings_of


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
    # the model's arrays, so an optimiser state built from them matches it.
    assert jax.tree.structure(rest) == jax.tree.structure(eqx.filter(m, eqx.is_array))
    dg = rest.up_proj.dot_general
    assert isinstance(dg, fp8ax.Fp8DotGeneral) and dg.settings == m.up_proj.dot_general.settings
    for leaf in jax.tree.leaves(dg):
        assert leaf.dtype == jnp.float32 and not np.any(np.asarray(leaf))
    assert dg.calibrating is None  # not an array: left out, as `eqx.filter_grad` leaves it


@pytest.mark.needs_hax_dot
def test_tldr_train_step_with_adamw(getkey):
    # The README's step, with an optimiser that reads `params` (weight decay).
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
def test_what_the_optimiser_makes_of_the_state_is_ignored(getkey):
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
    assert new.up_proj.dot_general.settled
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

    model, _ = step(model, "b")  # give head_b some state
    before = jax.tree.leaves(model.head_b.dot_general)
    after_model, overwrite = step(model, "a")  # head_b unused this step
    for a, b in zip(before, jax.tree.leaves(after_model.head_b.dot_general)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # What the step delivered for head_b is zeros; overwriting with it (as Haliax's
    # `apply_updates` does) would make the next scale 0.
    assert float(overwrite.head_b.dot_general.lhs.scale) == 0.0
    haliax_result = haxq.apply_updates(model, jax.tree.map(lambda _: None, model), overwrite)
    assert float(haliax_result.head_b.dot_general.lhs.scale) == 0.0
    assert float(after_model.head_b.dot_general.lhs.scale) > 0.0


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
    # And fp8ax's helpers run a Haliax-quantised model.
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
    # The global norm of what the optimiser sees covers the parameters only (the FP8
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
    assert cast.up_proj.dot_general.calibrating == 1.0  # a Python float: not cast
    with pytest.raises(TypeError, match="`dtype` must be a floating dtype, got int8"):
        fp8ax.cast_floating(model, jnp.int8)
    # The naive cast loses float32 state, and the layer refuses to run on it.
    naive = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, model)
    with pytest.raises(TypeError, match="must stay float32"):
        naive(hax.random.normal(getkey(), (Batch, In)).astype(jnp.bfloat16))


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


# The optimiser state as Equinox's examples build it, from the whole model:
# `opt.init(eqx.filter(model, eqx.is_array))`, FP8 state included.

_OPTIMISERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd-momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "clip-adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}


def _trained_with(model, loss, opt, init_from, steps):
    """`model` after `steps` jitted fp8ax steps, the optimiser state built from
    `init_from`; checks that the optimiser state keeps its structure and shapes, and
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


@pytest.mark.parametrize("name", list(_OPTIMISERS))
def test_an_optimiser_state_built_from_the_whole_model_works(getkey, name):
    # It used to fail inside optax with a pytree structure error: the gradients held None
    # where the optimiser state held the FP8 state, and the first step changed a static
    # setting of every layer. It now trains exactly as an optimiser state built without
    # the FP8 state does, with the same two compilations.
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    y = jax.random.normal(getkey(), (32, 4))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    whole, traces = _trained_with(model, loss, _OPTIMISERS[name](), model, 4)
    assert traces == 2  # the calibrating first step, then the settled program
    trainable = fp8ax.partition_for_grad_overwrite(model)[1]
    want, _ = _trained_with(model, loss, _OPTIMISERS[name](), trainable, 4)
    _assert_same_arrays(whole, want)
    dg = whole.layers[0].dot_general
    assert dg.settled and dg.recipe == model.layers[0].dot_general.recipe
    # The state was written, not moved by the optimiser: the newest amax is the input's.
    assert float(dg.lhs.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert float(jnp.max(jnp.abs(whole.layers[0].weight - model.layers[0].weight))) > 0


@pytest.mark.needs_hax_dot
def test_a_stacked_haliax_model_with_the_whole_model_in_the_optimiser(getkey):
    # `params=model` for weight decay: the switch `calibrating` (a float, not an array) gets no update.
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
    assert dgs and all(dg.settled and dg.calibrating == 0.0 for dg in dgs)


def test_settling_keeps_the_pytree_structure(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    x = jax.random.normal(getkey(), (32, 8))
    dg = model.layers[0].dot_general
    assert not dg.settled and dg.calibrating == 1.0 and dg.program_recipe.calibrate_first_call
    overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x)))(model))
    new = fp8ax.apply_updates(model, None, overwrite)
    assert jax.tree.structure(new) == jax.tree.structure(model)
    dg = new.layers[0].dot_general
    assert dg.settled and dg.calibrating == 0.0
    assert dg.recipe == model.layers[0].dot_general.recipe  # the settings say what was configured
    assert dg.program_recipe == fp8ax.DelayedScaling(calibrate_first_call=False)
    # Stateless recipes and a recipe without a first-call mode have no switch.
    for recipe in (fp8ax.CurrentScaling(), fp8ax.DelayedScaling(calibrate_first_call=False)):
        dg = fp8ax.Fp8DotGeneral.init(recipe)
        assert dg.calibrating is None and dg.settled and dg.program_recipe == recipe


def test_a_malformed_program_switch_is_refused():
    dg = fp8ax.Fp8DotGeneral.init()
    for bad in (jnp.zeros((3,)), 0.5, "yes"):
        with pytest.raises(TypeError, match=r"`calibrating` must be None, 1.0 \(a fresh layer\) or 0.0"):
            fp8ax.Fp8DotGeneral(dg.lhs, dg.rhs, dg.grad, dg.settings, calibrating=bad)


# `eqx.apply_updates` on the raw gradient: the state goes through the optimiser.


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


def test_raw_gradient_through_the_optimiser_is_an_error(getkey):
    model, opt, loss, wrong_step = _eqx_flow(getkey)
    state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    model, state = wrong_step(model, state)  # the first call cannot know
    hist = np.asarray(model.layers[0].dot_general.lhs.amax_history)
    assert (hist < 0).any()  # what the mistake does: Adam's step made the amax history negative
    with pytest.raises(Exception, match=r"negative or non-finite.*fp8ax\.apply_updates"):
        jax.block_until_ready(wrong_step(model, state))
    with pytest.raises(Exception, match=r"fp8ax\.partition_for_grad_overwrite"):
        jax.block_until_ready(eqx.filter_jit(loss)(model))  # any later call, forward only too


@pytest.mark.parametrize("bad", ["nan", "negative-scale", "zero-scale", "inf-history", "negative-entry"])
def test_corrupt_state_values_are_an_error(bad, getkey):
    dg = fp8ax.Fp8DotGeneral.init()
    x, w = jax.random.normal(getkey(), (4, 8)), jax.random.normal(getkey(), (8, 3))
    dims = (((1,), (0,)), ((), ()))
    dg(x, w, dims)  # a fresh state is fine
    where, value = {
        "nan": (lambda d: d.rhs.amax_history, jnp.full((16,), jnp.nan)),
        "negative-scale": (lambda d: d.lhs.scale, jnp.float32(-0.5)),
        "zero-scale": (lambda d: d.grad.scale, jnp.float32(0.0)),
        "inf-history": (lambda d: d.lhs.amax_history, jnp.zeros(16).at[3].set(jnp.inf)),
        # One negative entry in a filled history: its max is positive and finite.
        "negative-entry": (lambda d: d.rhs.amax_history, jnp.full((16,), 2.0).at[5].set(-1e-3)),
    }[bad]
    broken = eqx.tree_at(where, dg, value)
    # The gradient's state is read in the backward pass.
    call = (
        (lambda d: jax.grad(lambda x: jnp.sum(d(x, w, dims)))(x)) if bad == "zero-scale" else (lambda d: d(x, w, dims))
    )
    with pytest.raises(Exception, match="fp8ax.apply_updates"):
        jax.block_until_ready(eqx.filter_jit(call)(broken))


def test_the_check_passes_every_state_fp8ax_writes(getkey):
    # Fifteen correct steps, one of them on an all-zero batch (an invalid observation that
    # leaves the state as it was), raise nothing, and the histories fill.
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

    for i in range(15):
        model, state = step(model, state, jnp.float32(0.0 if i == 3 else 1.0))
    hist = np.asarray(model.layers[0].dot_general.grad.amax_history)
    assert (hist >= 0).all() and (hist > 0).sum() == 14


def test_a_state_never_written_warns_after_many_calls(getkey, monkeypatch):
    # The other `eqx.apply_updates` mistake: the new state is split off, then dropped. Every
    # call then finds an empty history and calibrates; after STALE_CALLS calls of one
    # compiled program fp8ax warns, once.
    monkeypatch.setattr(fp8ax._recipes._StaleWatch, "warned", False)
    # The early warning (test_dropping_the_state_warns_by_the_third_step) has its own test.
    monkeypatch.setattr(fp8ax._recipes._StaleWatch, "warned_early", True)
    model, opt, loss, _ = _eqx_flow(getkey)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    state = opt.init(eqx.filter(trainable, eqx.is_inexact_array))

    @eqx.filter_jit
    def dropping_step(m, s):
        grads = eqx.filter_grad(loss)(m)
        _, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s)
        return eqx.apply_updates(m, updates), s

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(fp8ax._recipes.STALE_CALLS - 1):
            model, state = dropping_step(model, state)
        jax.effects_barrier()
        assert not caught  # 99 calls: nothing yet
        for _ in range(3):
            model, state = dropping_step(model, state)
        jax.effects_barrier()
    assert len(caught) == 1 and "fp8ax.apply_updates" in str(caught[0].message)
    assert float(jnp.max(model.layers[0].dot_general.lhs.amax_history)) == 0.0  # what the warning is about


# --- the dropped state (issue: `eqx.apply_updates` after partitioning was silent for 99 steps) ---


@pytest.fixture
def fresh_watch(monkeypatch):
    """The stale-state warnings as in a fresh process (each is shown once per process)."""
    monkeypatch.setattr(fp8ax._recipes._StaleWatch, "warned", False)
    monkeypatch.setattr(fp8ax._recipes._StaleWatch, "warned_early", False)


def _train(model, loss, batches, opt, *, write=True, step=None):
    """Trains `model` on `batches` with one compiled step; the warnings of each step."""
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    state = opt.init(eqx.filter(trainable, eqx.is_inexact_array))
    if step is None:

        @eqx.filter_jit
        def step(m, s, *batch):
            grads = eqx.filter_grad(loss)(m, *batch)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            with jax.numpy_dtype_promotion("standard"):
                updates, s = opt.update(grads, s, params=m)
            if write:
                return fp8ax.apply_updates(m, updates, overwrite), s
            return eqx.apply_updates(m, updates), s  # the mistake: the new state is dropped

    caught = []
    for batch in batches:
        with warnings.catch_warnings(record=True) as now:
            warnings.simplefilter("always")
            model, state = step(model, state, *batch)
            jax.effects_barrier()
        caught.append([str(w.message) for w in now if "fp8ax" in str(w.message)])
    return model, caught


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
        ("mlp", optax.adamw(1e-4, weight_decay=0.1)),
        pytest.param("haliax", optax.adam(1e-3), marks=pytest.mark.needs_hax_dot),
    ],
    ids=["mlp-adam", "mlp-sgd", "mlp-adamw", "haliax-adam"],
)
def test_dropping_the_state_warns_by_the_third_step(getkey, fresh_watch, task, opt):
    model, loss, batches = (_mlp_task if task == "mlp" else _haliax_task)(getkey)
    model, caught = _train(model, loss, batches, opt, write=False)
    assert caught[:2] == [[], []], caught  # steps 1 and 2 could be fresh models
    assert len(caught[2]) == 1, caught  # step 3, once
    msg = caught[2][0]
    assert "eqx.apply_updates" in msg and "model = fp8ax.apply_updates(model, updates, overwrite)" in msg, msg
    assert caught[3:] == [[]] * (len(batches) - 3)  # once per process
    states = [x for x in jax.tree.leaves(model, is_leaf=_is_state) if _is_state(x)]
    assert states and all(float(jnp.max(s.amax_history)) == 0.0 for s in states)  # what it is about


def _is_state(x):
    return isinstance(x, fp8ax.ScalingState)


def test_dropping_the_state_of_microbatched_gradients_warns(getkey, fresh_watch):
    # k microbatches calibrate k times per step on the same weights: one step, not k.
    model, loss, batches = _mlp_task(getkey)
    opt = optax.adam(1e-3)
    grad_fn = fp8ax.microbatched(eqx.filter_grad(loss), 4, average=True)

    @eqx.filter_jit
    def step(m, s, x, y):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grad_fn(m, x, y))
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s, params=m)
        return eqx.apply_updates(m, updates), s

    _, caught = _train(model, loss, batches, opt, step=step)
    assert caught[:2] == [[], []] and len(caught[2]) == 1, caught


def test_microbatches_before_a_separate_update_do_not_warn(getkey, fresh_watch):
    # Gradients of 6 microbatches, each from its own call of a jitted function, then the
    # update in another jitted function (traced only after the microbatches ran).
    model, loss, _ = _mlp_task(getkey)
    opt = optax.adam(1e-3)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    state = opt.init(eqx.filter(trainable, eqx.is_inexact_array))
    grad_fn = eqx.filter_jit(eqx.filter_grad(loss))

    @eqx.filter_jit
    def update(m, s, grads):
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, s = opt.update(grads, s, params=m)
        return fp8ax.apply_updates(m, updates, overwrite), s

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            total = None
            for _ in range(6):
                g = grad_fn(model, jax.random.normal(getkey(), (8, 8)), jax.random.normal(getkey(), (8, 4)))
                total = g if total is None else fp8ax.accumulate_gradients(total, g)
            model, state = update(model, state, total)
        jax.effects_barrier()


@pytest.mark.needs_hax_dot
def test_no_false_alarm_on_a_sweep_of_fresh_haliax_models(getkey, fresh_watch):
    # `hax.dot` traces through an inner `filter_jit` that caches the FP8 call across models
    # of one shape, so one watch sees every model of the sweep: each calibrates once.
    opt = optax.adam(1e-3)
    seen = []
    for _ in range(6):
        model, loss, batches = _haliax_task(getkey, n_batches=3)
        seen += sum(_train(model, loss, batches, opt)[1], [])
    assert seen == []


def test_no_false_alarm_on_sweeps_of_fresh_models(getkey, fresh_watch):
    warnings_seen = []
    # 1. Fresh models (new seeds, a repeated seed, two widths) trained correctly, one
    #    compiled step per architecture: each model calibrates once, on its first step.
    opt = optax.adam(1e-3)
    for width in (16, 16, 32):
        for _ in range(4):
            model, loss, batches = _mlp_task(getkey, n_batches=3, width=width)
            warnings_seen += sum(_train(model, loss, batches, opt)[1], [])
    same = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(7))
    for _ in range(3):
        _, loss, batches = _mlp_task(getkey, n_batches=3)
        warnings_seen += sum(_train(fp8ax.fp8_linear_layers(same), loss, batches, opt)[1], [])
    # 2. Gradients of fresh models, never trained, through one compiled function.
    model, loss, batches = _mlp_task(getkey)
    grad_fn = eqx.filter_jit(eqx.filter_grad(loss))
    with warnings.catch_warnings(record=True) as now:
        warnings.simplefilter("always")
        for _ in range(8):
            model, loss, batches = _mlp_task(getkey)
            grad_fn(model, *batches[0])
        # 3. A bf16 run evaluated in FP8 now and then: fresh conversions of slowly
        #    changing weights, forward only.
        plain = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
        evaluate = eqx.filter_jit(loss)
        for _ in range(6):
            plain = jax.tree.map(lambda w: w * 0.999 if eqx.is_inexact_array(w) else w, plain)
            evaluate(fp8ax.fp8_linear_layers(plain), *batches[0])
        jax.effects_barrier()
    warnings_seen += [str(w.message) for w in now if "fp8ax" in str(w.message)]
    assert warnings_seen == []


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
"""


def test_a_plain_equinox_step_fails_with_fp8ax_s_message_first(tmp_path):
    # The state goes through Adam and is added to the weights' way; the next step's check
    # fails inside a host callback, which JAX reports as "INTERNAL: CpuCallback error
    # calling callback: Traceback ..." with fp8ax's message some 1600 characters in.
    script = tmp_path / "plain_step.py"
    script.write_text(_PLAIN_EQUINOX_STEP)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("fp8ax: an FP8 scaling state (scale, amax history) holds negative"), proc.stderr[:2000]
    assert "fp8ax.apply_updates(model, updates, overwrite)" in lines[0]
    assert "jax.debug.callback failed" not in proc.stderr  # no second traceback from JAX's log
    assert "JaxRuntimeError" in proc.stderr  # the error itself still stops the program


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


def test_an_ensemble_trained_correctly_does_not_warn(getkey, monkeypatch):
    # Under `eqx.filter_vmap` with a state per member, the first-call conditional has a
    # batched predicate and becomes a select that runs the calibrating branch on every
    # call. Only members whose history is empty may count as stale.
    monkeypatch.setattr(fp8ax._recipes._StaleWatch, "warned", False)
    monkeypatch.setattr(fp8ax._recipes, "STALE_CALLS", 4)
    ens, _, step = _ensemble_flow(getkey)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            ens = step(ens)
        jax.effects_barrier()
    assert not caught
    assert (np.asarray(ens.layers[0].dot_general.lhs.amax_history)[:, :10] > 0).all()


def test_a_corrupt_ensemble_member_is_an_error(getkey):
    ens, loss, step = _ensemble_flow(getkey)
    fresh = ens
    ens = step(ens)  # filled histories: the members take the delayed branch
    # The checks live in the calibrating program, which a written layer leaves behind: put
    # the filled state back into the fresh program (as restoring its arrays into a freshly
    # converted ensemble does).
    ens = with_settings_of(fresh, ens)
    assert not ens.layers[1].dot_general.settled
    broken = eqx.tree_at(
        lambda m: m.layers[1].dot_general.rhs.amax_history,
        ens,
        ens.layers[1].dot_general.rhs.amax_history.at[2, 4].set(-1.0),
    )
    with pytest.raises(Exception, match="fp8ax.apply_updates"):
        jax.block_until_ready(eqx.filter_jit(loss)(broken))
    jax.block_until_ready(eqx.filter_jit(loss)(ens))  # the intact ensemble runs
