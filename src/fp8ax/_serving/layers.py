# The serving layers: what `to_serving` makes of each FP8 layer.

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

if TYPE_CHECKING:
    import haliax as hax

from .. import _haliax
from .._model import (
    linear_call,
    moe_call,
    serving_kind_of,
)
from .codec import decode
from .ops import ServingDotGeneral, ServingRaggedDot


class ServingLinear(eqx.Module):
    """The serving form of an [`fp8ax.Fp8Linear`][] (an `equinox.nn.Linear` trained in
    FP8): the weight is stored quantized, as `weight` (encoded: uint8 bits for FP8, int8
    for int8) and the scale in `dot_general`.

    Built by [`fp8ax.to_serving`][]. Called like `equinox.nn.Linear` (leading batch
    dimensions allowed, as for [`fp8ax.Fp8Linear`][]); returns what the training layer
    returned, bit for bit.
    """

    weight: Array
    bias: Array | None
    dot_general: ServingDotGeneral
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingLinear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, shape `(..., in_features)` (or `()` if `in_features="scalar"`).
        - `key`: ignored. (Keyword only argument.)

        **Returns:**

        The output, shape `(..., out_features)` (or `(...)` if `out_features="scalar"`).
        """
        del key
        dg = self.dot_general
        return linear_call(self, x, decode(self.weight, dg.value_dtype, dg.packed_length))


class ServingHaliaxLinear(eqx.Module):
    """The serving form of a `haliax.nn.Linear` trained in FP8: `weight` is a
    `NamedArray` with the original weight's axes holding the quantized values (encoded:
    uint8 bits for FP8, int8 for int8), the scale is in `dot_general`.

    Built by [`fp8ax.to_serving`][]. Called like `haliax.nn.Linear`; returns what the
    training layer returned, bit for bit. Inside `haliax.nn.Stacked` the stacked axis
    stays the leading axis of every array, as for the training layer's state.
    """

    weight: hax.NamedArray
    bias: hax.NamedArray | None
    dot_general: ServingDotGeneral
    In: Any = eqx.field(static=True)
    Out: Any = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingHaliaxLinear")
    def __call__(self, inputs: hax.NamedArray, *, key: PRNGKeyArray | None = None) -> hax.NamedArray:
        """**Arguments:**

        - `inputs`: a `NamedArray` with the layer's `In` axes.
        - `key`: ignored. (Keyword only argument.)

        **Returns:**

        A `NamedArray` with the `In` axes replaced by `Out`.
        """
        del key
        _haliax.require_haliax_matmul("fp8ax.ServingHaliaxLinear")
        hax = _haliax.hax()
        dg = self.dot_general
        axes = self.weight.axes
        if dg.packed_length is not None:  # FP4 values, packed along the last axis
            axes = axes[:-1] + (axes[-1].resize(dg.packed_length),)
        w = hax.NamedArray(decode(self.weight.array, dg.value_dtype, dg.packed_length), axes)
        # `haliax.nn.Linear` lets `hax.dot` pick the result dtype from the two operands;
        # the training weight's dtype stands in for the stored values'.
        preferred = jnp.result_type(inputs.array, self.dot_general.weight_dtype)
        q = hax.dot(inputs, w, axis=self.In, preferred_element_type=preferred, dot_general=self.dot_general)
        q = hax.auto_sharded(q)
        if self.bias is not None:
            q = q + self.bias
            q = hax.auto_sharded(q)
        return q


class ServingMoELinear(eqx.Module):
    """The serving form of a `haliax.nn.MoELinear` trained in FP8 ([`fp8ax.Fp8MoELinear`][]):
    `weight` holds the quantized expert weights (encoded as for
    [`fp8ax.ServingHaliaxLinear`][]), laid out `(..., Experts, In, Out)`; the scales are in
    `ragged`. Called like `haliax.nn.MoELinear`; returns what the training layer
    returned, bit for bit. Built by [`fp8ax.to_serving`][]."""

    weight: hax.NamedArray
    bias: hax.NamedArray | None
    ragged: ServingRaggedDot
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingMoELinear")
    def __call__(
        self, inputs: hax.NamedArray, group_sizes: hax.NamedArray, *, key: PRNGKeyArray | None = None
    ) -> hax.NamedArray:
        """**Arguments:** as for [`fp8ax.Fp8MoELinear`][]."""
        del key
        rg = self.ragged
        values = decode(self.weight.array, rg.value_dtype, rg.packed_length)
        return moe_call(self, inputs, group_sizes, lambda x, sizes: rg(x, values, sizes))


def is_serving_layer(x) -> bool:
    """A serving layer: what `to_serving` makes of an FP8 layer (of any registered kind)."""
    return serving_kind_of(x) is not None
