# `Fp8Linear`: an `equinox.nn.Linear` whose matmul is an `Fp8DotGeneral`.

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

if TYPE_CHECKING:
    pass

from .config import Fp8Config
from .dot_general import Fp8DotGeneral


class Fp8Linear(eqx.Module):
    """`equinox.nn.Linear` with its matmul done by an [`fp8ax.Fp8DotGeneral`][].

    Keeps `weight` and `bias` under the same names and in the same layout as
    `equinox.nn.Linear` (`weight` is `(out_features, in_features)`), so the parameters
    and their paths do not change when a model is converted. Built by
    [`fp8ax.fp8_linear_layers`][]; use `Fp8Linear.from_linear` to build one by hand.
    """

    weight: Array
    bias: Array | None
    dot_general: Fp8DotGeneral
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, config: Fp8Config | None = None) -> Fp8Linear:
        """Wraps an `equinox.nn.Linear` (its arrays are shared, not copied).

        **Arguments:**

        - `linear`: the layer to convert. If its `weight` has leading dimensions (an
          ensemble built with `eqx.filter_vmap`), each member gets its own FP8 state.
        - `config`: an [`fp8ax.Fp8Config`][]; default `Fp8Config()`.
        """
        if not isinstance(linear, eqx.nn.Linear):
            raise TypeError(f"`linear` must be an `equinox.nn.Linear`, got {type(linear).__name__}.")
        config = Fp8Config() if config is None else config
        batch_shape = tuple(linear.weight.shape[:-2])
        return cls(
            weight=linear.weight,
            bias=linear.bias,
            dot_general=config.make_dot_general(batch_shape),
            in_features=linear.in_features,
            out_features=linear.out_features,
            use_bias=linear.use_bias,
        )

    @jax.named_scope("fp8ax.Fp8Linear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, shape `(in_features,)` (or `()` if `in_features="scalar"`).
          Unlike `equinox.nn.Linear`, leading batch dimensions are allowed too:
          `(..., in_features)` runs one batched FP8 GEMM instead of one per example.
        - `key`: ignored; there for compatibility with the rest of Equinox. (Keyword only
          argument.)

        **Returns:**

        The output, shape `(out_features,)` (or `()` if `out_features="scalar"`), with
        the same leading dimensions as `x`.
        """
        del key
        return linear_call(self, x, self.weight)

    def to_linear(self) -> eqx.nn.Linear:
        """The plain `equinox.nn.Linear` with the same weight and bias."""
        linear = object.__new__(eqx.nn.Linear)
        for f in dataclasses.fields(eqx.nn.Linear):
            if hasattr(self, f.name):
                object.__setattr__(linear, f.name, getattr(self, f.name))
        return linear


def linear_call(layer, x, weight) -> Array:
    """`layer.dot_general(x, weight)` over the last axis of `x`, plus `layer.bias`: the
    call of an `equinox.nn.Linear`-shaped layer ([`fp8ax.Fp8Linear`][] and
    [`fp8ax.ServingLinear`][]), with its checks on `x` and its `"scalar"` features."""
    if layer.in_features == "scalar":
        if jnp.shape(x) != ():
            raise ValueError(f"`x` must be a scalar for in_features='scalar', got shape {jnp.shape(x)}.")
        x = jnp.broadcast_to(x, (1,))
    elif jnp.ndim(x) < 1 or jnp.shape(x)[-1] != layer.in_features:
        raise ValueError(f"`x` must have shape (..., {layer.in_features}), got {jnp.shape(x)}.")
    x = jnp.asarray(x)
    y = layer.dot_general(x, weight, (((x.ndim - 1,), (1,)), ((), ())))
    if layer.bias is not None:
        with jax.numpy_dtype_promotion("standard"):
            y = y + jnp.broadcast_to(layer.bias, y.shape)
    if layer.out_features == "scalar":
        y = y[..., 0]
    return y
