"""Tiles: the extents of a scaling tile along a tensor's axes, and the amax of every tile
(blockwise FP8 and NVFP4 scale per tile)."""

import jax.numpy as jnp
from jaxtyping import Array

from . import _formats


def run_tiles(shape: tuple[int, ...], axes, length: int) -> dict[int, int]:
    """Tile extents along `axes` such that one tile is `length` consecutive elements of
    those axes flattened in order (the last axis varies fastest): the last axis gets
    `min(length, size)`, and a shorter last axis lets the tile run on into the axis
    before it, while the length left divides evenly."""
    out, left = {}, length
    for d in sorted(axes, reverse=True):
        n = shape[d]
        if left <= 1:
            out[d] = 1
        elif n >= left:
            out[d], left = left, 1
        else:
            out[d] = n
            left = left // n if left % n == 0 else 1
    return out


def tiled_amax(x: Array, tile: tuple[int, ...]) -> Array:
    """max |x| of every tile (zero-padded at the ends), NaN-aware as `_formats.amax`:
    shape `ceil(x.shape / tile)`."""
    counts = [-(-n // t) for n, t in zip(x.shape, tile)]
    pad = [(0, k * t - n) for n, t, k in zip(x.shape, tile, counts)]
    if any(hi for _, hi in pad):
        x = jnp.pad(x, pad)
    split = [s for k, t in zip(counts, tile) for s in (k, t)]
    return _formats.amax(x.reshape(split), tuple(range(1, 2 * x.ndim, 2)))
