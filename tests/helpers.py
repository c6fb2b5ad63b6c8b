import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np


def sqnr(ref, x) -> float:
    """Signal-to-quantisation-noise ratio in dB, computed in float64 (torchao's `compute_error`)."""
    ref = np.asarray(ref, np.float64)
    x = np.asarray(x, np.float64)
    return float(20 * np.log10(np.linalg.norm(ref) / np.linalg.norm(ref - x)))


def tree_allclose(a, b, **kw) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(np.allclose(np.asarray(x), np.asarray(y), **kw) for x, y in zip(la, lb))


In = hax.Axis("In", 16)
Mid = hax.Axis("Mid", 32)
Out = hax.Axis("Out", 8)
Batch = hax.Axis("Batch", 8)


class HaliaxMLP(eqx.Module):
    up_proj: hax.nn.Linear
    down_proj: hax.nn.Linear

    @staticmethod
    def init(In=In, Mid=Mid, Out=Out, *, key):
        k1, k2 = jax.random.split(key)
        return HaliaxMLP(hax.nn.Linear.init(In, Mid, key=k1), hax.nn.Linear.init(Mid, Out, key=k2))

    def __call__(self, x):
        return self.down_proj(hax.nn.relu(self.up_proj(x)))


Layers = hax.Axis("Layers", 3)


class Block(eqx.Module):
    """A residual MLP block, stacked by `Deep`."""

    mlp: HaliaxMLP

    @staticmethod
    def init(*, key):
        return Block(HaliaxMLP.init(In, Mid, In, key=key))

    def __call__(self, x):
        return x + self.mlp(x)


class Deep(eqx.Module):
    """`Layers` stacked `Block`s (`haliax.nn.Stacked`) and a linear head."""

    blocks: hax.nn.Stacked
    head: hax.nn.Linear

    @staticmethod
    def init(*, key, gradient_checkpointing=False):
        k1, k2 = jax.random.split(key)
        blocks = hax.nn.Stacked.init(Layers, Block, gradient_checkpointing=gradient_checkpointing)(
            key=jax.random.split(k1, Layers.size)
        )
        return Deep(blocks, hax.nn.Linear.init(In, Out, key=k2))

    def __call__(self, x):
        return self.head(self.blocks.fold(x))


def mse(model, x, y):
    return hax.mean((model(x) - y) ** 2).scalar()


def sgd_step(loss, lr=1e-2):
    """A jitted fp8ax train step with plain SGD (updates = -lr * grads)."""
    import fp8ax

    @eqx.filter_jit
    def step(model, *batch):
        grads = eqx.filter_grad(loss)(model, *batch)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -lr * g, grads)
        return fp8ax.apply_updates(model, updates, overwrite)

    return step


def f32(x):
    return jnp.asarray(x, jnp.float32)
