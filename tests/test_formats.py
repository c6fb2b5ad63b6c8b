"""Quantization against ml_dtypes casting (an independent implementation of the formats)."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8ax import _formats

FORMATS = [
    (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
    (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0),
    (jnp.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz, 240.0),
    (jnp.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz, 57344.0),
]


def _reference(x: np.ndarray, scale: float, ml_dtype, bound: float) -> np.ndarray:
    # float32 multiply by the float32 reciprocal of the scale, then a saturating
    # round-to-nearest-even cast, all in NumPy/ml_dtypes. Non-finite inputs (NaN, +-inf)
    # become NaN in every format.
    x = x.astype(np.float32)
    scaled = x * (np.float32(1.0) / np.float32(scale))
    return np.where(np.isfinite(x), np.clip(scaled, -bound, bound), np.float32(np.nan)).astype(ml_dtype)


def _special_values(ml_dtype) -> np.ndarray:
    info = ml_dtypes.finfo(ml_dtype)
    tiny = float(info.smallest_subnormal)
    normal = float(info.smallest_normal)
    big = float(info.max)
    vals = [
        0.0,
        -0.0,
        np.nan,
        1.0,
        -1.0,
        big,
        -big,
        big * 1.01,
        -big * 4,
        1e30,
        -1e30,
        np.inf,
        -np.inf,  # saturation
        tiny,
        -tiny,
        tiny * 0.5,
        tiny * 0.49,
        tiny * 1.5,
        tiny * 2.5,  # subnormals and ties
        normal,
        normal * 0.75,
        -normal * 0.5,
    ]
    return np.array(vals, np.float32)


@pytest.mark.parametrize("jdtype,mldtype,bound", FORMATS)
def test_fp8_max(jdtype, mldtype, bound):
    assert _formats.fp8_max(np.dtype(jdtype)) == bound == float(ml_dtypes.finfo(mldtype).max)


@pytest.mark.parametrize("jdtype,mldtype,bound", FORMATS)
@pytest.mark.parametrize("scale", [1.0, 0.25, 3.7e-3, 1000.0])
def test_quantize_bit_exact(jdtype, mldtype, bound, scale, getkey):
    # Random normals spanning many binades, plus every special case, times the scale so
    # that the special values hit the format after division.
    x = np.asarray(jax.random.normal(getkey(), (4096,), jnp.float32)) * np.float32(bound / 3)
    x = np.concatenate([x, _special_values(mldtype)]) * np.float32(scale)
    got = np.asarray(jax.jit(_formats.quantize, static_argnums=2)(x, jnp.float32(scale), np.dtype(jdtype)))
    want = _reference(x, scale, mldtype, bound)
    # NaN where the input is not finite (its sign and encoding are the platform's); every
    # other element bit for bit (which tells -0 from 0).
    nan = ~np.isfinite(x)
    assert np.isnan(want[nan].astype(np.float32)).all() and np.isnan(got[nan].astype(np.float32)).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint8), want[~nan].view(np.uint8))
    assert not np.isnan(got[~nan].astype(np.float32)).any()


@pytest.mark.parametrize("jdtype,mldtype,bound", FORMATS[:2])
def test_quantize_saturates_and_keeps_non_finite(jdtype, mldtype, bound):
    x = jnp.array([1e6, -1e6, jnp.inf, -jnp.inf, jnp.nan, -0.0], jnp.float32)
    q = np.asarray(_formats.quantize(x, jnp.float32(1.0), np.dtype(jdtype)), np.float32)
    assert q[0] == bound and q[1] == -bound  # finite overflow is clipped, not inf
    # A real inf stays non-finite: NaN, in E5M2 (which has an inf) too.
    assert np.isnan(q[2]) and np.isnan(q[3])
    assert np.isnan(q[4])
    assert q[5] == 0 and np.signbit(q[5])  # negative zero survives


@pytest.mark.parametrize("scale", [1.0, 3.7e-3, 1000.0])
def test_quantize_with_a_given_reciprocal_is_the_same(scale, getkey):
    # Delayed scaling passes `inv = reciprocal(scale)` computed beside the scale; the
    # result must be the ml_dtypes reference bit for bit, as without it.
    x = np.asarray(jax.random.normal(getkey(), (512,), jnp.float32) * 40.0)
    s = jnp.float32(scale)
    got = np.asarray(_formats.quantize(x, s, np.dtype(jnp.float8_e4m3fn), inv=_formats.reciprocal(s)))
    want = _reference(x, scale, ml_dtypes.float8_e4m3fn, 448.0)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("shape", [(256, 1024), (4096, 1024), (8, 64, 512)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_amax_counts_a_nan_as_inf_in_a_large_tensor(dtype, shape, getkey):
    # The CPU reduction kernel for large arrays skips NaNs; fp8ax's amax must not, also
    # where it is compiled next to the tensor's FP8 cast (as in a training step).
    x = jax.random.normal(getkey(), shape, jnp.float32)
    want = np.abs(np.asarray(x.astype(dtype), np.float32)).max()
    with_cast = jax.jit(
        lambda x: (_formats.amax(x), _formats.quantize(x, jnp.float32(0.5), np.dtype(jnp.float8_e4m3fn)))
    )
    one_stage = jax.jit(lambda x: _formats._amax_nan_as_inf(x, two_stage=False))
    two_stage = jax.jit(lambda x: _formats._amax_nan_as_inf(x, two_stage=True))
    for fn in (jax.jit(_formats.amax), lambda x: with_cast(x)[0], one_stage, two_stage):
        assert float(fn(x.astype(dtype))) == want
        for where in ((0,) * len(shape), tuple(n // 3 for n in shape), tuple(n - 1 for n in shape)):
            assert float(fn(x.at[where].set(jnp.nan).astype(dtype))) == np.inf, where
            assert float(fn(x.at[where].set(-jnp.inf).astype(dtype))) == np.inf, where


@pytest.mark.parametrize(
    "shape, reductions",
    [((256, 1024), 1), ((8, 64, 512), 1), ((512, 1024), 2), ((4096, 1024), 2), ((2**19,), 1)],
)
def test_the_cpu_amax_reduces_in_two_stages_from_2_to_the_19_elements(shape, reductions):
    # Below 2**19 elements the second stage only costs compile time (see `amax`); a 1-D
    # tensor has no rows to split.
    traced = jax.jit(_formats.amax).trace(jax.ShapeDtypeStruct(shape, jnp.float32))
    text = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert len(re.findall(r"stablehlo\.reduce[( ]", text)) == reductions


@pytest.mark.parametrize("axes", [(1,), (0, 2), (2,)])
def test_amax_over_some_axes(axes, getkey):
    # Per row (CurrentScaling's row-wise scales): NumPy's max over the same axes, kept as
    # size-1 dims with `keepdims`, and inf for the slices that hold a NaN or an inf,
    # including in a large array (where XLA:CPU's plain max skips NaNs).
    x = jax.random.normal(getkey(), (64, 48, 40), jnp.float32)
    x = x.at[3, 5, 7].set(jnp.nan).at[10, 20, 30].set(-jnp.inf)
    xn = np.abs(np.asarray(x))
    bad = np.isnan(xn).any(axis=axes, keepdims=True) | np.isinf(xn).any(axis=axes, keepdims=True)
    want = np.where(bad, np.inf, np.nanmax(np.where(np.isinf(xn), 0, xn), axis=axes, keepdims=True))
    got = jax.jit(lambda x: _formats.amax(x, axes, keepdims=True))(x)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert jax.jit(lambda x: _formats.amax(x, axes))(x).shape == np.squeeze(want, axes).shape
    # The form other platforms lower (whose max propagates NaN there; XLA:CPU's may skip
    # it, so only the finite slices are compared here).
    plain = np.asarray(_formats._amax_plain(x, axes=axes, keepdims=True))
    np.testing.assert_array_equal(plain[~bad], want[~bad])


@pytest.mark.parametrize("shape", [(), (5,), (0, 3), (3, 0), (1, 7), (2, 3, 4)])
def test_amax_of_small_and_empty_tensors(shape, getkey):
    # Both reduction strategies against NumPy (an empty tensor has amax -inf, as `max`
    # with its identity; no recipe records it).
    x = np.asarray(jax.random.normal(getkey(), shape, jnp.float32))
    want = np.abs(x).max() if x.size else -np.inf
    for two_stage in (False, True):
        assert float(_formats._amax_nan_as_inf(jnp.asarray(x), two_stage=two_stage)) == want
    # The form every other platform lowers (a plain max, which propagates NaN there).
    assert float(_formats._amax_plain(jnp.asarray(x))) == want


def test_quantize_bf16_input_is_exact_in_f32(getkey):
    # bf16 inputs are divided in float32, so the result equals quantizing the f32 value.
    x = jax.random.normal(getkey(), (1024,), jnp.float32).astype(jnp.bfloat16)
    got = np.asarray(_formats.quantize(x, jnp.float32(0.013), np.dtype(jnp.float8_e4m3fn)))
    want = _reference(np.asarray(x, np.float32), 0.013, ml_dtypes.float8_e4m3fn, 448.0)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_dequantize_round_trip(getkey):
    # Cast round trip SQNR (torchao's bound for casts: >= 25 dB); E4M3 gives ~31 dB on normals.
    x = jax.random.normal(getkey(), (4096,), jnp.float32)
    scale = jnp.max(jnp.abs(x)) / 448.0
    q = _formats.quantize(x, scale, np.dtype(jnp.float8_e4m3fn))
    y = np.asarray(q, np.float32) * np.float32(scale)  # dequantized in NumPy
    from helpers import sqnr

    assert sqnr(x, y) >= 25.0


def test_as_fp8_dtype_rejects_non_fp8():
    for bad in (jnp.bfloat16, jnp.int8, "float32", "nonsense", None):
        with pytest.raises(TypeError, match="`fwd_dtype` must be an 8-bit floating-point dtype"):
            _formats.as_fp8_dtype(bad, "fwd_dtype")


def test_computed_once_keeps_every_value_bit_for_bit():
    # NaN, infinities, signed zeros, the smallest subnormal and the largest float32, and
    # booleans, in a tree of scalars and small arrays: the reduction against -inf returns
    # each of them unchanged. A subnormal may come back as a zero of its sign: XLA:CPU
    # runs its kernels with subnormals flushed to zero (`x * 1` flushes them too), and
    # the max is only skipped where LLVM folds it away (XLA's default optimisation; the
    # suite's -O0, tests/conftest.py, runs it). fp8ax's scales are never subnormal (they
    # are at least the smallest normal float32, `DelayedScaling._checked`).
    specials = np.array(
        [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.0, 448.0], np.float32
    )
    tree = {
        "vector": specials,
        "scalar": np.float32(-0.0),
        "flags": np.array([True, False, True]),
        "flag": np.bool_(False),
        "matrix": specials[:10].reshape(2, 5),
        "count": np.int32(7),  # not float32 or bool: passed through
        "none": None,
    }
    out = jax.jit(_formats.computed_once)(tree)
    assert out["none"] is None
    for key in ("vector", "scalar", "matrix"):
        got = np.asarray(out[key])
        assert got.dtype == np.float32 and got.shape == np.shape(tree[key])
        want = np.asarray(tree[key], np.float32)
        subnormal = (want != 0) & (np.abs(want) < np.finfo(np.float32).tiny)
        flushed = np.where(subnormal & (got == 0) & (np.signbit(got) == np.signbit(want)), got, want)
        np.testing.assert_array_equal(got.view(np.uint32), flushed.view(np.uint32))
    for key in ("flags", "flag", "count"):
        assert np.asarray(out[key]).dtype == np.asarray(tree[key]).dtype
        np.testing.assert_array_equal(np.asarray(out[key]), tree[key])


def _chain(v):
    # A chain of cheap scalar operations, as a delayed scale is.
    for i in range(20):
        v = jax.lax.select(v > np.float32(i / 100), v * np.float32(1.0001) + np.float32(0.5), v - np.float32(0.25))
    return v


@pytest.mark.parametrize("shape", [(), (3,)])
def test_computed_once_keeps_a_scalar_chain_out_of_its_readers(shape):
    # Six scaled casts, each before a GEMM, read the chain's result. XLA:CPU copies the
    # chain into each of their fusions (6 x 20 selects); behind `computed_once` it is
    # computed once (20). The count is of the optimized program, the thing
    # `computed_once` exists to change.
    def step(state, xs, once):
        v = _chain(state)
        if once:
            v = _formats.computed_once(v)
        scaled = [x * (v if v.ndim == 0 else v[i % 3]) for i, x in enumerate(xs)]
        return [s.astype(jnp.float8_e4m3fn).astype(jnp.float32) @ x.T for s, x in zip(scaled, xs)]

    state = jnp.ones(shape, jnp.float32)
    xs = [jnp.full((64, 64), i, jnp.float32) for i in range(6)]
    selects = {}
    for once in (False, True):
        text = jax.jit(step, static_argnums=2).lower(state, xs, once).compile().as_text()
        selects[once] = text.count(" select(")
    assert selects[True] <= 20 + 6, selects  # the chain once (and a select per cast at most)
    assert selects[False] >= 6 * 20, selects  # (XLA still copies the chain without it)
    a = jax.jit(step, static_argnums=2)(state, xs, False)
    b = jax.jit(step, static_argnums=2)(state, xs, True)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))


@pytest.mark.parametrize("count", [1, 3])
def test_max_min_each_matches_numpy_and_propagates_nan(count):
    # Delayed scaling reduces a call's histories in one variadic reduction
    # (`max_min_each`); each result must be that history's own max and min, and a NaN
    # anywhere in a history must show in both (a corrupt state), as NumPy's do.
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((2, 1024)).astype(np.float32) for _ in range(count)]
    xs[-1][1, 17] = np.nan
    for keepdims in (False, True):
        # (With `keepdims`, each result keeps the reduced axis, size 1: how the plan
        # concatenates the operands' bounds.)
        got = jax.jit(lambda *a, k=keepdims: _formats.max_min_each(list(a), keepdims=k))(*xs)
        assert len(got) == count
        for x, (hi, lo) in zip(xs, got):
            # exact: a max or a min picks an element
            np.testing.assert_array_equal(np.asarray(hi), x.max(axis=-1, keepdims=keepdims), strict=True)
            np.testing.assert_array_equal(np.asarray(lo), x.min(axis=-1, keepdims=keepdims), strict=True)
