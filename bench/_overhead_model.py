"""bench/overhead.py's model, its train steps (one per variant) and their optimizer."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import optax

import fp8ax

# --------------------------------------------------------------------------------------
# Model and data


class Mlp(eqx.Module):
    """Embed -> Mlp -> Embed, two `haliax.nn.Linear` layers with a GELU between them."""

    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Hidden: hax.Axis, *, key) -> Mlp:
        k_up, k_down = jax.random.split(key)
        return Mlp(
            up=hnn.Linear.init(In=Embed, Out=Hidden, key=k_up),
            down=hnn.Linear.init(In=Hidden, Out=Embed, key=k_down),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(hnn.gelu(self.up(x)))


def loss_fn(model: Mlp, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.sgd(lr)
    if name == "adam":
        return optax.adam(lr)
    raise ValueError(f"unknown optimizer {name!r}")


# --------------------------------------------------------------------------------------
# Train steps, one per variant. Same structure; only the partition/apply helpers differ.


def make_step(variant: str, opt: optax.GradientTransformation) -> Callable:
    if variant == "haliax":
        partition, apply = haxq.partition_for_grad_overwrite, haxq.apply_updates
    else:
        # For `plain` there is no FP8 state: the partition returns an all-None
        # `overwrite` and `apply_updates` is `param + update`.
        partition, apply = fp8ax.partition_for_grad_overwrite, fp8ax.apply_updates

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        overwrite, grads = partition(grads)
        _, params = partition(model)
        updates, opt_state = opt.update(grads, opt_state, params=eqx.filter(params, eqx.is_inexact_array))
        model = apply(model, updates, overwrite)
        return model, opt_state

    return eqx.filter_jit(step)


def opt_params(model, variant: str):
    """What the optimizer state is built from: the arrays of `model` as the partition
    leaves them (fp8ax: the FP8 state as zeros; Haliax: removed)."""
    partition = haxq.partition_for_grad_overwrite if variant == "haliax" else fp8ax.partition_for_grad_overwrite
    _, params = partition(model)
    return eqx.filter(params, eqx.is_inexact_array)


def build_model(variant: str, base: Mlp, dtype, batch=None) -> Mlp:
    if variant == "plain":
        return fp8ax.cast_floating(base, dtype)
    if variant == "fp8ax":
        return fp8ax.cast_floating(fp8ax.fp8_linear_layers(base), dtype)
    if variant == "fp8ax-cal":
        # Histories filled by `fp8ax.calibrate` on one batch: the same one program as
        # `fp8ax`, whose first step then takes its scales from the histories.
        return fp8ax.calibrate(build_model("fp8ax", base, dtype), loss_fn, [batch])
    if variant == "haliax":
        # Cast first: Haliax's Fp8DotGeneralOp state must stay float32, and a blanket
        # cast of the quantized model would cast it too.
        cast = fp8ax.cast_floating(base, dtype)
        return haxq.quantize_linear_layers(cast, haxq.QuantizationConfig(fp8=True))
    raise ValueError(variant)


def count_fp8_layers(model) -> int:
    leaves = jax.tree_util.tree_leaves(
        model, is_leaf=lambda x: isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp)
    )
    return sum(isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp) for x in leaves)


def fp8_state_dtypes(model) -> list[str]:
    """dtypes of the FP8 state leaves (checks that the bf16 cast left them float32)."""
    out = set()
    for node in jax.tree_util.tree_leaves(
        model, is_leaf=lambda x: isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp)
    ):
        if isinstance(node, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp):
            out.update(str(a.dtype) for a in jax.tree_util.tree_leaves(node) if eqx.is_array(a))
    return sorted(out)
