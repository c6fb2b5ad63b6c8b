"""fp8ax.calibrate: fills the histories from a few batches, weights untouched; the
training step is one program before and after it."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from helpers import walk_train_step as _walk_step


class TwoHeads(eqx.Module):
    body: eqx.nn.Linear
    head: eqx.nn.Linear
    unused: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.body = eqx.nn.Linear(8, 16, key=k1)
        self.head = eqx.nn.Linear(16, 4, key=k2)
        self.unused = eqx.nn.Linear(16, 4, key=k3)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.body(x)))


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _hist(dg):
    return {n: np.asarray(getattr(dg, n).amax_history) for n in ("lhs", "rhs", "grad")}


def test_calibrate_fills_histories_and_keeps_weights(getkey):
    model = fp8ax.fp8_linear_layers(TwoHeads(getkey()))
    batches = [(3.0 * jax.random.normal(getkey(), (16, 8)), jax.random.normal(getkey(), (16, 4))) for _ in range(2)]
    # The loss never calls `unused`: the first trace names it.
    with pytest.warns(fp8ax.UnusedLayerWarning, match="`unused` is never called"):
        out = fp8ax.calibrate(model, loss_fn, batches)
    for name in ("body", "head", "unused"):
        assert getattr(out, name).weight is getattr(model, name).weight
        assert getattr(out, name).bias is getattr(model, name).bias
    # Hand replay of what each layer saw: newest amax first.
    h = _hist(out.body.dot_general)
    np.testing.assert_array_equal(h["lhs"][:3], [np.abs(batches[1][0]).max(), np.abs(batches[0][0]).max(), 0])
    w_amax = np.abs(np.asarray(model.body.weight)).max()
    np.testing.assert_array_equal(h["rhs"][:3], [w_amax, w_amax, 0])
    assert (h["grad"][:2] > 0).all() and h["grad"][2] == 0
    # The layer no batch reached keeps its empty state; the settings stay as configured.
    assert out.body.dot_general.settings == model.body.dot_general.settings
    assert not _hist(out.unused.dot_general)["lhs"].any()


def test_calibrated_state_is_the_first_training_steps(getkey):
    # The state `calibrate` writes is the state the first step of training writes.
    model = fp8ax.fp8_linear_layers(TwoHeads(getkey()))
    x, y = jax.random.normal(getkey(), (16, 8)), jax.random.normal(getkey(), (16, 4))
    # The loss never calls `unused` (the test above checks the warning; here JAX's cache may
    # skip the trace that warns).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8ax.UnusedLayerWarning)
        calibrated = fp8ax.calibrate(model, loss_fn, [(x, y)])
        overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_jit(eqx.filter_grad(loss_fn))(model, x, y))
    stepped = fp8ax.apply_updates(model, None, overwrite)
    for role in ("lhs", "rhs", "grad"):
        for a, b in zip(
            jax.tree.leaves(getattr(calibrated.body.dot_general, role)),
            jax.tree.leaves(getattr(stepped.body.dot_general, role)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(calibrated) == jax.tree.structure(stepped) == jax.tree.structure(model)


def test_one_program_without_conditional_and_its_cost(getkey):
    # A step is one program, the first step's included: no conditional. With the default
    # recipe (no first-call calibration) every cast takes its scale from the state alone.
    # With `calibrate_first_call=True` a cast picks its scale with a `select` on "history
    # empty", so every FP8 cast depends on its tensor's amax, filled state or not (what the
    # in-step calibration costs every step, as current scaling does). With the same
    # filled state both give the same loss and new state bit for bit, and parameter
    # gradients to float32 rounding (XLA fuses the two programs differently and may sum the
    # bias gradient in another order: measured differences of 1 ulp).
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
    x = jax.random.normal(getkey(), (32, 8))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    default = fp8ax.fp8_linear_layers(mlp)
    for model in (default, fp8ax.calibrate(default, loss, [x])):
        walk = _walk_step(model, x)
        assert walk.branches == [] and len(walk.converts) == 9 and not any(walk.converts)
    config = fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=True))
    in_step = fp8ax.fp8_linear_layers(mlp, config)
    walk = _walk_step(in_step, x)
    assert walk.branches == [] and len(walk.converts) == 9 and all(walk.converts)

    calibrated = fp8ax.calibrate(in_step, loss, [x])
    same_state = jax.tree.map(
        lambda d, c: eqx.tree_at(lambda m: m.state, d, c.state) if isinstance(d, fp8ax.Fp8DotGeneral) else d,
        default,
        calibrated,
        is_leaf=lambda v: isinstance(v, fp8ax.Fp8DotGeneral),
    )
    walk = _walk_step(calibrated, x)
    assert all(walk.converts)  # a filled state too: the select stays in the program
    vg = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l1, g1), (l2, g2) = vg(calibrated, x), vg(same_state, x)
    assert float(l1) == float(l2)
    (s1, p1), (s2, p2) = fp8ax.partition_for_grad_overwrite(g1), fp8ax.partition_for_grad_overwrite(g2)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_calibrate_bad_input(getkey):
    model = fp8ax.fp8_linear_layers(TwoHeads(getkey()))
    with pytest.raises(ValueError, match="`batches` is empty"):
        fp8ax.calibrate(model, loss_fn, [])
    with pytest.raises(TypeError, match="`loss_fn` must be a callable"):
        fp8ax.calibrate(model, "mse", [(1, 2)])
    with pytest.raises(ValueError, match="no FP8 layer with state"):
        fp8ax.calibrate(TwoHeads(getkey()), loss_fn, [])
    stateless = fp8ax.fp8_linear_layers(TwoHeads(getkey()), fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling()))
    with pytest.raises(ValueError, match="no FP8 layer with state"):
        fp8ax.calibrate(stateless, loss_fn, [])


@pytest.mark.parametrize("carry", ["arrays", "whole model"])
def test_a_scanned_training_loop_equals_the_python_loop(getkey, carry):
    # A scan body is one program for every step, and so is the jitted step: a fresh model
    # (calibrating on its first step) and a calibrated one, scanned three steps with the
    # model's arrays (the usual `eqx.partition`) or the whole model and the optimizer
    # state as the carry, equal three steps of a Python loop, bit for bit.
    import optax

    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey(), activation=jax.nn.relu))
    xs = jax.random.normal(getkey(), (3, 16, 8))
    ys = jax.random.normal(getkey(), (3, 16, 4))
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    @eqx.filter_jit
    def scanned(model, opt_state, xs, ys):
        arrays, static = eqx.partition((model, opt_state), eqx.is_array)

        def body(arrays, xy):
            out = step(*eqx.combine(arrays, static), *xy)
            return eqx.filter(out, eqx.is_array), None

        return eqx.combine(jax.lax.scan(body, arrays, (xs, ys))[0], static)

    def looped(model, opt_state):
        for i in range(3):
            model, opt_state = eqx.filter_jit(step)(model, opt_state, xs[i], ys[i])
        return model, opt_state

    for m in (model, fp8ax.calibrate(model, loss_fn, [(xs[0], ys[0])])):
        if carry == "arrays":
            got = scanned(m, opt_state, xs, ys)
        else:  # everything in the carry: eqx.nn.MLP's activation is a function, so close over it
            arrays, static = eqx.partition(m, eqx.is_array)

            @jax.jit
            def whole(arrays, opt_state, xs, ys):
                def body(carry, xy):
                    model, opt_state = carry
                    model, opt_state = step(eqx.combine(model, static), opt_state, *xy)
                    return (eqx.filter(model, eqx.is_array), opt_state), None

                return jax.lax.scan(body, (arrays, opt_state), (xs, ys))[0]

            got_arrays, got_state = whole(arrays, opt_state, xs, ys)
            got = (eqx.combine(got_arrays, static), got_state)
        want = looped(m, opt_state)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
