# The one quantized value of fp8ax: low-precision values and a scale of the operand's rank
# (or a scalar), laid out by tiles. Everything a GEMM, serving, stats or a test needs to
# know about the layout is derived here from the shapes and the tile, so a new recipe
# adds no layout of its own.

import dataclasses
import math
import operator
from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from ._mx import e8m0_ldexp

ScaleLayout = Literal["tensor", "row", "block"]

_E8M0 = np.dtype(jnp.float8_e8m0fnu)


def _check_tile(tile, values_shape) -> tuple[int, ...] | None:
    if tile is None:
        return None
    try:
        tile = tuple(operator.index(t) for t in tile)
    except TypeError:
        raise TypeError(f"`tile` must be None or a tuple of ints, got {tile!r}.") from None
    if len(tile) != len(values_shape) or any(t < 1 for t in tile):
        raise ValueError(f"`tile` must give one extent >= 1 per axis of `values` {tuple(values_shape)}, got {tile}.")
    return tile


def expand_tiles(scale: Array, tile: tuple[int, ...], shape: tuple[int, ...], axes=None) -> Array:
    """`scale` (one entry per tile of `tile` elements of an array of `shape`) with each
    entry repeated over its tile along `axes` (all by default)."""
    for d in range(scale.ndim) if axes is None else axes:
        if scale.shape[d] != 1 and tile[d] != 1:
            scale = lax.slice_in_dim(jnp.repeat(scale, tile[d], axis=d), 0, shape[d], axis=d)
    return scale


class QuantizedArray(eqx.Module):
    """A low-precision array and its scale(s): `x ≈ values * scale`, the scale expanded
    over tiles.

    - `values`: the quantized values (FP8, FP6, FP4 or int8).
    - `scale`: the dequantization scale: a scalar (one per tensor), or an array of
      `values`' rank. Without a `tile`, it broadcasts against `values` (size 1 or the
      full size along each axis: tensor-wise and row-wise scales). With a `tile`, entry
      `i` along axis `d` covers elements `i * tile[d]` to `(i + 1) * tile[d]` (the last
      tile may be partial), so `scale.shape[d] == ceil(values.shape[d] / tile[d])`.
      float32, or `float8_e8m0fnu` (a power of two, as in MX formats).
    - `tile`: extent of one scale's tile along each axis, or None. (Static.)
    - `int_exponent`: an implicit power of two of the values (MXINT8's `2**-6`).
      (Static.)
    - `outer_scale`: a second, per-tensor float32 scale multiplying `scale` (two-level
      scaling, as NVFP4: E4M3 block scales times one float32 scale), or None. A scalar,
      so it always factors out of a GEMM.

    Whether the scale factors out of a GEMM, and how a GEMM that cannot factor it out
    splits its contraction, is derived from `scale` and `tile`
    ([`fp8ax.QuantizedArray.constant_along`][]); nothing else describes the layout.

    Build one with [`fp8ax.quantize`][]; get the high-precision array back with
    `.dequantize(dtype)`.
    """

    values: Array
    scale: Array
    tile: tuple[int, ...] | None = eqx.field(static=True)
    int_exponent: int = eqx.field(static=True)
    outer_scale: Array | None

    def __init__(
        self, values, scale, tile=None, int_exponent: int = 0, *, block_axis=None, block_size=None, outer_scale=None
    ):
        """**Arguments:**

        - `values`, `scale`, `tile`, `int_exponent`, `outer_scale`: as above
          (`outer_scale` keyword only).
        - `block_axis`, `block_size`: MX's one-axis blocks, an older spelling of `tile`
          (`block_size` along `block_axis`, 1 elsewhere). (Keyword only arguments.)
        """
        if block_axis is not None or block_size is not None:
            if tile is not None or block_axis is None or block_size is None:
                raise ValueError("Give either `tile`, or both `block_axis` and `block_size`.")
            ndim = np.ndim(values)
            tile = tuple(int(block_size) if d == block_axis % ndim else 1 for d in range(ndim))
        self.values = values
        self.scale = scale
        self.tile = _check_tile(tile, np.shape(values))
        self.int_exponent = int(int_exponent)
        self.outer_scale = outer_scale

    def __check_init__(self):
        if self.outer_scale is not None and (
            np.ndim(self.outer_scale) != 0 or np.dtype(self.outer_scale.dtype) != np.dtype(np.float32)
        ):
            raise ValueError(
                f"`outer_scale` must be None or a float32 scalar, got {getattr(self.outer_scale, 'dtype', None)} "
                f"of shape {np.shape(self.outer_scale)}."
            )
        if self.tile is not None:
            want = tuple(-(-n // t) for n, t in zip(self.values.shape, self.tile))
            if tuple(self.scale.shape) != want:
                raise ValueError(
                    f"`scale` must have shape {want} for `values` of shape {tuple(self.values.shape)} in tiles of "
                    f"{self.tile}, got {tuple(self.scale.shape)}."
                )
        elif self.scale.ndim not in (0, self.values.ndim):
            raise ValueError(
                f"`scale` must be a scalar or have the rank of `values` {tuple(self.values.shape)}, got shape "
                f"{tuple(self.scale.shape)}."
            )

    # ---------------------------------------------------------------- layout, derived

    def tile_extent(self, axis: int) -> int:
        """How many consecutive elements along `axis` share one scale (the whole axis
        where the scale is constant along it)."""
        if self.scale.ndim == 0 or self.scale.shape[axis] == 1:
            return self.values.shape[axis]
        return 1 if self.tile is None else self.tile[axis]

    def constant_along(self, axes) -> bool:
        """Whether the scale is constant along every axis in `axes`, so that a GEMM
        contracting them can run on `values` and multiply its result by the scales."""
        return self.scale.ndim == 0 or all(self.scale.shape[a] == 1 for a in axes)

    @property
    def layout(self) -> ScaleLayout:
        """`"tensor"` (one scale), `"row"` (no tile: one scale per slice, kept as size-1
        dims) or `"block"` (scales per tile)."""
        if self.scale.ndim == 0 or math.prod(self.scale.shape) == 1:
            return "tensor"
        return "row" if self.tile is None else "block"

    @property
    def block_axis(self) -> int | None:
        """The axis of one-axis blocks (MX), or None."""
        tiled = self._tiled_axes()
        return tiled[0] if len(tiled) == 1 else None

    @property
    def block_size(self) -> int | None:
        """The block size of one-axis blocks (MX), or None."""
        axis, tile = self.block_axis, self.tile  # (a block axis is one of `tile`'s)
        return None if axis is None or tile is None else tile[axis]

    def _tiled_axes(self) -> tuple[int, ...]:
        if self.tile is None:
            return ()
        return tuple(d for d, t in enumerate(self.tile) if t > 1 or self.scale.shape[d] != self.values.shape[d])

    # ---------------------------------------------------------------- numerics

    def expanded_scale(self, axes=None) -> Array:
        """The scale with its tiles repeated to their elements along `axes` (all axes by
        default), so that it broadcasts against `values` along them. Size-1 and scalar
        scales are left as they are."""
        if self.tile is None:
            return self.scale
        return expand_tiles(self.scale, self.tile, self.values.shape, axes)

    def dequantize(self, dtype=jnp.float32, *, outer: bool = True) -> Array:
        """`values * scale` (times `outer_scale`, if any and `outer`) in `dtype`,
        computed in float32 (exactly, bit by bit, for power-of-two `float8_e8m0fnu`
        scales, and without the outer scale for E4M3 scales of FP4 values)."""
        if outer and self.outer_scale is not None:
            inner = self.dequantize(jnp.float32, outer=False)
            return (inner * self.outer_scale).astype(dtype)
        scale = self.expanded_scale()
        if np.dtype(scale.dtype) == _E8M0:
            out = e8m0_ldexp(self.values, scale, self.int_exponent)
        else:
            out = self.values.astype(jnp.float32) * scale.astype(jnp.float32)
            if self.int_exponent:
                out = out * jnp.float32(2.0**self.int_exponent)
        return out.astype(dtype)

    def with_values(self, values: Array) -> "QuantizedArray":
        """The same scales and layout over other `values` of the same shape."""
        return dataclasses.replace(self, values=values)
