"""fp8ax.calibrate: fills the histories from a few batches, weights untouched, and
compiles the steps after it without the first-call conditional."""

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
    # Layers whose histories are filled compile without the calibration branch; the
    # layer no batch reached keeps its empty state and its first-call program.
    assert out.body.dot_general.settled and not out.body.dot_general.program_recipe.calibrate_first_call
    assert out.head.dot_general.settled and not out.head.dot_general.program_recipe.calibrate_first_call
    assert not out.unused.dot_general.settled and out.unused.dot_general.program_recipe.calibrate_first_call
    assert out.body.dot_general.recipe == model.body.dot_general.recipe  # the settings stay
    assert not _hist(out.unused.dot_general)["lhs"].any()


def test_calibrated_state_is_the_first_training_steps(getkey):
    # The state `calibrate` writes is the state the first step of training writes.
    model = fp8ax.fp8_linear_layers(TwoHeads(getkey()))
    x, y = jax.random.normal(getkey(), (16, 8)), jax.random.normal(getkey(), (16, 4))
    calibrated = fp8ax.calibrate(model, loss_fn, [(x, y)], keep_first_call=True)
    overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_jit(eqx.filter_grad(loss_fn))(model, x, y))
    stepped = fp8ax.apply_updates(model, None, overwrite)
    for role in ("lhs", "rhs", "grad"):
        for a, b in zip(
            jax.tree.leaves(getattr(calibrated.body.dot_general, role)),
            jax.tree.leaves(getattr(stepped.body.dot_general, role)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not calibrated.body.dot_general.settled and stepped.body.dot_general.settled  # kept
    assert jax.tree.structure(calibrated) == jax.tree.structure(stepped)


def test_calibrated_step_has_no_conditional_and_same_numbers(getkey):
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=getkey())
    model = fp8ax.fp8_linear_layers(mlp)
    x = jax.random.normal(getkey(), (32, 8))

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    calibrated = fp8ax.calibrate(model, loss, [x])
    walk = _walk_step(calibrated, x)
    assert walk.branches == [] and len(walk.converts) == 9 and not any(walk.converts)
    # The same state through the conditional's delayed branch gives the same numbers: the
    # loss and the new FP8 state bit for bit; parameter gradients to float32 rounding
    # (XLA fuses the two programs differently and may sum the bias gradient in another
    # order: measured differences of 1 ulp).
    with_cond = fp8ax.calibrate(model, loss, [x], keep_first_call=True)
    vg = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l1, g1), (l2, g2) = vg(calibrated, x), vg(with_cond, x)
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
    with pytest.raises(TypeError, match="`keep_first_call` must be a bool"):
        fp8ax.calibrate(model, loss_fn, [], keep_first_call=1)
    with pytest.raises(ValueError, match="no FP8 layer with state"):
        fp8ax.calibrate(TwoHeads(getkey()), loss_fn, [])
    stateless = fp8ax.fp8_linear_layers(TwoHeads(getkey()), fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling()))
    with pytest.raises(ValueError, match="no FP8 layer with state"):
        fp8ax.calibrate(stateless, loss_fn, [])


def test_a_scanned_training_loop_runs_after_calibrate(getkey):
    # A scan body is one program for every step. With the model's non-array leaves out of
    # the carry (the usual `eqx.partition`), the program switch `calibrating` is static:
    # a fresh model runs the first-call program on every scanned step (it calibrates on
    # the first and follows its history after), and after `calibrate` the settled one,
    # and three scanned steps equal three steps of a Python loop, bit for bit.
    import optax

    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    xs = jax.random.normal(getkey(), (3, 16, 8))
    ys = jax.random.normal(getkey(), (3, 16, 4))
    opt = optax.sgd(1e-2)
    opt_state = opt.init(eqx.filter(fp8ax.partition_for_grad_overwrite(model)[1], eqx.is_array))

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
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
        return model

    got, _ = scanned(model, opt_state, xs, ys)  # fresh
    assert not got.layers[0].dot_general.settled  # the switch is static in the scan
    want = looped(model, opt_state)
    for a, b in zip(jax.tree.leaves(eqx.filter(got, eqx.is_array)), jax.tree.leaves(eqx.filter(want, eqx.is_array))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)

    model = fp8ax.calibrate(model, loss_fn, [(xs[0], ys[0])])
    got, _ = scanned(model, opt_state, xs, ys)
    want = looped(model, opt_state)
    assert got.layers[0].dot_general.settled and want.layers[0].dot_general.settled
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
