"""AQT-style symmetric int8 quantization (the GEMM is `_gemm.kernels`'s, with int32 accumulation)."""

import operator

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from . import _formats

INT8_MAX = 127

# Slices whose amax is below this are treated as all-zero: 127 / amax would overflow
# float32 (and amax / 127 would be subnormal, which XLA may flush to zero).
_TINY_AMAX = INT8_MAX * float(np.finfo(np.float32).tiny)


def _normalize_axes(axes, ndim: int, argname: str) -> tuple[int, ...]:
    """`axes` as non-negative ints, checked against `ndim` (errors name `argname`)."""
    try:
        axes = tuple(operator.index(a) for a in axes)
    except TypeError:
        raise TypeError(f"`{argname}` must be a tuple of ints, got {axes!r}.") from None
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"`{argname}` has axis {a}, out of range for an array of rank {ndim}.")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"`{argname}` has repeated axes: {axes!r}.")
    return tuple(out)


def int8_quantize(x: ArrayLike, contracting_axes: tuple[int, ...]) -> tuple[Array, Array]:
    """Symmetric per-slice int8 quantization, as AQT's simplest int8 configuration.

    **Arguments:**

    - `x`: a floating-point array, computed in float32.
    - `contracting_axes`: the axes the matmul will contract over (negative axes count
        from the end). One scale is computed per slice over the remaining axes, so that
        it factors out of the contraction (e.g. `(1,)` for the rows of activations
        `a @ w`, `(0,)` for the columns of the weights).

    **Returns:**

    `(values, scale)`: `values` is int8 with `x`'s shape, in `[-127, 127]`; `scale` is
    float32 with `x`'s rank and size 1 along `contracting_axes` (keepdims), the
    *dequantization* scale, so that `values * scale ~ x`.

    With `amax = max |x|` over `contracting_axes`, `scale = amax * float32(1 / 127)`
    (rounded once, at least the smallest normal float32) and
    `values = clip(round_half_to_even(x * (127 / amax)), -127, 127)`. Quantizing by
    multiplying with `127 / amax` (not dividing by `scale`) is what AQT does: the
    integer values are bit-for-bit AQT's (the two can differ by one at rounding ties).
    A slice whose amax is zero (or below `127 * float32 tiny`, ~1.5e-36) gets
    `scale = 1` and values 0. int8 has no NaN or inf: a slice containing one gets values
    0 and an infinite scale, so it dequantizes (and its GEMM rows come out) as NaN.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating-point array, got dtype {x.dtype}.")
    axes = _normalize_axes(contracting_axes, x.ndim, "contracting_axes")
    xf = x.astype(jnp.float32)
    amax = _formats.amax(xf, axes, keepdims=True)  # inf where a NaN or inf is reduced
    nonzero = amax >= jnp.float32(_TINY_AMAX)
    safe_amax = jnp.where(nonzero, amax, jnp.float32(INT8_MAX))
    inv_scale = jnp.float32(INT8_MAX) / safe_amax  # 1 for all-zero slices
    # `amax * float32(1 / 127)`, one rounding: what XLA computes for `amax / 127` in a
    # jitted program (it rewrites a division by a constant into a multiplication by its
    # reciprocal), written out so that eager and jitted calls agree bit for bit.
    scale = jnp.where(nonzero, _formats.scale_from_amax(amax, np.float32(1 / INT8_MAX)), jnp.float32(1))
    values = jnp.clip(jnp.round(xf * inv_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scale
