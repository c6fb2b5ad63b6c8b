"""Unbiased stochastic rounding to FP8 and int8 (used for gradient quantization)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, PRNGKeyArray

from ._formats import FP8_DTYPES

_INT8 = np.dtype(jnp.int8)
_INT8_MAX = 127.0
_TWO_32 = 2.0**32


def _as_round_dtype(value) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or (dtype not in FP8_DTYPES and dtype != _INT8):
        names = ", ".join(f"jnp.{d.name}" for d in (*FP8_DTYPES, _INT8))
        raise TypeError(f"`dtype` must be one of {names}, got {value!r}.")
    return dtype


def _fp8_neighbours(a: Array, dtype: np.dtype) -> tuple[Array, Array]:
    """The representable magnitudes `lo <= a < hi` (or `lo == a`) for `0 <= a <= max`.

    For a non-negative value the FP8 bit pattern, read as an unsigned integer, is a
    monotonic index into the representable magnitudes (the sign is the top bit, and the
    largest finite value is the top of the range we ever step into). So the
    round-to-nearest-even cast gives one neighbour, and stepping its code by one gives
    the other: this handles subnormals and binade boundaries without computing ulps.
    """
    max_code = int(np.asarray(jnp.finfo(dtype).max, dtype).view(np.uint8))
    nearest = a.astype(dtype)
    code = lax.bitcast_convert_type(nearest, jnp.uint8)
    # The nearest value rounded up (away from zero): step one code back towards zero.
    # (nearest > a implies nearest > 0, so the code is at least 1.)
    lo_code = code - (nearest.astype(jnp.float32) > a).astype(jnp.uint8)
    # Never step past the largest finite value (into inf/NaN codes): lo == max only when
    # a == max, which is exact and never rounds up.
    hi_code = jnp.minimum(lo_code + jnp.uint8(1), jnp.uint8(max_code))
    lo = lax.bitcast_convert_type(lo_code, dtype).astype(jnp.float32)
    hi = lax.bitcast_convert_type(hi_code, dtype).astype(jnp.float32)
    return lo, hi


def stochastic_round(x: ArrayLike, dtype, key: PRNGKeyArray) -> Array:
    """Rounds `x` stochastically to `dtype`, so that the result is unbiased.

    **Arguments:**

    - `x`: floating-point values, already scaled into `dtype`'s range. They are computed
        in float32 (bfloat16 and float16 convert exactly).
    - `dtype`: one of `jnp.float8_e4m3fn`, `jnp.float8_e5m2`, `jnp.float8_e4m3fnuz`,
        `jnp.float8_e5m2fnuz` or `jnp.int8`. For `jnp.int8` the values are rounded to
        integers in `[-127, 127]` (the symmetric range; -128 is never produced).
    - `key`: a `jax.random` key. The same key gives the same rounding; one uniform draw
        is used per element.

    **Returns:**

    An array of `dtype` with `x`'s shape. A finite element `x` between its two
    neighbouring representable values `lo <= |x| <= hi` (`lo` rounded towards zero, `hi`
    the next value away from zero) becomes `hi` with probability
    `(|x| - lo) / (hi - lo)` and `lo` otherwise (with `x`'s sign), so that
    `E[result] == x`. Representable values are returned exactly. Finite magnitudes beyond
    the format's maximum saturate to `+-max` (never inf). NaN stays NaN and `+-inf`
    stays non-finite: the format's inf (E5M2) or NaN (the formats without inf). (The
    recipes' quantization turns every non-finite value into NaN before it rounds.)
    `jnp.int8` has no NaN or inf: there `+-inf` saturates to `+-127` and NaN becomes 0.

    **Method:**

    `lo` and `hi` are found exactly: `lo` is the nearest-even cast stepped one code
    towards zero when the cast rounded up; `hi` is one code above `lo` (for int8,
    `floor(|x|)` and `floor(|x|) + 1`). `d = |x| - lo` and `hi - lo` (a power of two)
    are exact in float32, so the probability `p = d / (hi - lo)` is an exact float32.
    The rounding goes up iff `r < ceil(p * 2**32)` for 32 uniform random bits `r`
    (`jax.random.bits`), i.e. with probability `ceil(p * 2**32) / 2**32`. This is
    exactly `p` whenever `p` has at most 32 fractional bits, which holds for every `|x|`
    at least `2**-9` times the smallest positive value of the format (for larger values
    `p` has at most 23 fractional bits); smaller values round up with a probability
    that is too large by less than `2**-32`, i.e. an absolute bias below
    `2**-32 * smallest_subnormal`. (A float32 `jax.random.uniform` would quantize the
    probability to `2**-23`; the integer comparison avoids that.) Note that XLA may
    flush float32 subnormal inputs (`|x| < 2**-126`) to zero.
    """
    dtype = _as_round_dtype(dtype)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating-point array, got dtype {x.dtype}.")
    xf = x.astype(jnp.float32)
    if dtype == _INT8:
        bound = _INT8_MAX
    else:
        bound = float(jnp.finfo(dtype).max)

    # Magnitudes, saturated (NaN propagates through `minimum`; handled at the end).
    a = jnp.minimum(jnp.abs(xf), jnp.float32(bound))
    if dtype == _INT8:
        lo = jnp.floor(a)
        hi = jnp.minimum(lo + jnp.float32(1), jnp.float32(bound))
    else:
        lo, hi = _fp8_neighbours(a, dtype)

    d = a - lo  # exact (Sterbenz: lo <= a < hi <= 2 * lo, or lo == 0)
    exact = d == 0
    # 2**32 / ulp is an exact power of two; guard the division for exact values, where
    # hi may equal lo (at max).
    ulp = jnp.where(exact, jnp.float32(1), hi - lo)
    threshold = jnp.ceil(d * (jnp.float32(_TWO_32) / ulp))
    threshold = jnp.where(exact | jnp.isnan(a), jnp.float32(0), threshold).astype(jnp.uint32)
    bits = jax.random.bits(key, xf.shape, jnp.uint32)
    magnitude = jnp.where(bits < threshold, hi, lo)
    rounded = jnp.copysign(magnitude, xf)

    if dtype == _INT8:
        # No NaN in int8: NaN -> 0 (inf already saturated through `minimum`).
        rounded = jnp.where(jnp.isnan(xf), jnp.float32(0), rounded)
    else:
        rounded = jnp.where(jnp.isfinite(xf), rounded, xf)
    return rounded.astype(dtype)


_E2M1 = np.dtype(jnp.float4_e2m1fn)
# The magnitudes E2M1 represents, in order.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def stochastic_round_e2m1(y: Array, key) -> Array:
    """`y` (float32, within [-6, 6]) rounded stochastically to E2M1: up to the next
    representable magnitude with probability (|y| - lo) / (hi - lo), else down to lo, so
    that the mean over keys is `y`. (E2M1 has no NaN: the block scale carries it.)"""
    grid = jnp.asarray(E2M1_GRID, jnp.float32)
    a = jnp.abs(y)
    i = jnp.clip(jnp.searchsorted(grid, a, side="right") - 1, 0, len(E2M1_GRID) - 1)
    lo = grid[i]
    hi = grid[jnp.minimum(i + 1, len(E2M1_GRID) - 1)]
    step = jnp.where(hi > lo, hi - lo, jnp.float32(1))
    up = jax.random.uniform(key, y.shape, jnp.float32) < (a - lo) / step
    r = jnp.where(up, hi, lo)
    return jnp.copysign(r, y).astype(_E2M1)


def content_key(seed: int, x) -> jax.Array:
    """A PRNG key that changes with the tensor's contents: `seed` folded with a 32-bit
    hash of `x`'s bits. Reproducible given `seed` and `x`; a different tensor (the next
    step's gradient) gets a different key."""
    bits = lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    h = jnp.sum(jnp.ravel(bits) * weights, dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(seed), h)
