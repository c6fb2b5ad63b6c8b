"""AQT-style symmetric int8 quantisation and int8 x int8 -> int32 dot_general."""

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from . import _formats
from ._layout import DimensionNumbers, normalise_axes as _normalise_axes, rescale

INT8_MAX = 127

# Slices whose amax is below this are treated as all-zero: 127 / amax would overflow
# float32 (and amax / 127 would be subnormal, which XLA may flush to zero).
_TINY_AMAX = INT8_MAX * float(np.finfo(np.float32).tiny)


def int8_quantize(x: ArrayLike, contracting_axes: tuple[int, ...]) -> tuple[Array, Array]:
    """Symmetric per-slice int8 quantisation, as AQT's simplest int8 configuration.

    **Arguments:**

    - `x`: a floating-point array, computed in float32.
    - `contracting_axes`: the axes the matmul will contract over (negative axes count
        from the end). One scale is computed per slice over the remaining axes, so that
        it factors out of the contraction (e.g. `(1,)` for the rows of activations
        `a @ w`, `(0,)` for the columns of the weights).

    **Returns:**

    `(values, scale)`: `values` is int8 with `x`'s shape, in `[-127, 127]`; `scale` is
    float32 with `x`'s rank and size 1 along `contracting_axes` (keepdims), the
    *dequantisation* scale, so that `values * scale ~ x`.

    With `amax = max |x|` over `contracting_axes`, `scale = amax * float32(1 / 127)`
    (rounded once, at least the smallest normal float32) and
    `values = clip(round_half_to_even(x * (127 / amax)), -127, 127)`. Quantising by
    multiplying with `127 / amax` (not dividing by `scale`) is what AQT does: the
    integer values are bit-for-bit AQT's (the two can differ by one at rounding ties).
    A slice whose amax is zero (or below `127 * float32 tiny`, ~1.5e-36) gets
    `scale = 1` and values 0. int8 has no NaN or inf: a slice containing one gets values
    0 and an infinite scale, so it dequantises (and its GEMM rows come out) as NaN.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating-point array, got dtype {x.dtype}.")
    axes = _normalise_axes(contracting_axes, x.ndim, "contracting_axes")
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


def int8_dot_general(
    lhs_q: ArrayLike,
    lhs_scale: ArrayLike,
    rhs_q: ArrayLike,
    rhs_scale: ArrayLike,
    dimension_numbers: DimensionNumbers,
    out_dtype,
) -> Array:
    """`lax.dot_general` of int8-quantised operands, accumulated in int32, then rescaled.

    **Arguments:**

    - `lhs_q`, `rhs_q`: int8 operands (from [`int8_quantize`][]).
    - `lhs_scale`, `rhs_scale`: their float32 dequantisation scales, with the operands'
        rank and size 1 along the contracting dimensions (size 1 or full elsewhere), as
        returned by `int8_quantize` with those contracting axes.
    - `dimension_numbers`: as for `lax.dot_general`:
        `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`.
    - `out_dtype`: the dtype of the result.

    **Returns:**

    `float32(dot_general(lhs_q, rhs_q, preferred_element_type=int32)) * lhs_s * rhs_s`,
    cast to `out_dtype`, where `lhs_s * rhs_s` is the outer product of the two scales
    laid out as dot_general's output: batch dims, then lhs free dims, then rhs free
    dims. The integer accumulation is exact (for contractions shorter than
    `2**31 / 127**2 ~ 133,000` elements); the result is rounded once when converted to
    float32 and twice more by the two scale multiplications.
    """
    lhs_q = jnp.asarray(lhs_q)
    rhs_q = jnp.asarray(rhs_q)
    for name, q in (("lhs_q", lhs_q), ("rhs_q", rhs_q)):
        if q.dtype != jnp.int8:
            raise TypeError(f"`{name}` must be an int8 array, got dtype {q.dtype}.")
    try:
        (lc, rc), (lb, rb) = dimension_numbers
    except (TypeError, ValueError):
        raise TypeError(
            "`dimension_numbers` must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}."
        ) from None
    lc = _normalise_axes(lc, lhs_q.ndim, "dimension_numbers")
    rc = _normalise_axes(rc, rhs_q.ndim, "dimension_numbers")
    lb = _normalise_axes(lb, lhs_q.ndim, "dimension_numbers")
    rb = _normalise_axes(rb, rhs_q.ndim, "dimension_numbers")
    dims = ((lc, rc), (lb, rb))
    acc = lax.dot_general(lhs_q, rhs_q, dims, preferred_element_type=jnp.int32)
    return rescale(acc, lhs_scale, lhs_q.shape, rhs_scale, rhs_q.shape, dims).astype(out_dtype)
