"""Stateless recipes through Fp8DotGeneral: CurrentScaling (tensor / row), MXScaling,
Int8Scaling, per-operand recipes, high-precision GEMMs, stochastic rounding, quantize().

References are NumPy/ml_dtypes computations written here. Outputs of GEMMs on quantized
operands are compared to a float64 product of the same quantized values times the
scales, to float32 rounding (rtol 1e-5 relative to the largest output).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import sqnr

DIMS = (((1,), (0,)), ((), ()))


def _ref_fp8(x, scale, ml_dtype, bound):
    x = np.asarray(x, np.float32)
    return np.clip(x * (np.float32(1.0) / scale), -bound, bound).astype(ml_dtype).astype(np.float64)


def _close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("power_of_two", [False, True])
def test_current_scaling_forward_matches_numpy(granularity, power_of_two, getkey):
    x = jax.random.normal(getkey(), (6, 8)) * jnp.arange(1.0, 7.0)[:, None]
    w = jax.random.normal(getkey(), (8, 5))
    dg = fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling(granularity, power_of_two))
    y = dg(x, w, DIMS)
    xn, wn = np.asarray(x), np.asarray(w)
    if granularity == "tensor":
        ax, aw = np.abs(xn).max(keepdims=True), np.abs(wn).max(keepdims=True)
    else:
        ax, aw = np.abs(xn).max(1, keepdims=True), np.abs(wn).max(0, keepdims=True)
    sx, sw = (a.astype(np.float32) * np.float32(1 / 448) for a in (ax, aw))
    if power_of_two:
        sx, sw = (np.exp2(np.ceil(np.log2(s))).astype(np.float32) for s in (sx, sw))
    want = (_ref_fp8(xn, sx, ml_dtypes.float8_e4m3fn, 448) @ _ref_fp8(wn, sw, ml_dtypes.float8_e4m3fn, 448)) * sx * sw
    _close(y, want)
    # Stateless: nothing to overwrite.
    assert jax.tree.leaves(fp8ax.partition_for_grad_overwrite(dg)[0]) == []


def test_row_scaling_beats_tensor_scaling_on_outlier_rows(getkey):
    x = jax.random.normal(getkey(), (64, 128)).at[3].multiply(1e5)
    w = jax.random.normal(getkey(), (128, 32))
    ref = x @ w
    got = {
        g: sqnr(
            np.asarray(ref)[np.arange(64) != 3],
            np.asarray(fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling(g))(x, w, DIMS))[np.arange(64) != 3],
        )
        for g in ("tensor", "row")
    }
    # Row-wise keeps the ordinary rows at E4M3's ~28 dB; one tensor-wise scale set by a
    # row 1e5 times larger puts them in E4M3's subnormal range (and below).
    assert got["row"] > 25 > got["tensor"] + 5, got


@pytest.mark.parametrize(
    "recipe",
    [fp8ax.CurrentScaling("tensor"), fp8ax.CurrentScaling("row"), fp8ax.MXScaling(8), fp8ax.Int8Scaling()],
    ids=lambda r: type(r).__name__ + (getattr(r, "granularity", "")),
)
def test_gradients_follow_the_quantized_backward_gemms(recipe, getkey):
    # The backward GEMMs quantize g and the operands again along their own contracting
    # axes; compare with quantizing by hand and multiplying in float64.
    x = jax.random.normal(getkey(), (16, 24))
    w = jax.random.normal(getkey(), (24, 8))
    gy = jax.random.normal(getkey(), (16, 8))
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(dg(x, w, DIMS) * gy), argnums=(0, 1)))(x, w)

    def deq(a, axis, grad):
        q = jax.jit(lambda a: fp8ax.quantize(a, recipe, axis, grad=grad).dequantize(jnp.float32))(a)
        return np.asarray(q, np.float64)

    want_dx = deq(gy, 1, True) @ deq(w, 1, False).T  # contracts the output features
    want_dw = deq(x, 0, False).T @ deq(gy, 0, True)  # contracts the batch
    _close(dx, want_dx)
    _close(dw, want_dw)
    # ...and they are close to the float32 gradients (E5M2/int8 gradient noise).
    assert sqnr(x.T @ gy @ jnp.eye(8), dw) > 15


def test_aqt_worked_example_through_the_module():
    # The seed's "How AQT Works Internally" example: per-row int8 activations, per-column
    # int8 weights, int32 accumulation. Expected values printed in the AQT README.
    def gen_matrix(rows, columns, seed=0):
        np.random.seed(seed)
        return np.random.normal(size=(rows, columns)).reshape((rows, columns))

    a = jnp.asarray(gen_matrix(3, 4), jnp.float32)
    w = jnp.asarray(gen_matrix(4, 5), jnp.float32)
    got = fp8ax.Fp8DotGeneral.init(fp8ax.Int8Scaling())(a, w, DIMS)
    want = np.array(
        [
            [3.5998788, 5.8562713, 1.9385538, 4.7426414, 1.9792401],
            [4.321886, 0.99681264, 2.737299, 4.3591022, 3.6352503],
            [-0.07714217, 2.7415617, -0.35343346, 0.20568734, -1.1974115],
        ]
    )
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # The GEMM itself is int8 x int8 -> int32.
    text = jax.jit(lambda a, w: fp8ax.Fp8DotGeneral.init(fp8ax.Int8Scaling())(a, w, DIMS)).lower(a, w).as_text()
    assert "tensor<3x4xi8>" in text and "-> tensor<3x5xi32>" in text


def test_per_operand_recipes_and_high_precision_gemms(getkey):
    x = jax.random.normal(getkey(), (16, 24))
    w = jax.random.normal(getkey(), (24, 8))
    gy = jax.random.normal(getkey(), (16, 8))

    def grads(**kw):
        dg = fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling("row"), **kw)

        @jax.jit
        def run(x, w):
            return (dg(x, w, DIMS), *jax.grad(lambda x, w: jnp.sum(dg(x, w, DIMS) * gy), argnums=(0, 1))(x, w))

        return run(x, w)

    y, dx, dw = grads(high_precision_gemms=("drhs",))  # torchao's rowwise_with_gw_hp
    np.testing.assert_allclose(np.asarray(dw), np.asarray(x.T @ gy), rtol=1e-5, atol=1e-5)
    assert sqnr(x.T @ gy, grads()[2]) < 40  # quantized when not excluded
    y, dx, dw = grads(lhs_recipe="off", rhs_recipe="off")  # only the gradient quantized
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    y, dx, dw = grads(grad_recipe="off")
    np.testing.assert_allclose(
        np.asarray(dw),
        np.asarray(fp8ax.quantize(x, fp8ax.CurrentScaling("row"), 0).dequantize().T @ gy),
        rtol=1e-5,
        atol=1e-5,
    )
    # Another recipe for one operand: the kernel in MX.
    y, _, _ = grads(rhs_recipe=fp8ax.MXScaling(8))
    qx = fp8ax.quantize(x, fp8ax.CurrentScaling("row"), 1).dequantize()
    qw = fp8ax.quantize(w, fp8ax.MXScaling(8), 0).dequantize()
    _close(y, np.asarray(qx, np.float64) @ np.asarray(qw, np.float64))
    with pytest.raises(ValueError, match="need a stateless `recipe`"):
        fp8ax.Fp8Config(high_precision_gemms=("drhs",))
    with pytest.raises(ValueError, match="`high_precision_gemms` must be a sequence of names"):
        fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), high_precision_gemms=("wgrad",))
    with pytest.raises(TypeError, match="`lhs_recipe` must be None"):
        fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling(), lhs_recipe=fp8ax.DelayedScaling())


def test_stochastic_rounding_of_gradients(getkey):
    recipe = fp8ax.CurrentScaling(grad_rounding="stochastic", seed=3)
    g = jax.random.normal(getkey(), (64, 32))
    # Reproducible given the key; a different key rounds differently; unbiased.
    q1 = fp8ax.quantize(g, recipe, 1, grad=True, key=jax.random.key(0)).dequantize()
    q2 = fp8ax.quantize(g, recipe, 1, grad=True, key=jax.random.key(0)).dequantize()
    q3 = fp8ax.quantize(g, recipe, 1, grad=True, key=jax.random.key(1)).dequantize()
    np.testing.assert_array_equal(np.asarray(q1), np.asarray(q2))
    assert not np.array_equal(np.asarray(q1), np.asarray(q3))
    keys = jax.random.split(jax.random.key(9), 2000)
    many = jax.jit(jax.vmap(lambda k: fp8ax.quantize(g, recipe, 1, grad=True, key=k).dequantize()))
    mean = jnp.mean(many(keys), axis=0)
    nearest = fp8ax.quantize(g, fp8ax.CurrentScaling(), 1, grad=True).dequantize()
    # The mean of 2000 roundings is much closer to g than round-to-nearest is.
    assert float(jnp.max(jnp.abs(mean - g))) < 0.2 * float(jnp.max(jnp.abs(nearest - g)))
    # In the module the key comes from the gradient's contents: a new gradient (a new
    # step) rounds with a new key, the same gradient reproduces.
    x, w = jax.random.normal(getkey(), (64, 16)), jax.random.normal(getkey(), (16, 32))
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    dw = jax.grad(lambda w, gy: jnp.sum(dg(x, w, DIMS) * gy))
    np.testing.assert_array_equal(np.asarray(dw(w, g)), np.asarray(dw(w, g)))
    near = fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling())
    dw_near = jax.grad(lambda w, gy: jnp.sum(near(x, w, DIMS) * gy))
    assert not np.array_equal(np.asarray(dw(w, g)), np.asarray(dw_near(w, g)))
    with pytest.raises(ValueError, match="`key` is required"):
        fp8ax.quantize(g, recipe, 1, grad=True)


def test_quantize_api(getkey):
    x = jax.random.normal(getkey(), (8, 64))
    q = fp8ax.quantize(x, fp8ax.CurrentScaling("row"), axis=1)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (8, 1) and q.scale.dtype == jnp.float32
    assert q.dequantize(jnp.bfloat16).dtype == jnp.bfloat16
    assert sqnr(x, q.dequantize()) > 25
    mx = fp8ax.quantize(x, fp8ax.MXScaling(), axis=1)
    assert mx.values.shape == (8, 64) and mx.scale.shape == (8, 2) and mx.scale.dtype == jnp.float8_e8m0fnu
    i8 = fp8ax.quantize(x, fp8ax.Int8Scaling(), axis=1)
    assert i8.values.dtype == jnp.int8 and i8.scale.shape == (8, 1)
    assert fp8ax.quantize(x, fp8ax.CurrentScaling(formats="e4m3"), grad=True).values.dtype == jnp.float8_e4m3fn
    assert fp8ax.quantize(x, fp8ax.CurrentScaling(), grad=True).values.dtype == jnp.float8_e5m2
    assert fp8ax.quantize(x, fp8ax.CurrentScaling(fwd_dtype=jnp.float8_e4m3fnuz)).values.dtype == jnp.float8_e4m3fnuz
    assert fp8ax.DelayedScaling(formats="e4m3").grad_dtype == jnp.float8_e4m3fn
    assert fp8ax.DelayedScaling().grad_dtype == jnp.float8_e5m2
    with pytest.raises(TypeError, match="`recipe` must be a stateless recipe"):
        fp8ax.quantize(x, fp8ax.DelayedScaling())
    with pytest.raises(ValueError, match="`axis` must name axes of `x`"):
        fp8ax.quantize(x, fp8ax.CurrentScaling(), axis=2)
    with pytest.raises(TypeError, match="`x` must be a floating-point array"):
        fp8ax.quantize(jnp.arange(3), fp8ax.CurrentScaling())
    with pytest.raises(ValueError, match="`granularity` must be 'tensor' or 'row'"):
        fp8ax.CurrentScaling("block")
    with pytest.raises(ValueError, match="`formats` must be 'hybrid'"):
        fp8ax.CurrentScaling(formats="e5m2")
    with pytest.raises(ValueError, match="`fwd_element` must be one of"):
        fp8ax.MXScaling(fwd_element="e8m0")


# The recipe-generic tests (transforms, a stacked Haliax model, SQNR, the reference
# conformance) run over tests/recipe_registry.py, in tests/test_recipe_conformance.py.


def test_mx_contracting_dim_not_a_multiple_of_the_block(getkey):
    # K = 70 with blocks of 32: the last block is zero-padded for its scale only.
    x = jax.random.normal(getkey(), (5, 70))
    w = jax.random.normal(getkey(), (70, 3))
    recipe = fp8ax.MXScaling()
    y = jax.jit(lambda x, w: fp8ax.Fp8DotGeneral.init(recipe)(x, w, DIMS))(x, w)
    qx = jax.jit(lambda x: fp8ax.quantize(x, recipe, 1))(x)
    qw = jax.jit(lambda w: fp8ax.quantize(w, recipe, 0))(w)
    assert qx.scale.shape == (5, 3) and qw.scale.shape == (3, 3)
    _close(y, np.asarray(qx.dequantize(), np.float64) @ np.asarray(qw.dequantize(), np.float64))


@pytest.mark.parametrize(
    "fmt,ml",
    [
        (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        (jnp.float8_e5m2, ml_dtypes.float8_e5m2),
        (jnp.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz),
    ],
)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_current_scaling_values_are_bit_exact(fmt, ml, granularity, getkey):
    x = jax.random.normal(getkey(), (16, 40)) * jnp.exp(jax.random.normal(getkey(), (16, 1)) * 3)
    q = fp8ax.quantize(x, fp8ax.CurrentScaling(granularity, fwd_dtype=fmt), axis=1)
    xn = np.asarray(x)
    amax = np.abs(xn).max(axis=None if granularity == "tensor" else 1, keepdims=True).astype(np.float32)
    bound = float(ml_dtypes.finfo(ml).max)
    scale = amax * np.float32(1.0 / bound)
    want = np.clip(xn * (np.float32(1.0) / scale), -bound, bound).astype(ml)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(q.scale), scale.shape), scale)


def _ref_current_scale(amax, bound, power_of_two):
    """float32 NumPy reference of CurrentScaling's scale: amax / bound (one float32
    multiply by float32(1 / bound)), at least 2**-126, the next power of two (from
    `frexp`, exact) with `power_of_two`; 1 for an amax that is not positive and finite."""
    amax = np.asarray(amax, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        scale = np.maximum(amax * np.float32(1.0 / bound), np.float32(2.0**-126))
        if power_of_two:
            m, e = np.frexp(scale)
            scale = np.where(m == 0.5, scale, np.ldexp(np.float32(1.0), e)).astype(np.float32)
        ok = np.isfinite(amax) & (amax > 0)
    return np.where(ok, scale, np.float32(1.0)).astype(np.float32)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_power_of_two_scales_are_exact_powers_of_two(granularity):
    # Every amax from 2**-60 to 2**60, on and between powers of two: the scale is a power
    # of two exactly (mantissa 0.5 in frexp), the smallest one >= amax / 448. (exp2 of
    # ceil of log2 missed on 174 of 240 such amaxes: 2**-48 * 0.99999988, ...)
    amaxes = np.array([m * 2.0**e for e in range(-60, 61) for m in (1.0, 1.37, 1.9999)], np.float32)
    x = jnp.asarray(np.stack([amaxes, -amaxes / 3], axis=1))  # each row's amax is its first entry
    recipe = fp8ax.CurrentScaling(granularity, power_of_two=True)
    if granularity == "tensor":
        scales = np.array([float(fp8ax.quantize(x[i : i + 1], recipe).scale) for i in range(0, len(amaxes), 7)])
        want = _ref_current_scale(amaxes[::7], 448.0, True)
    else:
        scales = np.asarray(fp8ax.quantize(x, recipe, axis=1).scale)[:, 0]
        want = _ref_current_scale(amaxes, 448.0, True)
    np.testing.assert_array_equal(scales, want)
    assert (np.frexp(scales)[0] == 0.5).all()


def test_power_of_two_gemm_of_representable_values_is_exact(getkey):
    # Values that are E4M3 numbers times a power of two quantize exactly with power-of-two
    # scales, so the FP8 GEMM equals the float32 one (small integers: exact sums).
    grid = jnp.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -4.0, 6.0, -8.0, 12.0], jnp.float32)
    x = grid[jax.random.randint(getkey(), (16, 32), 0, 10)] * 2.0**-20
    w = grid[jax.random.randint(getkey(), (32, 8), 0, 10)] * 2.0**9
    for granularity in ("tensor", "row"):
        dg = fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling(granularity, power_of_two=True))
        np.testing.assert_array_equal(np.asarray(dg(x, w, DIMS)), np.asarray(jax.lax.dot_general(x, w, DIMS)))


@pytest.mark.parametrize("granularity,power_of_two", [("tensor", False), ("row", False), ("tensor", True)])
def test_a_tiny_tensor_is_not_flushed_to_zero(granularity, power_of_two, getkey):
    # Normal float32 values with amax below 448 * 2**-126 (about 5.3e-36): amax / 448 is
    # subnormal, which XLA flushes to zero; the scale is 2**-126 instead of falling back
    # to 1 (which turned the whole tensor into zeros).
    x = jax.random.normal(getkey(), (8, 16)) * 1e-37
    q = fp8ax.quantize(x, fp8ax.CurrentScaling(granularity, power_of_two), axis=1)
    xn = np.asarray(x)
    amax = np.abs(xn).max(axis=None if granularity == "tensor" else 1, keepdims=True)
    scale = _ref_current_scale(amax, 448.0, power_of_two)
    assert (scale == np.float32(2.0**-126)).all()
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(q.scale), scale.shape), scale)
    want = np.clip(xn * (np.float32(1.0) / scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), want.view(np.uint8))
    assert np.count_nonzero(np.asarray(q.values, np.float32)) > 0.9 * xn.size


@pytest.mark.parametrize("shape", [(4, 8), (256, 1024)])
def test_a_nan_gives_the_same_scale_whatever_the_size(shape):
    # XLA:CPU's max of a large array skips NaNs; CurrentScaling takes the amax that does
    # not: a tensor (or row) holding a NaN gets scale 1 at any size, the others theirs.
    x = jnp.ones(shape).at[1, 1].set(jnp.nan) * 3.0
    assert float(fp8ax.quantize(x, fp8ax.CurrentScaling()).scale) == 1.0
    rows = np.asarray(fp8ax.quantize(x, fp8ax.CurrentScaling("row"), axis=1).scale)[:, 0]
    assert rows[1] == 1.0
    np.testing.assert_array_equal(np.delete(rows, 1), np.float32(3.0) * np.float32(1 / 448))


def test_mx_default_is_mxfp8_as_trained():
    recipe = fp8ax.MXScaling()
    assert recipe.scale_rule == "ceil" and recipe.block_size == 32
    assert recipe.fwd_dtype == jnp.float8_e4m3fn and recipe.grad_dtype == jnp.float8_e4m3fn
    # A block whose amax has significand 1.9 (15.2 = 1.9 * 2**3), replayed by hand:
    # rounded up, the scale is 2**ceil(log2(15.2 / 448)) = 2**-4, 15.2 * 16 = 243.2 rounds
    # to 240 in E4M3 (spacing 16 there): 15.0. The OCP floor rule takes 2**(3 - 8), and
    # 15.2 * 32 = 486.4 saturates to 448: 14.0. The other values (0.5) are exact in both.
    x = jnp.full((32,), 0.5, jnp.float32).at[0].set(15.2)
    up = np.asarray(fp8ax.quantize(x, recipe, 0).dequantize())
    floor = np.asarray(fp8ax.quantize(x, fp8ax.MXScaling(grad_element="e5m2", scale_rule="floor"), 0).dequantize())
    assert up[0] == 15.0 and floor[0] == 14.0
    np.testing.assert_array_equal(up[1:], 0.5)
    np.testing.assert_array_equal(floor[1:], 0.5)
