from typing import Literal

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array

from ._mx import mx_dequantize

ScaleLayout = Literal["tensor", "row", "block"]


class QuantizedArray(eqx.Module):
    """A low-precision array and its scale(s): `x ≈ values * scale`.

    - `values`: the quantised values (FP8, FP6, FP4 or int8).
    - `scale`: the dequantisation scale. float32 and broadcastable against `values` for
      tensor-wise (shape `()`) and row-wise (size 1 along the scaled-over axes) scales;
      `float8_e8m0fnu`, one per block of `block_size` elements along `block_axis`, for
      MX formats.
    - `block_axis`, `block_size`: set for MX formats only.

    Build one with [`fp8ax.quantize`][]; get the high-precision array back with
    `.dequantize(dtype)`.
    """

    values: Array
    scale: Array
    block_axis: int | None = eqx.field(static=True, default=None)
    block_size: int | None = eqx.field(static=True, default=None)
    int_exponent: int = eqx.field(static=True, default=0)  # MXINT8's implicit 2**-6

    def dequantize(self, dtype=jnp.float32) -> Array:
        """`values * scale` in `dtype` (computed in float32)."""
        if self.block_axis is None:
            return (self.values.astype(jnp.float32) * self.scale).astype(dtype)
        return mx_dequantize(self.values, self.scale, self.block_axis, self.block_size, dtype)

    @property
    def layout(self) -> ScaleLayout:
        """How the scale is laid out: `"tensor"` (one scale, shape `()`), `"row"` (one
        per slice over the contracted axes, kept as size-1 dims) or `"block"` (MX: one
        per block along `block_axis`)."""
        if self.block_axis is not None:
            return "block"
        return "tensor" if jnp.ndim(self.scale) == 0 else "row"

    @property
    def scale_factorises(self) -> bool:
        """Whether the scale is constant along every contracted axis (tensor and row
        layouts), so a GEMM can run on `values` and multiply its result by the scales."""
        return self.block_axis is None
