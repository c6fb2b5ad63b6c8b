# Storing quantized values so that `eqx.tree_serialise_leaves` can save them.
#
# Storage. `eqx.tree_serialise_leaves` cannot save 8-bit float dtypes (numpy writes them
# as raw bytes that do not load back), so values are stored as their bit patterns:
# uint8 for FP8 (and E8M0 scales), one 4-bit code per uint8 for FP4, int8 as int8.
# Decoding is a bitcast (exact) inside the forward.

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

if TYPE_CHECKING:
    pass

from .. import _formats

_FP4 = np.dtype(jnp.float4_e2m1fn)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)


def storable(dtype: np.dtype, layer: str) -> None:
    if dtype == np.dtype(np.int8) or dtype in _formats.FP8_DTYPES or dtype in (_FP4, _E8M0):
        return
    raise ValueError(
        f"Layer `{layer}`: its weight is quantized to {dtype}, which `fp8ax.to_serving` cannot store (it stores "
        "FP8, E8M0, FP4 (e2m1) and int8). Exclude the layer from the FP8 conversion, or train it with another "
        "element type."
    )


def encode(values: Array) -> Array:
    """Low-precision values as an array `eqx.tree_serialise_leaves` can save: int8 as it
    is, 8-bit floats as their bits (uint8), FP4 packed two codes per byte along the last
    axis (element `2i` in the low nibble of byte `i`, the last byte half empty for an odd
    length)."""
    dtype = np.dtype(values.dtype)
    if dtype == np.dtype(np.int8):
        return values
    if dtype == _FP4:
        n = values.shape[-1]
        padded = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, n % 2)])
        # XLA bitcasts a pair of FP4 values into one byte, element 0 in the low nibble.
        return lax.bitcast_convert_type(padded.reshape(*values.shape[:-1], -1, 2), jnp.uint8)
    return lax.bitcast_convert_type(values, jnp.uint8)


def decode(stored: Array, dtype: np.dtype, length: int | None = None) -> Array:
    """Inverse of `encode` (bit-exact); `length` is the last axis's length before FP4
    values were packed."""
    dtype = np.dtype(dtype)
    if dtype == np.dtype(np.int8):
        return stored
    if dtype == _FP4:
        values = lax.bitcast_convert_type(stored, dtype)  # (..., m) bytes -> (..., m, 2) values
        values = values.reshape(*stored.shape[:-1], -1)
        return values if length is None else values[..., :length]
    return lax.bitcast_convert_type(stored, dtype)


def packed_length(values: Array) -> int | None:
    """The last axis's length of FP4 values (which `encode` packs), else None."""
    return int(values.shape[-1]) if np.dtype(values.dtype) == _FP4 else None
