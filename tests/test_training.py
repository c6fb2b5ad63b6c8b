"""Short CPU training runs: FP8 reaches the loss of the high-precision run."""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax
import pytest

import fp8ax
from recipe_registry import STATELESS

In, Hidden, Out, Batch = hax.Axis("In", 32), hax.Axis("Hidden", 128), hax.Axis("Out", 8), hax.Axis("Batch", 128)


class Mlp(eqx.Module):
    up_proj: hax.nn.Linear
    down_proj: hax.nn.Linear

    def __call__(self, x):
        return self.down_proj(hax.nn.gelu(self.up_proj(x)))


def _train(model, loss_fn, batches, steps):
    opt = optax.adam(3e-3)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    opt_state = opt.init(eqx.filter(trainable, eqx.is_inexact_array))  # eqx.nn.MLP holds its activation

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = opt.update(grads, opt_state, params=eqx.filter(model, eqx.is_inexact_array))
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    losses = []
    for i in range(steps):
        x, y = batches(i)
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return sum(losses[-20:]) / 20  # mean of the last 20 steps: less noisy than one


def _teacher(key):
    k1, k2 = jax.random.split(key)
    w1 = jax.random.normal(k1, (32, 64)) / jnp.sqrt(32.0)
    w2 = jax.random.normal(k2, (64, 8)) / jnp.sqrt(64.0)
    return lambda x: jnp.tanh(x @ w1) @ w2


@pytest.fixture(scope="module")
def haliax_setup():
    """A bf16 Haliax MLP, its loss and batches, and the loss bf16 training reaches."""
    teacher = _teacher(jax.random.key(0))

    def batches(i):
        x = jax.random.normal(jax.random.key(1000 + i), (128, 32))
        return hax.named(x.astype(jnp.bfloat16), (Batch, In)), hax.named(teacher(x).astype(jnp.bfloat16), (Batch, Out))

    def loss_fn(m, x, y):
        d = (m(x) - y).astype(jnp.float32)
        return hax.mean(d * d).scalar()

    k1, k2 = jax.random.split(jax.random.key(1))
    model = fp8ax.cast_floating(
        Mlp(hax.nn.Linear.init(In, Hidden, key=k1), hax.nn.Linear.init(Hidden, Out, key=k2)), jnp.bfloat16
    )
    return model, loss_fn, batches, _train(model, loss_fn, batches, 300)


@pytest.mark.needs_hax_dot
def test_haliax_mlp_fp8_matches_bf16(haliax_setup):
    model, loss_fn, batches, bf16 = haliax_setup
    start = float(loss_fn(model, *batches(0)))
    fp8 = _train(fp8ax.fp8_linear_layers(model), loss_fn, batches, 300)
    assert bf16 < 0.2 * start  # it did learn
    assert abs(fp8 - bf16) <= 0.1 * bf16, (fp8, bf16)


def test_equinox_mlp_fp8_matches_bf16():
    teacher = _teacher(jax.random.key(2))

    def batches(i):
        x = jax.random.normal(jax.random.key(2000 + i), (128, 32))
        return x.astype(jnp.bfloat16), teacher(x).astype(jnp.bfloat16)

    def loss_fn(m, x, y):
        d = (jax.vmap(m)(x) - y).astype(jnp.float32)
        return jnp.mean(d * d)

    model = eqx.nn.MLP(32, 8, width_size=128, depth=1, activation=jax.nn.gelu, key=jax.random.key(3))
    model = fp8ax.cast_floating(model, jnp.bfloat16)
    start = float(loss_fn(model, *batches(0)))
    bf16 = _train(model, loss_fn, batches, 300)
    fp8 = _train(fp8ax.fp8_linear_layers(model), loss_fn, batches, 300)
    assert bf16 < 0.2 * start
    assert abs(fp8 - bf16) <= 0.1 * bf16, (fp8, bf16)


# Every stateless recipe of the registry (tests/recipe_registry.py), with the loss gap to
# bf16 its entry allows (delayed scaling trains in the tests above).
@pytest.mark.needs_hax_dot
@pytest.mark.parametrize("name", list(STATELESS))
def test_each_recipe_trains_like_bf16(name, haliax_setup):
    recipe, tolerance = STATELESS[name].recipe, STATELESS[name].train_tolerance
    model, loss_fn, batches, bf16 = haliax_setup
    low = _train(fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(recipe=recipe)), loss_fn, batches, 300)
    print(f"{recipe!r}: {low:.5f} vs bf16 {bf16:.5f}")
    assert abs(low - bf16) <= tolerance * bf16, (low, bf16)
