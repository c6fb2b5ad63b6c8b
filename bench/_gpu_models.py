"""bench/gpu.py's functions under test: a linear layer's GEMM with each variant's
`dot_general`, and the MLP block with its train step (bench/gpu_aot.py and
bench/gpu_train.py build theirs from these too)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import optax
from jax import lax

import fp8ax

GEMM_DIMS = (((1,), (1,)), ((), ()))  # contract x's features with w's in features: x @ w.T


class PlainDotGeneral(eqx.Module):
    """``lax.dot_general`` as a module (the bf16 baseline)."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


class GemmLayer(eqx.Module):
    """A bias-free linear layer on plain arrays with a pluggable ``dot_general``."""

    weight: jax.Array  # (out features, in features)
    dot_general: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dot_general(x, self.weight, GEMM_DIMS)


def make_dot_general(variant: str):
    if variant == "bf16":
        return PlainDotGeneral()
    if variant == "fp8ax_direct":
        return fp8ax.Fp8DotGeneral.init(mode="direct")
    if variant == "fp8ax_qdq":
        return fp8ax.Fp8DotGeneral.init(mode="qdq")
    if variant == "haliax_fp8":
        return haxq.Fp8DotGeneralOp.init()
    raise ValueError(variant)


def gemm_function(layer: GemmLayer, pass_name: str):
    """A ``jax.jit`` function of (flat layer arrays, x, g) and its arguments' builder.

    The layer's arrays are passed as a flat list so that each call goes through JAX's C++
    dispatch path (no Python pytree flattening of the module per call).
    """
    dyn, static = eqx.partition(layer, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dyn)

    def rebuild(leaves):
        return eqx.combine(jax.tree.unflatten(treedef, leaves), static)

    if pass_name == "fwd":

        def fn(leaves, x, g):
            del g
            return rebuild(leaves)(x)

    else:

        def loss(layer_and_x, g):
            layer, x = layer_and_x
            return jnp.sum(layer(x) * g, dtype=jnp.float32)

        def fn(leaves, x, g):
            # Gradients for the layer and for x: forward, input-gradient and weight-gradient
            # GEMMs. The value keeps the forward GEMM alive (d loss / d y = g needs no y).
            return eqx.filter_value_and_grad(loss)((rebuild(leaves), x), g)

    return jax.jit(fn), leaves


def gemm_loss(layer: GemmLayer, x: jax.Array, g: jax.Array) -> jax.Array:
    return jnp.sum((layer(x) * g).astype(jnp.float32))


class MlpBlock(eqx.Module):
    """Embed -> Mlp -> Embed: two bias-free ``haliax.nn.Linear`` layers, GELU in between."""

    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Mlp: hax.Axis, *, key) -> MlpBlock:
        k_up, k_down = jax.random.split(key)
        return MlpBlock(
            up=hnn.Linear.init(In=Embed, Out=Mlp, key=k_up, use_bias=False),
            down=hnn.Linear.init(In=Mlp, Out=Embed, key=k_down, use_bias=False),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(hnn.gelu(self.up(x)))


def mlp_loss(model: MlpBlock, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def build_mlp(variant: str, base: MlpBlock, batch=None) -> MlpBlock:
    if variant == "bf16":
        return fp8ax.cast_floating(base, jnp.bfloat16)
    if variant in ("fp8ax_direct", "fp8ax_qdq"):
        config = fp8ax.Fp8Config(mode=variant.removeprefix("fp8ax_"))
        model = fp8ax.cast_floating(fp8ax.fp8_linear_layers(base, config), jnp.bfloat16)
        # Filled histories, no first-call conditional in the timed step (`fp8ax.calibrate`).
        return model if batch is None else fp8ax.calibrate(model, mlp_loss, [batch])
    if variant == "haliax_fp8":
        # Cast first, so that Haliax's FP8 state stays float32.
        return haxq.quantize_linear_layers(fp8ax.cast_floating(base, jnp.bfloat16), haxq.QuantizationConfig(fp8=True))
    raise ValueError(variant)


def _partition_fns(variant: str):
    if variant == "haliax_fp8":
        return haxq.partition_for_grad_overwrite, haxq.apply_updates
    return fp8ax.partition_for_grad_overwrite, fp8ax.apply_updates


def make_mlp_step(variant: str, opt: optax.GradientTransformation):
    partition, apply = _partition_fns(variant)

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(mlp_loss)(model, x, y)
        overwrite, grads = partition(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes float and int32 (bias correction)
            updates, opt_state = opt.update(grads, opt_state, params=opt_params(model, variant))
        return apply(model, updates, overwrite), opt_state

    return eqx.filter_jit(step)


def opt_params(model, variant: str):
    """What the optimizer sees: the model without its FP8 state."""
    partition, _ = _partition_fns(variant)
    _, params = partition(model)
    return eqx.filter(params, eqx.is_inexact_array)


def count_fp8_layers(model) -> int:
    kinds = fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp
    return sum(isinstance(n, kinds) for n in jax.tree_util.tree_leaves(model, is_leaf=lambda n: isinstance(n, kinds)))
