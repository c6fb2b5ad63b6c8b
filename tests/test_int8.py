"""int8 quantization, and the int8 GEMM of `Fp8DotGeneral` with `Int8Scaling`, against
AQT's worked example and NumPy references."""

import functools
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from fp8ax._int8 import int8_quantize

MATMUL = (((1,), (0,)), ((), ()))

# Jitted once per shape: eager mode would compile every primitive separately.
_quantize = jax.jit(int8_quantize, static_argnums=1)
_INT8 = fp8ax.Fp8DotGeneral.init(fp8ax.Int8Scaling())


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dot(x, y, dn, out_dtype):
    """The int8 GEMM as fp8ax runs it: each operand quantized by `Int8Scaling` along the
    axes `dn` contracts (one scale per slice, as `int8_quantize` gives), int32
    accumulation, then the outer product of the scales."""
    return _INT8(x, y, dn, preferred_element_type=out_dtype)


def _gen_matrix(rows, cols, seed=0):
    # As in AQT's README ("How AQT Works Internally").
    np.random.seed(seed)
    return np.random.normal(size=(rows, cols))


# The outputs printed in AQT's README for a = gen_matrix(3, 4), w = gen_matrix(4, 5).
AQT_FLOAT = np.array(
    [
        [3.6095254, 5.8575077, 1.9510972, 4.732388, 1.9792626],
        [4.335892, 0.9743651, 2.7298734, 4.3540883, 3.637487],
        [-0.07735002, 2.7310796, -0.3519049, 0.19912864, -1.2023292],
    ]
)
AQT_INT8 = np.array(
    [
        [3.5998788, 5.8562713, 1.9385538, 4.7426414, 1.9792401],
        [4.321886, 0.99681264, 2.737299, 4.3591022, 3.6352503],
        [-0.07714217, 2.7415617, -0.35343346, 0.20568734, -1.1974115],
    ]
)


def _aqt_quant_f32(x: np.ndarray, axis: int) -> np.ndarray:
    # AQT's `quant_int8(x * (127 / amax))` in NumPy float32 (jnp.round and np.round
    # both round half to even).
    x = x.astype(np.float32)
    s = np.float32(127) / np.max(np.abs(x), axis=axis, keepdims=True)
    return np.clip(np.round(x * s), -127, 127).astype(np.int8)


def test_aqt_worked_example():
    # AQT computes in float32 (jnp converts the float64 NumPy inputs).
    a = _gen_matrix(3, 4).astype(np.float32)
    w = _gen_matrix(4, 5).astype(np.float32)
    # Sanity check that the inputs are AQT's: the float matmul matches the README.
    np.testing.assert_allclose(a.astype(np.float64) @ w.astype(np.float64), AQT_FLOAT, rtol=0, atol=1e-5)

    qa, sa = int8_quantize(a, (1,))  # one scale per row of the activations
    qw, sw = int8_quantize(w, (0,))  # one scale per column of the weights
    assert qa.dtype == jnp.int8 and qw.dtype == jnp.int8
    assert sa.shape == (3, 1) and sw.shape == (1, 5) and sa.dtype == sw.dtype == jnp.float32
    # The integer values are AQT's bit for bit (we quantize by multiplying by 127/amax).
    np.testing.assert_array_equal(np.asarray(qa), _aqt_quant_f32(a, 1))
    np.testing.assert_array_equal(np.asarray(qw), _aqt_quant_f32(w, 0))
    out = _dot(a, w, MATMUL, jnp.float32)
    assert out.dtype == jnp.float32 and out.shape == (3, 5)
    # Measured: max |out - AQT| = 5.3e-7 (AQT divides by 127/amax products, we multiply
    # by amax/127 products: the last-bit differences of the scales show up only here).
    np.testing.assert_allclose(np.asarray(out), AQT_INT8, rtol=0, atol=1e-5)


def test_multiply_vs_divide_rounding():
    # Why quantization multiplies by 127/amax rather than dividing by amax/127: the two
    # float32 computations round differently for some inputs, and AQT multiplies. Find
    # such inputs and check that we give AQT's integers there.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 64)).astype(np.float32)
    amax = np.max(np.abs(x), axis=1, keepdims=True)
    by_mul = np.round(x * (np.float32(127) / amax))
    by_div = np.round(x / (amax / np.float32(127)))
    assert np.any(by_mul != by_div)  # the choice matters, rarely (here 1 of 262144)
    q, _ = int8_quantize(x, (1,))
    np.testing.assert_array_equal(np.asarray(q), by_mul.astype(np.int8))


def test_quantize_axes_and_zero_slices():
    x = np.random.default_rng(1).normal(size=(4, 3, 5)).astype(np.float32)
    x[:, :, 3] = 0.0  # all zero over axes (0, 1)
    q, s = int8_quantize(jnp.asarray(x), (0, -2))
    assert s.shape == (1, 1, 5)
    amax = np.max(np.abs(x), axis=(0, 1), keepdims=True).astype(np.float64)
    s = np.asarray(s, np.float64)
    np.testing.assert_array_equal(s[..., 3], 1.0)  # all-zero slice: scale 1
    np.testing.assert_array_equal(np.asarray(q)[..., 3], 0)
    nz = amax[0, 0] > 0
    np.testing.assert_allclose(s[0, 0, nz], amax[0, 0, nz] / 127, rtol=1e-7)
    q = np.asarray(q, np.float64)
    assert np.max(np.abs(q)) == 127 and np.min(q) >= -127
    # Round to nearest: error at most half a step (plus float32 rounding of the scales).
    assert np.all(np.abs(q * s - x) <= s * (0.5 + 1e-6))
    # The largest element of each slice maps to +-127.
    np.testing.assert_array_equal(np.max(np.abs(q), axis=(0, 1))[nz], 127)
    # bf16 input: same as its float32 value.
    xb = jnp.asarray(x).astype(jnp.bfloat16)
    qb, sb = int8_quantize(xb, (2,))
    qf, sf = int8_quantize(xb.astype(jnp.float32), (2,))
    np.testing.assert_array_equal(np.asarray(qb), np.asarray(qf))
    np.testing.assert_array_equal(np.asarray(sb), np.asarray(sf))


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_int32_accumulation():
    # The GEMM takes int8 operands and produces int32 (jaxpr and StableHLO).
    lhs = jnp.ones((2, 8), jnp.float32)
    rhs = jnp.ones((8, 3), jnp.float32)
    f = lambda a, b: _INT8(a, b, MATMUL, preferred_element_type=jnp.float32)  # noqa: E731
    dots = [e for e in _eqns(jax.make_jaxpr(f)(lhs, rhs).jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    (dot,) = dots
    assert [v.aval.dtype for v in dot.invars] == [jnp.int8, jnp.int8]
    assert dot.outvars[0].aval.dtype == jnp.int32
    hlo = jax.jit(f).lower(lhs, rhs).as_text()
    assert "tensor<2x8xi8>, tensor<8x3xi8>) -> tensor<2x3xi32>" in hlo

    # Numerically: integer sums up to ~1e9 (beyond float32's 2**24 integer range) are
    # exact in int32, then rounded by the float32 conversion and the two scale products
    # (3 roundings: rtol 2e-7). A float32 accumulation of 65536 terms would be off by
    # far more.
    rng = np.random.default_rng(0)
    k = 65536  # 127**2 * k < 2**31
    a = rng.integers(0, 128, size=(4, k)).astype(np.float32)
    b = rng.integers(0, 128, size=(k, 3)).astype(np.float32)
    out = _dot(a, b, MATMUL, jnp.float32)
    lq, ls = int8_quantize(a, (1,))
    rq, rs = int8_quantize(b, (0,))
    exact = np.asarray(lq, np.int64) @ np.asarray(rq, np.int64)
    assert exact.max() > 2**24
    want = exact * np.asarray(ls, np.float64) * np.asarray(rs, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-7, atol=0)


def _einsum_reference(lq, ls, rq, rs, dn) -> np.ndarray:
    """The rescaled dot in float64 with NumPy einsum, subscripts built from `dn`."""
    (lc, rc), (lb, rb) = dn
    letters = iter(string.ascii_letters)
    lsub = [next(letters) for _ in range(lq.ndim)]
    rsub = [next(letters) for _ in range(rq.ndim)]
    for i, j in zip(lc + lb, rc + rb):
        rsub[j] = lsub[i]
    lfree = [lsub[d] for d in range(lq.ndim) if d not in lc + lb]
    rfree = [rsub[d] for d in range(rq.ndim) if d not in rc + rb]
    out = "".join([lsub[d] for d in lb] + lfree + rfree)
    spec = f"{''.join(lsub)},{''.join(rsub)}->{out}"
    # sum_k (lq ls)(rq rs) == ls rs sum_k lq rq, as the scales are constant over k.
    lhs = lq.astype(np.float64) * ls.astype(np.float64)
    rhs = rq.astype(np.float64) * rs.astype(np.float64)
    return np.einsum(spec, lhs, rhs)


CASES = [
    # (lhs shape, rhs shape, dimension numbers)
    ((7, 33), (33, 5), (((1,), (0,)), ((), ()))),  # plain matmul
    ((3, 6, 20), (3, 20, 4), (((2,), (1,)), ((0,), (0,)))),  # batch first
    ((20, 3, 6), (4, 3, 20), (((0,), (2,)), ((1,), (1,)))),  # batch in the middle, contracting first
    ((2, 9, 5, 3, 4), (4, 3, 6, 9, 2), (((1, 4), (3, 0)), ((0, 3), (4, 1)))),  # 2 batch + 2 contracting
    ((4, 16), (4, 16, 3), (((1,), (1,)), ((0,), (0,)))),  # no lhs free dims
    ((5, 8, 2), (8, 3, 2), (((-2,), (0,)), ((-1,), (2,)))),  # negative axes
]


@pytest.mark.parametrize("lshape,rshape,dn", CASES)
def test_dot_general_against_numpy(lshape, rshape, dn):
    rng = np.random.default_rng(len(lshape) * 100 + lshape[0])
    x = (rng.normal(size=lshape) * 3).astype(np.float32)
    y = rng.normal(size=rshape).astype(np.float32)
    (lc, rc), _ = dn
    lq, ls = _quantize(x, lc)
    rq, rs = _quantize(y, rc)
    out, out_bf16 = _dot(x, y, dn, jnp.float32), _dot(x, y, dn, jnp.bfloat16)
    dn_pos = _normalize(dn, x.ndim, y.ndim)
    want_shape = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dn_pos), x, y).shape
    assert out.shape == want_shape and out.dtype == jnp.float32
    want = _einsum_reference(*map(np.asarray, (lq, ls, rq, rs)), dn_pos)
    # float32 rounding of the int32 sum, of ls * rs and of the product: 3 roundings of
    # relative size <= 2**-24 each, so rtol 2e-7 (bound 1.8e-7) and no atol needed
    # (the integer sum is exact).
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-7, atol=0)
    # A bf16 output is the same GEMM, its result cast (one rounding more: rtol 2**-8).
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out_bf16, np.float64), want, rtol=2**-8, atol=0)


def _normalize(dn, lnd, rnd):
    (lc, rc), (lb, rb) = dn
    f = lambda axes, n: tuple(a % n for a in axes)  # noqa: E731
    return ((f(lc, lnd), f(rc, rnd)), (f(lb, lnd), f(rb, rnd)))


def test_sqnr_against_float():
    # int8 with per-row / per-column scales on standard normal data. Each operand's
    # quantization noise is ~uniform with variance step**2 / 12, step = amax / 127, with
    # amax ~ 3.4 over 1024 normals: a per-operand SQNR of 10 log10(12 127**2 / 3.4**2)
    # ~ 42.2 dB; the two independent noises add in the product: ~ 39.2 dB.
    # Measured: 39.15 dB. Threshold 37 dB (2 dB margin). For comparison, one scale per
    # tensor gives 36.8 dB on the same data.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 1024)).astype(np.float32)
    w = rng.normal(size=(1024, 128)).astype(np.float32)
    out = np.asarray(_dot(x, w, MATMUL, jnp.float32), np.float64)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    from helpers import sqnr

    assert sqnr(ref, out) >= 37.0, sqnr(ref, out)


def test_rejects_bad_arguments():
    x = jnp.ones((3, 4), jnp.float32)
    with pytest.raises(ValueError, match="`contracting_axes`"):
        int8_quantize(x, (2,))
    with pytest.raises(ValueError, match="`contracting_axes`"):
        int8_quantize(x, (1, -1))
    with pytest.raises(TypeError, match="`contracting_axes`"):
        int8_quantize(x, ("a",))
    with pytest.raises(TypeError, match="`x`"):
        int8_quantize(jnp.ones((3, 4), jnp.int32), (1,))


def test_a_non_finite_slice_comes_out_as_nan():
    # int8 has no NaN: the slice gets values 0 and an infinite scale, so the NaN shows in
    # the dequantized slice and in the GEMM's row, not as a plausible number.
    x = np.ones((3, 8), np.float32)
    x[1, 2] = np.nan
    x[2, 5] = np.inf
    values, scale = int8_quantize(jnp.asarray(x), (1,))
    assert np.all(np.asarray(values)[1:] == 0) and np.all(np.isinf(np.asarray(scale)[1:]))
    y = fp8ax.Fp8DotGeneral.init(fp8ax.Int8Scaling())(jnp.asarray(x), jnp.ones((8, 4)), MATMUL)
    y = np.asarray(y)
    assert np.all(np.isfinite(y[0])) and np.all(np.isnan(y[1:]))
