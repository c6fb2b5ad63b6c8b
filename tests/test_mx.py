"""MX block quantization against an independent float64 NumPy + ml_dtypes reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from fp8ax import _formats, _mx
from helpers import sqnr

# The OCP MX v1.0 element types, written out here rather than taken from fp8ax:
# (ml_dtypes type or None for INT8, emax, largest magnitude).
ELEMS = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 8, 448.0),
    "e5m2": (ml_dtypes.float8_e5m2, 15, 57344.0),
    "e2m3": (ml_dtypes.float6_e2m3fn, 2, 7.5),
    "e3m2": (ml_dtypes.float6_e3m2fn, 4, 28.0),
    "e2m1": (ml_dtypes.float4_e2m1fn, 2, 6.0),
    "int8": (None, 0, 127 / 64),
}
RULES = ["floor", "ceil"]

quantize = jax.jit(_mx.mx_quantize, static_argnums=(1, 2, 3, 4))
dequantize = jax.jit(_mx.mx_dequantize, static_argnums=(2, 3, 4))


@jax.jit(static_argnums=(1, 2, 3, 4))
def _round_trip(x, axis, elem, block_size, rule):
    values, scales = _mx.mx_quantize(x, axis, elem, block_size, rule)
    return values, scales, _mx.mx_dequantize(values, scales, axis, block_size, jnp.float32)


def _half_ulp_at_max(elem: str) -> float:
    """Half the spacing of the element grid in its top binade, in element units."""
    mldtype, emax, _ = ELEMS[elem]
    if mldtype is None:
        return 2.0**-7  # INT8: k / 64, spacing 1/64 everywhere
    return 2.0 ** (emax - ml_dtypes.finfo(mldtype).nmant - 1)


def _reference(x: np.ndarray, axis: int, elem: str, block_size: int, rule: str):
    """MX quantization in float64 NumPy, element rounding by ml_dtypes.

    Returns (elements in the ml_dtypes element type, or int8 k for INT8; E8M0 codes as
    uint8; dequantized values in float64). NaN/inf blocks get the NaN scale and NaN
    (E4M3, E5M2) or zero elements; amax-0 blocks get 2**-127.
    """
    mldtype, emax, vmax = ELEMS[elem]
    x = np.moveaxis(np.asarray(x, np.float32).astype(np.float64), axis, -1)
    n = x.shape[-1]
    nb = -(-n // block_size)
    padded = np.zeros(x.shape[:-1] + (nb * block_size,))
    padded[..., :n] = x
    blocks = padded.reshape(x.shape[:-1] + (nb, block_size))
    with np.errstate(all="ignore"):
        amax = np.max(np.abs(blocks), axis=-1)
        bad = ~np.isfinite(amax)
        zero = amax == 0
        a = np.where(bad | zero, 1.0, amax)
        if rule == "floor":
            # floor(log2(amax)), the float64 log2 corrected to the exact integer.
            e = np.floor(np.log2(a))
            e = np.where(np.ldexp(1.0, e.astype(int)) > a, e - 1, e)
            e = np.where(np.ldexp(1.0, (e + 1).astype(int)) <= a, e + 1, e)
            e = e - emax
        else:
            # The smallest e with amax <= vmax * 2**e, again corrected exactly.
            e = np.ceil(np.log2(a / vmax))
            e = np.where(np.ldexp(vmax, (e - 1).astype(int)) >= a, e - 1, e)
            e = np.where(np.ldexp(vmax, e.astype(int)) < a, e + 1, e)
        e = np.where(zero, -127, np.clip(e, -127, 127)).astype(int)
        scale = np.where(bad, np.nan, np.ldexp(1.0, e))
        codes = scale.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
        y = blocks / np.ldexp(1.0, e)[..., None]
        if mldtype is None:
            k = np.clip(np.round(y * 64), -127, 127)  # np.round: half to even
            k = np.where(bad[..., None], 0, k)
            q = k.astype(np.int8)
            vals = q.astype(np.float64) / 64  # from the integer: no negative zero
        else:
            # Clip first: saturation is part of MX conversion, ml_dtypes' cast need not do it.
            fill = np.nan if elem in ("e4m3", "e5m2") else 0.0
            q = np.where(bad[..., None], fill, np.clip(y, -vmax, vmax)).astype(mldtype)
            vals = q.astype(np.float64)
        deq = np.where(bad[..., None], np.nan, vals * scale[..., None])

    def unblock(b):
        return np.moveaxis(b.reshape(b.shape[:-2] + (nb * block_size,))[..., :n], -1, axis)

    return unblock(q), np.moveaxis(codes, -1, axis), unblock(deq)


def _assert_elements_equal(got, want):
    """Exact comparison: bit patterns where the dtypes agree, else values and signs of zero.

    (FP6 elements come back in a float8_e4m3fn container, see `element_storage_dtype`.)
    """
    got = np.asarray(got)
    if got.dtype == want.dtype:
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_array_equal(got32, want32)
    np.testing.assert_array_equal(np.signbit(got32), np.signbit(want32))


def _assert_dequant_equal(got, want):
    got = np.asarray(got)
    assert got.dtype == np.float32
    # Every dequantized MX value is a float32 (subnormals included), or beyond float32's
    # range and so +-inf (the ceil rule can round the top of float32 up to 2**128):
    # compare exactly.
    with np.errstate(over="ignore"):
        want = want.astype(np.float32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _check(x, axis, elem, block_size, rule):
    values, scales, deq = _round_trip(x, axis, elem, block_size, rule)
    want_q, want_codes, want_deq = _reference(np.asarray(x), axis, elem, block_size, rule)
    assert values.shape == np.shape(x) and values.dtype == _mx.element_storage_dtype(elem)
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == want_codes.shape
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), want_codes)
    _assert_elements_equal(values, want_q)
    _assert_dequant_equal(deq, want_deq)
    return values, scales, np.asarray(deq)


def _mixed_data(key, rows: int) -> np.ndarray:
    """(rows, 40) float32, blocks down axis 0: random binades plus special columns."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    cols = 40
    # Columns 0-31: each column sits at a random binade in [-100, 100] and its elements
    # spread over +-12 binades, so blocks mix the element type's normal and subnormal
    # ranges and values that round to zero.
    offset = jax.random.randint(k1, (1, 32), -100, 100)
    spread = jax.random.uniform(k2, (rows, 32), minval=-12.0, maxval=12.0)
    sign = jnp.where(jax.random.bernoulli(k3, 0.5, (rows, 32)), -1.0, 1.0)
    x = np.zeros((rows, cols), np.float32)
    x[:, :32] = np.asarray(sign * jnp.exp2(spread) * jnp.exp2(offset.astype(jnp.float32)), np.float32)
    x[:, 32] = 0.0
    x[::3, 32] = -0.0  # amax-0 blocks, with signed zeros
    u = np.asarray(jax.random.uniform(k4, (rows,), minval=-1.0, maxval=1.0), np.float32)
    x[:, 33] = u * np.float32(3.4e38)  # near float32's max
    x[:, 34] = u * np.float32(1e-39)  # float32 subnormals: the scale clamps at 2**-127
    x[:, 35] = u
    x[5, 35] = np.nan  # a NaN block
    x[:, 36] = u
    x[7, 36], x[rows - 1, 36] = np.inf, -np.inf  # inf blocks
    # Integers / 16: ties for every rounding.
    x[:, 37] = np.asarray(jax.random.randint(k5, (rows,), -1000, 1000), np.float32) / 16
    x[:, 38] = np.float32(448.0 * 2.0**-20) * np.sign(u)  # E4M3: amax exactly max * 2**k (ceil boundary)
    # The smallest normal float32, then a subnormal just below it: for INT8 (emax 0) under
    # the ceil rule its scale is 2**-126, not the clamp, so subnormal exponents must be exact.
    x[:, 39] = np.float32(2.0**-126)
    x[rows // 2 :, 39] = np.float32(1.99 * 2.0**-127)
    return x


@pytest.mark.parametrize("elem", list(ELEMS))
def test_element_constants(elem):
    mldtype, emax, vmax = ELEMS[elem]
    assert _mx.element_emax(elem) == emax
    assert _mx.element_max(elem) == vmax
    assert _mx.MX_ELEMENT_TYPES[elem] == np.dtype(mldtype if mldtype is not None else np.int8)
    if mldtype is not None:
        # Against ml_dtypes' own description of the formats.
        assert emax == ml_dtypes.finfo(mldtype).maxexp - 1
        assert vmax == float(ml_dtypes.finfo(mldtype).max)


@pytest.mark.parametrize("block_size", [32, 8])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", list(ELEMS))
def test_quantize_bit_exact(elem, rule, block_size, getkey):
    # 70 rows along axis 0 (not the last axis, not a multiple of either block size).
    x = _mixed_data(getkey(), 70)
    values, scales, _ = _check(x, 0, elem, block_size, rule)
    assert scales.shape == (-(-70 // block_size), 40)
    codes = np.asarray(scales).view(np.uint8)
    assert np.all(codes[:, 32] == 0)  # amax 0: 2**-127
    assert np.all(codes[:, 34] == 0)  # below 2**-127 * 2**emax: clamped at 2**-127
    assert codes[5 // block_size, 35] == 0xFF and codes[7 // block_size, 36] == 0xFF


# One element type per rounding path: XLA's FP8 and FP4 casts, FP6 by hand, INT8.
@pytest.mark.parametrize("elem", ["e4m3", "e2m1", "e2m3", "int8"])
def test_negative_axis_padding_and_vmap(elem, getkey):
    x = np.asarray(jax.random.normal(getkey(), (3, 70, 4), jnp.float32)) * np.float32(100)
    values, scales, _ = _check(x, -2, elem, 32, "floor")
    assert scales.shape == (3, 3, 4)
    # Padding changes nothing: explicit zero padding to 96 gives the same result.
    padded = np.concatenate([x, np.zeros((3, 26, 4), np.float32)], axis=1)
    pv, ps = quantize(padded, 1, elem, 32, "floor")
    _assert_elements_equal(values, np.asarray(pv)[:, :70])
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), np.asarray(ps).view(np.uint8))
    # vmap over the leading axis agrees with the batched call.
    vv, vs = jax.jit(jax.vmap(lambda r: _mx.mx_quantize(r, 0, elem, 32)))(x)
    _assert_elements_equal(vv, np.asarray(values))
    np.testing.assert_array_equal(np.asarray(vs).view(np.uint8), np.asarray(scales).view(np.uint8))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", [e for e in ELEMS if e != "int8"])
def test_element_subnormal_blocks(elem, rule, getkey):
    # Blocks whose every element lands in the element type's subnormal range: only
    # possible when the scale is clamped at 2**-127, so the inputs are float32 subnormals
    # (which XLA's CPU arithmetic would flush to zero). Grid points and midpoints (ties).
    mldtype = ELEMS[elem][0]
    tiny = float(ml_dtypes.finfo(mldtype).smallest_subnormal)
    normal = float(ml_dtypes.finfo(mldtype).smallest_normal)
    steps = int(normal / tiny)  # subnormal grid points below the smallest normal
    k = np.asarray(jax.random.randint(getkey(), (4, 32), 1, steps), np.float64)
    k[:, ::2] += 0.5  # ties between grid points
    k[:, 3::4] *= -1
    k = np.clip(k, -(steps - 1), steps - 1)  # stay strictly below the smallest normal
    x = (k * tiny * 2.0**-127).astype(np.float32)
    assert np.all(np.abs(x) < np.float32(2.0**-126)) and np.all(x != 0)
    values, scales, _ = _check(x, 1, elem, 32, rule)
    assert np.all(np.asarray(scales).view(np.uint8) == 0)
    v = np.abs(np.asarray(values).astype(np.float32))
    assert np.all(v < normal) and np.any(v > 0)


@pytest.mark.parametrize("elem", list(ELEMS))
def test_floor_rule_saturates_ceil_rule_does_not(elem):
    # amax = 1.999 * 2**(emax + 3): the floor rule's scale is 2**3, leaving 1.999 * 2**emax,
    # above element_max for every element type (509.7 > 448 for E4M3, 127.9 -> 128 > 127
    # for INT8), so it saturates; the ceil rule picks 2**4 and nothing saturates.
    _, emax, vmax = ELEMS[elem]
    big = np.float32(1.999 * 2.0 ** (emax + 3))
    x = np.array([[big, -big, 1.0, -0.5] + [0.25] * 28], np.float32)
    h = _half_ulp_at_max(elem)

    values, scales, deq = _check(x, 1, elem, 32, "floor")
    assert np.asarray(scales).view(np.uint8)[0, 0] == 127 + 3
    el = np.asarray(values).astype(np.float64) / (64 if elem == "int8" else 1)
    assert el[0, 0] == vmax and el[0, 1] == -vmax  # clipped to element_max
    assert abs(deq[0, 0] - big) > 8 * h  # the clip error is beyond the rounding bound

    values, scales, deq = _check(x, 1, elem, 32, "ceil")
    assert np.asarray(scales).view(np.uint8)[0, 0] == 127 + 4
    el = np.abs(np.asarray(values).astype(np.float64) / (64 if elem == "int8" else 1))
    assert np.all(el < vmax)
    assert np.all(np.abs(deq - x) <= 16 * h)  # rounding error only (scale 2**4)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", list(ELEMS))
def test_extreme_exponents_clamp(elem, rule):
    _, emax, vmax = ELEMS[elem]
    f32max = float(np.finfo(np.float32).max)
    x = np.array(
        [
            [f32max, -f32max / 3] + [1e30] * 6,  # top of float32
            [2.0**-149, -(2.0**-149)] + [0.0] * 6,  # smallest float32 subnormal
            [2.0**-127] * 8,  # amax 2**-127
        ],
        np.float32,
    )
    values, scales, deq = _check(x, 1, elem, 8, rule)
    codes = np.asarray(scales).view(np.uint8)[:, 0]
    # floor(log2(f32max)) = 127; ceil(log2(f32max / vmax)) = 128 - emax, clamped at 127
    # (only INT8's, with emax 0, reaches the clamp).
    top = 127 - emax if rule == "floor" else min(128 - emax, 127)
    assert codes[0] == 127 + top
    assert codes[1] == 0 and codes[2] == 0  # clamped at -127
    if elem == "int8" and rule == "ceil":
        assert np.asarray(values)[0, 0] == 127  # the clamp at 2**127 saturates
    # 2**-127 (a float32 subnormal) is exactly 1.0 at scale 2**-127, in every element type.
    np.testing.assert_array_equal(deq[2], x[2])


@pytest.mark.parametrize("elem", list(ELEMS))
def test_non_finite_blocks(elem, getkey):
    x = np.array(jax.random.normal(getkey(), (4, 64), jnp.float32))
    clean_v, clean_s, _ = _round_trip(x, 1, elem, 32, "floor")
    x[0, 3], x[1, 40], x[2, 33] = np.nan, np.inf, -np.inf
    values, scales, deq = _check(x, 1, elem, 32, "floor")
    codes = np.asarray(scales).view(np.uint8)
    assert codes[0, 0] == codes[1, 1] == codes[2, 1] == 0xFF
    assert np.all(np.isnan(deq[0, :32])) and np.all(np.isnan(deq[1, 32:])) and np.all(np.isnan(deq[2, 32:]))
    el = np.asarray(values).astype(np.float32)
    if elem in ("e4m3", "e5m2"):
        assert np.all(np.isnan(el[0, :32]))
    else:  # no NaN encoding: zeros, made NaN by the scale
        assert np.all(el[0, :32] == 0)
    # Other blocks are untouched.
    ok = np.ones((4, 2), bool)
    ok[0, 0] = ok[1, 1] = ok[2, 1] = False
    np.testing.assert_array_equal(codes[ok], np.asarray(clean_s).view(np.uint8)[ok])
    np.testing.assert_array_equal(np.asarray(values).astype(np.float32)[3], np.asarray(clean_v).astype(np.float32)[3])


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("elem", list(ELEMS))
def test_round_trip_error_bound(elem, rule, getkey):
    # Bound, per element, in units of its block's scale X: |x - deq| <= X * h, with h half
    # the element grid's spacing at its top binade (E4M3 16, E5M2 4096, E2M3 0.25, E3M2 2,
    # E2M1 0.5, INT8 2**-7), since every element not clipped rounds in a binade at or
    # below the top one. The ceil rule clips nothing. Under the floor rule, elements in
    # (element_max, 2**(emax+1)) * X clip instead, with error < X * (2**(emax+1) - max).
    # Per block this gives max|x - deq| / amax <= h / 2**emax = 2**-(mantissa bits + 1)
    # for the floor rule's unclipped elements (amax >= X * 2**emax).
    _, emax, vmax = ELEMS[elem]
    h = _half_ulp_at_max(elem)
    x = np.array(jax.random.normal(getkey(), (64, 256), jnp.float32))
    x *= np.exp2(np.asarray(jax.random.randint(getkey(), (64, 1), -30, 30), np.float32))
    values, scales, deq = _round_trip(x, 1, elem, 32, rule)
    deq = np.asarray(deq, np.float64)
    X = np.repeat(np.asarray(scales).astype(np.float64), 32, axis=1)
    err = np.abs(deq - x) / X
    clipped = np.abs(x) / X > vmax
    if rule == "ceil":
        assert not np.any(clipped)
    assert np.all(err[~clipped] <= h)
    assert np.all(err[clipped] < 2.0 ** (emax + 1) - vmax)
    if rule == "floor":
        amax = np.repeat(np.max(np.abs(x).reshape(64, 8, 32), axis=-1), 32, axis=1)
        rel = np.abs(deq - x) / amax
        assert np.all(rel[~clipped] <= h / 2.0**emax)


@jax.jit
def _per_tensor_e4m3(x, scale):
    q = _formats.quantize(x, scale, np.dtype(jnp.float8_e4m3fn))
    return q.astype(jnp.float32) * scale


@pytest.mark.parametrize("outlier", [1e3, 1e5])
def test_mxfp8_vs_per_tensor_e4m3_with_outliers(outlier, getkey):
    # N(0, 1) data with 8 outliers of magnitude U(0.5, 1) * `outlier`. The SQNR of the
    # whole tensor is set by the 8 outliers (their energy is >= 30 dB above the rest),
    # so the number that shows what outliers cost is the SQNR of the other 65528 values.
    # - 1e3: E4M3 spans 2**-9 .. 448, so one per-tensor scale (amax / 448) still leaves
    #   N(0, 1) data in E4M3's normal range: both give E4M3's ~31 dB, and MX gains nothing
    #   (the spec's floor rule even loses ~0.8 dB: block maxima with a significand above
    #   1.75 saturate at 448).
    # - 1e5: the per-tensor scale pushes the bulk into E4M3's subnormals (18 dB), while MX
    #   blocks of 32 only lose the few blocks that hold an outlier (~30 dB).
    x = np.array(jax.random.normal(getkey(), (256, 256), jnp.float32))
    idx = np.asarray(jax.random.choice(getkey(), x.size, (8,), replace=False))
    mag = np.asarray(jax.random.uniform(getkey(), (8,), minval=0.5, maxval=1.0), np.float32)
    flat = x.reshape(-1)
    flat[idx] = np.float32(outlier) * mag * np.sign(flat[idx])
    bulk = np.ones(x.size, bool)
    bulk[idx] = False

    scale = jnp.float32(np.max(np.abs(x)) / 448.0)
    per_tensor = np.asarray(_per_tensor_e4m3(x, scale))
    results = {"per-tensor E4M3": per_tensor}
    for rule in RULES:
        results[f"MXFP8 {rule}"] = np.asarray(_round_trip(x, 1, "e4m3", 32, rule)[2])
    whole = {k: sqnr(x, v) for k, v in results.items()}
    rest = {k: sqnr(flat[bulk], v.reshape(-1)[bulk]) for k, v in results.items()}
    print(f"\noutliers {outlier:.0e}: " + "; ".join(f"{k} {rest[k]:.2f} dB ({whole[k]:.2f} dB whole)" for k in results))

    b_mx, b_pt = rest["MXFP8 floor"], rest["per-tensor E4M3"]
    if outlier == 1e3:
        assert b_pt > 31.0 and 30.0 < b_mx < b_pt
    else:
        assert b_pt < 20.0 and b_mx > 30.0 and b_mx > b_pt + 10.0
        assert rest["MXFP8 ceil"] > b_pt + 10.0


def test_low_precision_inputs_match_float32(getkey):
    x = jax.random.normal(getkey(), (8, 64), jnp.float32) * 300.0
    for dtype in (jnp.bfloat16, jnp.float16):
        xl = x.astype(dtype)
        got_v, got_s = quantize(xl, 1, "e4m3", 32, "floor")
        want_v, want_s = quantize(xl.astype(jnp.float32), 1, "e4m3", 32, "floor")
        _assert_elements_equal(got_v, np.asarray(want_v))
        np.testing.assert_array_equal(np.asarray(got_s).view(np.uint8), np.asarray(want_s).view(np.uint8))
    # Dequantizing to bfloat16 rounds the exact float32 result once.
    v, s = quantize(x, 1, "e5m2", 32, "floor")
    got = np.asarray(dequantize(v, s, 1, 32, jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    want = np.asarray(dequantize(v, s, 1, 32, jnp.float32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_argument_errors():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="`elem` must be one of 'e4m3', 'e5m2', 'e2m3', 'e3m2', 'e2m1', 'int8'"):
        _mx.mx_quantize(x, 1, "fp8")
    for bad in ("fp8", jnp.float8_e4m3fn):
        with pytest.raises(ValueError, match="`elem`"):
            _mx.element_max(bad)
        with pytest.raises(ValueError, match="`elem`"):
            _mx.element_emax(bad)
    with pytest.raises(ValueError, match="`block_size` must be >= 1"):
        _mx.mx_quantize(x, 1, "e4m3", 0)
    for bad in (2.0, True, "32"):
        with pytest.raises(TypeError, match="`block_size` must be an int"):
            _mx.mx_quantize(x, 1, "e4m3", bad)
    with pytest.raises(ValueError, match="`scale_rule` must be 'floor' or 'ceil'"):
        _mx.mx_quantize(x, 1, "e4m3", 32, "round")
    for bad in (2, -3):
        with pytest.raises(ValueError, match=r"`axis` must be in \[-2, 2\)"):
            _mx.mx_quantize(x, bad, "e4m3")
    with pytest.raises(TypeError, match="`axis` must be an int"):
        _mx.mx_quantize(x, 1.0, "e4m3")
    with pytest.raises(ValueError, match="`axis`"):
        _mx.mx_quantize(jnp.float32(1.0), 0, "e4m3")
    with pytest.raises(TypeError, match="`x` must be a floating-point array"):
        _mx.mx_quantize(jnp.ones((4, 8), jnp.int32), 1, "e4m3")

    v, s = quantize(x, 1, "e4m3", 4, "floor")
    with pytest.raises(TypeError, match="`scales` must have dtype float8_e8m0fnu"):
        _mx.mx_dequantize(v, s.astype(jnp.float32), 1, 4)
    with pytest.raises(ValueError, match=r"`scales` must have shape \(4, 1\)"):
        _mx.mx_dequantize(v, s, 1, 8)
    with pytest.raises(TypeError, match="`dtype` must be a floating dtype"):
        _mx.mx_dequantize(v, s, 1, 4, jnp.int32)
    with pytest.raises(TypeError, match="`values`"):
        _mx.mx_dequantize(v.astype(jnp.int32), s, 1, 4)
    with pytest.raises(ValueError, match="`block_size`"):
        _mx.mx_dequantize(v, s, 1, -1)


def test_gradient_of_a_full_contraction():
    # A vector dot product: the output, and so its gradient, is 0-d. Each backward GEMM
    # multiplies the gradient (one element: one block) by the other operand in MX blocks
    # along its only axis; with a gradient of 1 (exact in E5M2) the input gradients are
    # those operands quantized, exactly.
    import fp8ax

    k = jax.random.split(jax.random.key(3), 2)
    x, w = jax.random.normal(k[0], (96,)), jax.random.normal(k[1], (96,))
    recipe = fp8ax.MXScaling()
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    dims = (((0,), (0,)), ((), ()))
    # Jitted: eagerly, every op of the pipeline is dispatched on its own (40 s).
    gx, gw = jax.jit(jax.grad(lambda x, w: dg(x, w, dims), argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(fp8ax.quantize(w, recipe, axis=0).dequantize()))
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(fp8ax.quantize(x, recipe, axis=0).dequantize()))
    # A gradient that is not a power of two is quantized too: 0.3 in E5M2 is 0.3125.
    gx = jax.jit(jax.grad(lambda x: 0.3 * dg(x, w, dims)))(x)
    np.testing.assert_array_equal(
        np.asarray(gx), np.float32(0.3125) * np.asarray(fp8ax.quantize(w, recipe, axis=0).dequantize())
    )


def _documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
    """`jax.nn.scaled_matmul` as its documentation defines it (JAX lowers it for GPUs
    only): each operand times its scales repeated over their blocks, then
    'BMK,BNK->BMN', here in float32 at the highest precision."""
    a = lhs.astype(jnp.float32) * jnp.repeat(lhs_scales.astype(jnp.float32), lhs.shape[-1] // lhs_scales.shape[-1], -1)
    b = rhs.astype(jnp.float32) * jnp.repeat(rhs_scales.astype(jnp.float32), rhs.shape[-1] // rhs_scales.shape[-1], -1)
    return jnp.einsum("BMK,BNK->BMN", a, b, precision=jax.lax.Precision.HIGHEST).astype(preferred_element_type)


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims",
    [
        ((64, 96), (96, 32), (((1,), (0,)), ((), ()))),
        # a batch axis in different places, the contraction first on one side
        ((3, 32, 64), (64, 3, 32), (((2,), (0,)), ((0,), (1,)))),
    ],
)
def test_block_scaled_gemm_layout(lhs_shape, rhs_shape, dims, getkey, monkeypatch):
    """`block_scaled_gemm=True` hands the three MXFP8 GEMMs to `jax.nn.scaled_matmul` in
    its (B, M, K) x (B, N, K) layout; with the documented definition of that function in
    its place (JAX has no CPU lowering), forward and gradients equal the dequantized
    GEMMs of `block_scaled_gemm=False` (float32 sums of the same exact products: within
    1e-6 of the largest entry). Every contraction here is a multiple of 32 long; a GEMM
    whose contraction is not (a partial block) keeps the dequantized GEMM."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args[0].shape)
        return _documented_scaled_matmul(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "scaled_matmul", fake)
    x = jax.random.normal(getkey(), lhs_shape)
    w = jax.random.normal(getkey(), rhs_shape)
    out_shape = jax.eval_shape(lambda x, w: jax.lax.dot_general(x, w, dims), x, w).shape
    g = jax.random.normal(getkey(), out_shape)
    results = {}
    for flag in (True, False):
        dg = fp8ax.Fp8DotGeneral.init(fp8ax.MXScaling(), block_scaled_gemm=flag)

        @jax.jit  # one compile instead of every op dispatched on its own (80 s eagerly)
        def forward_and_back(x, w, g):
            out, vjp = jax.vjp(lambda x, w: dg(x, w, dims), x, w)  # noqa: B023 (called right away)
            return (out, *vjp(g))

        results[flag] = forward_and_back(x, w, g)
    assert len(calls) == 3  # forward, input gradient, weight gradient
    for got, want in zip(results[True], results[False]):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6 * scale)


def test_block_scaled_gemm_needs_whole_mxfp8_blocks(getkey, monkeypatch):
    """A contraction that is not a multiple of 32 long, FP4 elements, and the default on
    a machine without a Blackwell GPU keep the dequantized GEMM; a bad flag is an error
    naming it."""
    from fp8ax._gemm.kernels import _blackwell_default_device

    calls = []
    monkeypatch.setattr(jax.nn, "scaled_matmul", lambda *a, **k: calls.append(1) or _documented_scaled_matmul(*a, **k))
    x, w = jax.random.normal(getkey(), (64, 96)), jax.random.normal(getkey(), (96, 32))
    dims = (((1,), (0,)), ((), ()))

    def call(dg, x, w):  # jitted: one compile instead of every op dispatched on its own (30 s eagerly)
        return jax.jit(lambda x, w: dg(x, w, dims))(x, w)

    call(fp8ax.Fp8DotGeneral.init(fp8ax.MXScaling(), block_scaled_gemm=True), x[:, :80], w[:80])  # K = 80
    call(fp8ax.Fp8DotGeneral.init(fp8ax.MXScaling(32, "e2m1", "e2m1", "floor"), block_scaled_gemm=True), x, w)
    call(fp8ax.Fp8DotGeneral.init(fp8ax.MXScaling()), x, w)  # default: a Blackwell GPU only
    assert calls == [] and not _blackwell_default_device()  # CPU here
    with pytest.raises(TypeError, match="`block_scaled_gemm` must be None, True or False, got 'yes'"):
        fp8ax.GemmSettings(block_scaled_gemm="yes")
    with pytest.raises(TypeError, match="`block_scaled_gemm` must be None, True or False, got 1"):
        fp8ax.GemmSettings(block_scaled_gemm=1)  # (equal to True, but not a bool)
