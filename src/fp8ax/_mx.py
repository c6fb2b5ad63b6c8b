"""OCP Microscaling (MX v1.0) block quantization.

A tensor is cut into blocks of `block_size` consecutive elements along one axis. Each
block shares one power-of-two scale `X = 2**e`, stored as E8M0 (an 8-bit biased exponent,
`0xFF` meaning NaN), and each element is stored as `x / X` rounded to a narrow element
type: FP8 (E4M3, E5M2), FP6 (E2M3, E3M2), FP4 (E2M1) or INT8.

Everything here is computed with integer operations on the float32 bit patterns, so the
results are exact (bit for bit) whatever the backend's denormal mode: XLA on CPU flushes
float32 subnormals to zero in floating-point arithmetic (`jnp.frexp` and `jnp.max` too),
which would otherwise change the scale of blocks whose amax is below 2**-126.
"""

from typing import Literal

import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

# The element types of the MX spec and the dtype each one stands for.
MX_ELEMENT_TYPES: dict[str, np.dtype] = {
    "e4m3": np.dtype(jnp.float8_e4m3fn),
    "e5m2": np.dtype(jnp.float8_e5m2),
    # (jax.numpy exports the FP6 types at run time; its type stub does not declare them.)
    "e2m3": np.dtype(jnp.float6_e2m3fn),  # pyright: ignore[reportAttributeAccessIssue]
    "e3m2": np.dtype(jnp.float6_e3m2fn),  # pyright: ignore[reportAttributeAccessIssue]
    "e2m1": np.dtype(jnp.float4_e2m1fn),
    "int8": np.dtype(jnp.int8),
}

# emax (exponent of the largest power of two the element type holds) and the largest
# magnitude, from the OCP MX v1.0 element tables.
#
# MXINT8: the element is an 8-bit two's-complement integer k with an implicit scale of
# 2**-6, so it stands for k / 64. The seed tutorial (Quark) lists INT8 as an element type
# but gives no range; we follow the spec's symmetric range, k in [-127, 127] (largest
# magnitude 127/64, emax 0): -128 (that is -2.0) is never produced, so negation is exact
# and the range matches the other, sign-magnitude, element types.
_EMAX: dict[str, int] = {"e4m3": 8, "e5m2": 15, "e2m3": 2, "e3m2": 4, "e2m1": 2, "int8": 0}
_MAX: dict[str, float] = {"e4m3": 448.0, "e5m2": 57344.0, "e2m3": 7.5, "e3m2": 28.0, "e2m1": 6.0, "int8": 127 / 64}

# (minimum normal exponent, mantissa bits) of the FP6 formats, which are rounded to by
# hand (XLA has no FP6 type on CPU, see `element_storage_dtype`).
_FP6_GRID: dict[str, tuple[int, int]] = {"e2m3": (0, 3), "e3m2": (-2, 2)}

# Element types with a NaN encoding: the elements of a NaN block are NaN in these.
_HAS_NAN = ("e4m3", "e5m2")

_E8M0_NAN = 0xFF
_E8M0_BIAS = 127
_F32_EXP_MASK = 0x7F800000
_F32_FRAC_MASK = 0x007FFFFF
_F32_ABS_MASK = 0x7FFFFFFF


def _check_elem(elem) -> str:
    if not isinstance(elem, str) or elem not in MX_ELEMENT_TYPES:
        names = ", ".join(repr(k) for k in MX_ELEMENT_TYPES)
        raise ValueError(f"`elem` must be one of {names}, got {elem!r}.")
    return elem


def element_emax(elem: str) -> int:
    """The exponent of the largest power of two in the MX element type `elem`.

    **Arguments:**

    - `elem`: one of the keys of `MX_ELEMENT_TYPES`.

    **Returns:**

    8 for E4M3, 15 for E5M2, 2 for E2M3, 4 for E3M2, 2 for E2M1 and 0 for INT8 (whose
    elements are `k / 64`, `|k| <= 127`).
    """
    return _EMAX[_check_elem(elem)]


def element_max(elem: str) -> float:
    """The largest magnitude of the MX element type `elem`.

    **Arguments:**

    - `elem`: one of the keys of `MX_ELEMENT_TYPES`.

    **Returns:**

    448 for E4M3, 57344 for E5M2, 7.5 for E2M3, 28 for E3M2, 6 for E2M1 and 127/64 for
    INT8.
    """
    return _MAX[_check_elem(elem)]


def element_storage_dtype(elem: str) -> np.dtype:
    """The dtype of the element array `fp8ax._mx.mx_quantize` returns for `elem`.

    This is `MX_ELEMENT_TYPES[elem]`, except for the FP6 types: XLA has no FP6 type on
    CPU (an FP6 array cannot even be created), so E2M3 and E3M2 elements are returned as
    `float8_e4m3fn` arrays whose values all lie on the FP6 grid. E4M3 holds every E2M3 and
    E3M2 value exactly, so the container changes no value, and casting it to
    `jnp.float6_e2m3fn` / `jnp.float6_e3m2fn` (where a backend supports them) is exact.

    **Arguments:**

    - `elem`: one of the keys of `MX_ELEMENT_TYPES`.

    **Returns:**

    A NumPy dtype.
    """
    if _check_elem(elem) in _FP6_GRID:
        return np.dtype(jnp.float8_e4m3fn)
    return MX_ELEMENT_TYPES[elem]


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"`block_size` must be an int, got {block_size!r}.")
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got {block_size}.")
    return int(block_size)


def _check_axis(axis, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"`axis` must be an int, got {axis!r}.")
    if not -ndim <= axis < ndim:
        raise ValueError(f"`axis` must be in [-{ndim}, {ndim}) for an array with {ndim} dimensions, got {axis}.")
    return int(axis) % ndim


def _to_blocks(a: Array, axis: int, block_size: int) -> Array:
    """Moves `axis` last, zero-pads it to whole blocks and splits it: (..., nblocks, block_size)."""
    a = jnp.moveaxis(a, axis, -1)
    n = a.shape[-1]
    nblocks = -(-n // block_size)
    pad = nblocks * block_size - n
    if pad:
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a.reshape(*a.shape[:-1], nblocks, block_size)


def _from_blocks(a: Array, axis: int, n: int) -> Array:
    """Inverse of `_to_blocks`: merges the blocks, drops the padding, moves the axis back."""
    a = a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])[..., :n]
    return jnp.moveaxis(a, -1, axis)


def _split_f32(mag: Array) -> tuple[Array, Array]:
    """Exponent and significand of non-negative finite float32 bit patterns (int32).

    Returns `(exp, sig)` with `value == sig * 2**(exp - 23)` and `sig` in [2**23, 2**24)
    for every non-zero value, subnormals included (they are normalized by counting leading
    zeros). Zero gives meaningless values, which callers mask.
    """
    field = mag >> 23
    frac = mag & _F32_FRAC_MASK
    subnormal = field == 0
    shift = lax.clz(frac) - 8  # brings a subnormal's leading 1 to bit 23
    sig = jnp.where(subnormal, frac << jnp.clip(shift, 0, 24), frac | 0x800000)
    exp = jnp.where(subnormal, -126 - shift, field - 127)
    return exp, sig


def _ldexp_f32(x: Array, n: Array) -> Array:
    """`x * 2**n` for float32 `x` and int32 `n`, rounded once to nearest-even.

    Done on the bit patterns, so it is exact whatever the denormal mode (XLA's CPU
    backend flushes float32 subnormals, in inputs and results, to zero). Overflow gives
    +-inf; NaN and +-inf are returned unchanged; the sign of zero is kept.
    """
    bits = lax.bitcast_convert_type(x, jnp.int32)
    sign = bits & jnp.int32(-(2**31))
    mag = bits & _F32_ABS_MASK
    exp, sig = _split_f32(mag)
    new = exp + n
    normal = ((new + 127) << 23) | (sig & _F32_FRAC_MASK)
    # A subnormal result: shift the significand right, rounding half to even. A carry
    # into bit 23 gives the smallest normal's bit pattern, which is right.
    s = jnp.clip(-126 - new, 1, 25)
    q = sig >> s
    rem = sig - (q << s)
    half = jnp.int32(1) << (s - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    out = jnp.where(new >= -126, normal, q)
    out = jnp.where(new > 127, _F32_EXP_MASK, out)
    out = jnp.where(mag == 0, 0, out)
    out = jnp.where(mag >= _F32_EXP_MASK, mag, out)
    return lax.bitcast_convert_type(out | sign, jnp.float32)


def _round_to_fp6(y: Array, elem: str) -> Array:
    """Rounds float32 `y` (already clipped to +-max) to nearest-even on the FP6 grid."""
    emin, mbits = _FP6_GRID[elem]
    field = (lax.bitcast_convert_type(y, jnp.int32) >> 23) & 0xFF
    # The grid spacing in y's binade is 2**(max(exponent, emin) - mbits) (subnormals share
    # emin's spacing). Multiplying by it or its inverse is exact: both are normal powers
    # of two and y is in [-28, 28].
    qexp = jnp.maximum(field - 127, emin) - mbits
    inv = lax.bitcast_convert_type((127 - qexp) << 23, jnp.float32)
    step = lax.bitcast_convert_type((127 + qexp) << 23, jnp.float32)
    return jnp.round(y * inv) * step  # jnp.round rounds half to even


def mx_quantize(
    x: ArrayLike,
    axis: int,
    elem: str,
    block_size: int = 32,
    scale_rule: Literal["floor", "ceil"] = "floor",
) -> tuple[Array, Array]:
    """Quantizes `x` to an MX format: per-block E8M0 scales and narrow elements.

    Blocks are `block_size` consecutive elements along `axis`. If the length `n` of that
    axis is not a multiple of `block_size`, the last block is zero-padded for computing its
    scale; padding changes no result, and the elements keep `x`'s shape.

    Each block's scale is `X = 2**e` with

    - `scale_rule="floor"` (the OCP spec's rule): `e = floor(log2(amax)) - emax`, where
      `amax` is the block's largest magnitude and `emax` is `fp8ax._mx.element_emax`.
      `amax / X` lies in `[2**emax, 2**(emax+1))`, which can exceed the element type's
      largest value (e.g. 500 > 448 for E4M3): such elements saturate.
    - `scale_rule="ceil"`: `e = ceil(log2(amax / element_max))`, the smallest power of two
      with `amax / X <= element_max`, so no element saturates (it gives up to one bit of
      precision for that).

    `e` is clamped to E8M0's range [-127, 127] (so elements can still saturate when the
    clamp at 127 bites, which only INT8 with `"ceil"` can reach from float32 input).

    Each element is `x / X` rounded to nearest-even in the element type, saturating to
    `+-element_max` (never inf). INT8 elements are the integers `k = round(64 * x / X)`,
    clipped to [-127, 127] (they stand for `k / 64`, see `MX_ELEMENT_TYPES`). Signs of
    zero are kept (except in INT8, which has no negative zero).

    Special blocks:

    - amax 0 (all zeros): scale `2**-127`, the smallest E8M0 value; elements zero.
    - any NaN or +-inf in the block: the scale is E8M0's NaN (`0xFF`), so the whole block
      dequantizes to NaN, as the spec defines a NaN scale. An infinite input is treated
      like NaN because the spec's E8M0 has no infinity and no finite scale can represent
      it. The elements of such a block are NaN for E4M3 and E5M2, and zero for the types
      without a NaN encoding (E2M3, E3M2, E2M1, INT8); either way the NaN scale makes them
      NaN when dequantized.

    The computation is done on `x` cast to float32 (exact for bfloat16 and float16 input;
    float64 input is rounded to float32 first, values beyond float32's range becoming
    +-inf) and on the integer bit patterns, so it is bit-exact on every backend, float32
    subnormals included.

    **Arguments:**

    - `x`: a floating-point array with at least one dimension.
    - `axis`: the axis the blocks run along; negative values count from the end.
    - `elem`: the element type, one of the keys of `MX_ELEMENT_TYPES`.
    - `block_size`: elements per block (the spec's is 32).
    - `scale_rule`: `"floor"` or `"ceil"`, as above.

    **Returns:**

    A tuple `(values, scales)`:

    - `values` has `x`'s shape and dtype `element_storage_dtype(elem)`:
      the element type itself, except for FP6 (`float8_e4m3fn` holding FP6 values).
    - `scales` has dtype `jnp.float8_e8m0fnu` and `x`'s shape with `axis` replaced by
      `ceil(n / block_size)`.
    """
    elem = _check_elem(elem)
    block_size = _check_block_size(block_size)
    if scale_rule not in ("floor", "ceil"):
        raise ValueError(f"`scale_rule` must be 'floor' or 'ceil', got {scale_rule!r}.")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating-point array, got dtype {x.dtype}.")
    axis = _check_axis(axis, x.ndim)
    n = x.shape[axis]

    blocks = _to_blocks(x.astype(jnp.float32), axis, block_size)
    mag = lax.bitcast_convert_type(blocks, jnp.int32) & _F32_ABS_MASK
    # For non-negative floats the bit patterns order like the values, and every NaN
    # pattern is above inf's, so an integer max is an exact amax that sees NaN and inf.
    amax = jnp.max(mag, axis=-1)
    non_finite = amax >= _F32_EXP_MASK

    exp, sig = _split_f32(amax)  # floor(log2(amax)) == exp
    e = exp - _EMAX[elem]
    if scale_rule == "ceil":
        # amax = m * 2**exp and element_max = M * 2**emax with m, M in [1, 2), so
        # ceil(log2(amax / element_max)) = exp - emax + (m > M): compare significands.
        max_sig = int(np.float32(_MAX[elem]).view(np.int32)) & _F32_FRAC_MASK | 0x800000
        e = e + (sig > max_sig).astype(jnp.int32)
    e = jnp.where(amax == 0, -_E8M0_BIAS, jnp.clip(e, -_E8M0_BIAS, _E8M0_BIAS))
    code = jnp.where(non_finite, _E8M0_NAN, e + _E8M0_BIAS).astype(jnp.uint8)
    scales = jnp.moveaxis(lax.bitcast_convert_type(code, jnp.float8_e8m0fnu), -1, axis)

    # x / X, exactly (for INT8, 64 * x / X). Results below 2**-126 are rounded in float32,
    # which cannot matter: every element type rounds them to +-0.
    shift = -e[..., None] + (6 if elem == "int8" else 0)
    y = _ldexp_f32(blocks, shift)
    bound = _MAX[elem] * (64 if elem == "int8" else 1)
    y = jnp.clip(y, -bound, bound)
    if elem == "int8":
        y = jnp.round(y)  # half to even; |y| <= 127 after the clip
    elif elem in _FP6_GRID:
        y = _round_to_fp6(y, elem)
    fill = jnp.float32(jnp.nan if elem in _HAS_NAN else 0.0)
    y = jnp.where(non_finite[..., None], fill, y)
    # FP8 and FP4 round here, in XLA's nearest-even conversion; FP6 and INT8 values are
    # already on their grid, so their cast is exact.
    values = _from_blocks(y, axis, n).astype(element_storage_dtype(elem))
    return values, scales


def mx_dequantize(values: ArrayLike, scales: ArrayLike, axis: int, block_size: int, dtype=jnp.float32) -> Array:
    """Reconstructs `values * X` from `fp8ax._mx.mx_quantize`'s output.

    **Arguments:**

    - `values`: the elements, as returned by `mx_quantize` (an `int8` array is read as
      MXINT8, `k * 2**-6`; any floating dtype is read as its values).
    - `scales`: the `jnp.float8_e8m0fnu` block scales, with `values`' shape except for
      `ceil(n / block_size)` along `axis`.
    - `axis`: the axis the blocks run along; negative values count from the end.
    - `block_size`: elements per block, as given to `mx_quantize`.
    - `dtype`: the floating dtype of the result.

    **Returns:**

    An array of `values`' shape and dtype `dtype`. The product is computed exactly in
    float32 (on the bit patterns, so results in float32's subnormal range are kept on
    every backend), then rounded once to `dtype`. A block whose scale is NaN (`0xFF`)
    is NaN throughout. Products beyond float32's range become +-inf: MX can represent
    them, and `"ceil"`-rule blocks within a factor 2 of float32's largest value can round
    up to 2**128.
    """
    block_size = _check_block_size(block_size)
    values = jnp.asarray(values)
    scales = jnp.asarray(scales)
    try:
        out_dtype = np.dtype(dtype)
    except TypeError:
        out_dtype = None
    if out_dtype is None or not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype!r}.")
    if values.dtype != np.dtype(jnp.int8) and not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"`values` must be int8 (MXINT8) or floating-point, got dtype {values.dtype}.")
    if scales.dtype != np.dtype(jnp.float8_e8m0fnu):
        raise TypeError(f"`scales` must have dtype float8_e8m0fnu, got {scales.dtype}.")
    axis = _check_axis(axis, values.ndim)
    n = values.shape[axis]
    want = values.shape[:axis] + (-(-n // block_size),) + values.shape[axis + 1 :]
    if scales.shape != want:
        raise ValueError(
            f"`scales` must have shape {want} for `values` of shape {values.shape} with axis={axis} and "
            f"block_size={block_size}, got {scales.shape}."
        )

    expanded = lax.slice_in_dim(jnp.repeat(scales, block_size, axis=axis), 0, n, axis=axis)
    return e8m0_ldexp(values, expanded).astype(out_dtype)


def e8m0_ldexp(values: Array, scales: Array, int_exponent: int = 0) -> Array:
    """`values * scales` in float32, exactly, for E8M0 `scales` broadcastable against
    `values` (one per element, or size 1 along some axes): the product is formed on the
    bit patterns, so results in float32's subnormal range survive on every backend. An
    `int8` array is read as MXINT8 (`k * 2**-6`); `int_exponent` multiplies by a further
    `2**int_exponent`. A NaN scale (`0xFF`) gives NaN."""
    values = jnp.asarray(values)
    code = lax.bitcast_convert_type(jnp.asarray(scales), jnp.uint8).astype(jnp.int32)
    shift = code - _E8M0_BIAS - (6 if values.dtype == np.dtype(jnp.int8) else 0) + int(int_exponent)
    vf = values.astype(jnp.float32)
    shift = jnp.broadcast_to(shift, vf.shape)
    out = _ldexp_f32(vf, shift)
    return jnp.where(jnp.broadcast_to(code == _E8M0_NAN, vf.shape), jnp.float32(jnp.nan), out)
