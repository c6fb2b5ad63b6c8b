import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

import fp8ax


def sqnr(ref, x) -> float:
    """Signal-to-quantization-noise ratio in dB, computed in float64 (torchao's `compute_error`)."""
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


def adam_trained(model, loss, steps, lr=1e-2):
    """`model` after `steps` Adam steps on `loss(model)`, the documented fp8ax step: the
    optimizer gets the gradients, `fp8ax.apply_updates` writes the FP8 state. The
    gradient is jitted (eagerly, an MX or blockwise step dispatches thousands of ops)."""
    import optax

    opt = optax.adam(lr)
    _, trainable = fp8ax.partition_for_grad_overwrite(model)
    grad = eqx.filter_jit(eqx.filter_grad(loss))
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(eqx.filter(trainable, eqx.is_array))
        for _ in range(steps):
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grad(model))
            updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
            model = fp8ax.apply_updates(model, updates, overwrite)
    return model


def f32(x):
    return jnp.asarray(x, jnp.float32)


# ------------------------------------------------------------------------------------
# Data flow of a traced training step (test_pipeline.py, test_calibrate.py)

_FP8 = {np.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)}


def _raises(eqn) -> bool:
    return any(e.primitive.name == "pure_callback" for b in eqn.params["branches"] for e in b.jaxpr.eqns)


class _Walk:
    """Evaluates a jaxpr equation by equation (so each `cond` takes the branch the data
    picks) and follows data flow: which values depend on a `reduce_max` of an `abs`, i.e.
    on some tensor's amax. Records, for every conversion to an FP8 dtype, whether its
    input depends on an amax."""

    def __init__(self):
        self.converts: list[bool] = []  # one per FP8 convert: depends on an amax?
        self.branches: list[int] = []  # the branch every executed `cond` took
        self.amaxes = 0

    def run(self, jaxpr, consts, args, deps, absv):
        env = {}

        def read(v):
            if isinstance(v, jex_core.Literal):
                return v.val, False, False
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = (c, False, False)
        for v, a, d, b in zip(jaxpr.invars, args, deps, absv):
            env[v] = (a, d, b)
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            vals = [i[0] for i in ins]
            deps_in = [i[1] for i in ins]
            abs_in = [i[2] for i in ins]
            name = eqn.primitive.name
            # A call's body is walked; `reduce` (a variadic reduction) also carries a
            # `jaxpr`, its reducer, but is an ordinary primitive here.
            sub = (
                None
                if name == "reduce"
                else next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "call") if k in eqn.params), None)
            )
            if name == "cond":
                index = int(vals[0])
                # Not `lax.platform_dependent`, nor an `eqx.error_if` check (a branch that
                # calls back to the host to raise).
                if eqn.params.get("branches_platforms") is None and not _raises(eqn):
                    self.branches.append(index)
                branch = eqn.params["branches"][index]
                outs = self.run(branch.jaxpr, branch.consts, vals[1:], deps_in[1:], abs_in[1:])
            elif isinstance(sub, jex_core.ClosedJaxpr):
                outs = self.run(sub.jaxpr, sub.consts, vals, deps_in, abs_in)
            else:
                assert name not in ("scan", "while"), "not needed by these tests; would need a loop rule"
                res = eqn.primitive.bind(*vals, **eqn.params)
                res = res if eqn.primitive.multiple_results else [res]
                dep = any(deps_in)
                # The tensor's amax: a max (with a min, in one variadic `reduce`) over |x|.
                if name in ("reduce_max", "reduce") and abs_in[0]:
                    dep = True
                    self.amaxes += 1
                if name == "convert_element_type" and np.dtype(eqn.params["new_dtype"]) in _FP8:
                    self.converts.append(dep)
                # abs, and what keeps its values: a cast, or a select that replaces some (NaN -> inf).
                is_abs = name == "abs" or (name in ("convert_element_type", "select_n") and any(abs_in))
                outs = [(r, dep, is_abs) for r in res]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(v) for v in jaxpr.outvars]


def train_step(model, x):
    def loss(m):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    grads = eqx.filter_grad(loss)(model)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates = jax.tree.map(lambda g: -0.01 * g, grads)
    return fp8ax.apply_updates(model, updates, overwrite)


def walk_train_step(model, x) -> _Walk:
    params, static = eqx.partition(model, eqx.is_array)

    def step(p, x):
        return eqx.filter(train_step(eqx.combine(p, static), x), eqx.is_array)

    closed = jax.make_jaxpr(step)(params, x)
    leaves = jax.tree.leaves((params, x))
    walk = _Walk()
    walk.run(closed.jaxpr, closed.consts, leaves, [False] * len(leaves), [False] * len(leaves))
    return walk


def without_fp8(tree):
    """The arrays of `tree` with None in place of each FP8 module: the parameters (or
    their gradients) alone, as `fp8ax.partition_for_grad_overwrite` gave them before it
    kept the FP8 modules as zeros."""
    is_fp8 = lambda x: isinstance(x, fp8ax.OverwriteWithGradient)  # noqa: E731
    return eqx.filter(jax.tree.map(lambda x: None if is_fp8(x) else x, tree, is_leaf=is_fp8), eqx.is_array)


def with_settings_of(template, model):
    """`model`'s arrays in `template`'s FP8 settings, as
    restoring a checkpoint of `model`'s arrays only (Orbax, of
    `eqx.filter(model, eqx.is_array)`) into the freshly converted `template` gives."""
    is_dg = lambda x: isinstance(x, fp8ax.Fp8DotGeneral)  # noqa: E731

    def take(t, m):
        return dataclasses.replace(m, settings=t.settings) if is_dg(m) else m

    return jax.tree.map(take, template, model, is_leaf=is_dg)
