"""NVFP4 (`fp8ax.NVFP4Scaling`) against an independent NumPy reference: two-level scales
computed in float32 NumPy arithmetic, E4M3 and E2M1 rounding by ml_dtypes, GEMMs in
float64 from the same quantized blocks; the random Hadamard transform and stochastic
rounding checked for what they promise (orthogonality, reproducibility, unbiasedness)."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from fp8ax._gemm.dense import _rotate
from fp8ax._hadamard import hadamard_16
from fp8ax._rounding import E2M1_GRID, stochastic_round_e2m1

E2M1, E4M3 = ml_dtypes.float4_e2m1fn, ml_dtypes.float8_e4m3fn
DIMS = (((1,), (0,)), ((), ()))
TINY = np.float32(2.0**-126)


def _nan_amax(a, axis=None):
    with np.errstate(invalid="ignore"):
        m = np.max(np.abs(a), axis=axis).astype(np.float32)
    return np.where(np.isnan(a).any(axis=axis), np.float32(np.nan), m)


def reference_quantize(x, tile):
    """`(values, block scales, tensor scale)` as float32: tensor scale = amax * float32(1 /
    2688) (at least 2**-126; 1 if amax is not positive and finite); block scale =
    e4m3(block_amax / (6 * tensor scale)) (at most 448; NaN if not finite); values = x *
    (1 / (block scale * tensor scale)) clipped to +-6, rounded to E2M1 (0 where the block
    scale is 0)."""
    x = np.asarray(x, np.float32)
    amax = _nan_amax(x)
    outer = np.maximum(np.float32(amax * np.float32(1 / 2688)), TINY)
    if not (np.isfinite(amax) and amax > 0):
        outer = np.float32(1)
    counts = tuple(-(-n // t) for n, t in zip(x.shape, tile))
    blocks = np.zeros(counts, np.float32)
    values = np.zeros(x.shape, np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for idx in np.ndindex(*counts):
            sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(idx, tile))
            ratio = np.float32(_nan_amax(x[sl]) / np.float32(np.float32(6) * outer))
            ratio = np.minimum(ratio, np.float32(448)) if np.isfinite(ratio) else np.float32(np.nan)
            block = np.float32(np.asarray(ratio).astype(E4M3).astype(np.float32))
            scale = np.float32(block * outer)
            inv = np.float32(1) / scale if scale > 0 else np.float32(0)
            y = np.clip((x[sl] * inv).astype(np.float32), -6, 6)
            blocks[idx] = block
            values[sl] = y.astype(E2M1).astype(np.float32)
    return values, blocks, np.float32(outer)


def _expand(blocks, tile, shape):
    for d, t in enumerate(tile):
        blocks = np.repeat(blocks, t, axis=d)
    return blocks[tuple(slice(0, n) for n in shape)]


def dequantized(x, tile):
    values, blocks, outer = reference_quantize(x, tile)
    return values.astype(np.float64) * _expand(blocks, tile, x.shape) * np.float64(outer)


@pytest.mark.parametrize(
    "shape,axes,role,tile",
    [
        ((48, 300), (1,), "lhs", (1, 16)),  # 1x16 blocks, the last one partial
        ((300, 200), (0,), "rhs", (16, 16)),  # a weight: 16x16 blocks
        ((260, 40), (1,), "grad", (1, 16)),
        ((260, 48), (0,), "lhs", (16, 1)),  # re-tiled for the weight gradient's GEMM
    ],
)
def test_quantize_matches_reference(shape, axes, role, tile, getkey):
    x = jax.random.normal(getkey(), shape) * jnp.exp(2 * jax.random.normal(getkey(), shape))
    recipe = fp8ax.NVFP4Scaling(stochastic_gradients=False)
    q = recipe.quantize_role(x, axes, role)
    assert q.tile == tile and q.values.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn
    values, blocks, outer = reference_quantize(np.asarray(x), tile)
    assert q.outer_scale.dtype == jnp.float32 and np.float32(q.outer_scale) == outer  # bit for bit
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32), blocks)
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), values)
    # The scales use E4M3's range: the largest block scale is near 448 (its block holds
    # the tensor's amax), and every block's largest value lands near E2M1's 6.
    assert 400 <= blocks.max() <= 448
    np.testing.assert_allclose(np.asarray(q.dequantize(), np.float64), dequantized(np.asarray(x), tile), rtol=1e-6)


def test_special_values():
    x = np.ones((2, 64), np.float32)
    x[0, :16] = 0  # an all-zero block: scale 0 (E4M3 of 0), values 0
    x[1, 16:32] = 1e-9  # far below the tensor's amax: its E4M3 scale underflows, stored as zeros
    x[1, 48] = 1e4  # the amax
    q = fp8ax.NVFP4Scaling().quantize_role(jnp.asarray(x), (1,), "lhs")
    values, blocks, outer = reference_quantize(x, (1, 16))
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32), blocks)
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), values)
    assert blocks[0, 0] == 0 and blocks[1, 1] == 0 and not np.any(values[1, 16:32])
    assert np.all(np.isfinite(np.asarray(q.dequantize())))
    nan = x.copy()
    nan[0, 20] = np.nan  # the tensor scale falls back to 1, the block's scale is NaN
    q = fp8ax.NVFP4Scaling().quantize_role(jnp.asarray(nan), (1,), "lhs")
    deq = np.asarray(q.dequantize())
    assert float(q.outer_scale) == 1 and np.isnan(np.asarray(q.scale, np.float32)[0, 1])
    assert np.all(np.isnan(deq[0, 16:32])) and not np.any(np.isnan(np.delete(deq, np.s_[16:32], axis=1)))


def test_gemms_match_float64(getkey):
    """Forward and input gradient from the reference's quantized blocks (round to nearest,
    no rotation), multiplied in float64: the layer is within float32 accumulation of it."""
    x = jax.random.normal(getkey(), (64, 96))
    w = jax.random.normal(getkey(), (96, 48)) * 0.05
    g = jax.random.normal(getkey(), (64, 48))
    dg = fp8ax.Fp8DotGeneral.init(fp8ax.NVFP4Scaling(hadamard=False, stochastic_gradients=False))
    out, vjp = jax.vjp(lambda x, w: dg(x, w, DIMS), x, w)
    dx, dw = vjp(g)
    xq, wq = dequantized(np.asarray(x), (1, 16)), dequantized(np.asarray(w), (16, 16))
    gq_rows, gq_cols = dequantized(np.asarray(g), (1, 16)), dequantized(np.asarray(g), (16, 1))
    for got, want in ((out, xq @ wq), (dx, gq_rows @ wq.T), (dw, dequantized(np.asarray(x), (16, 1)).T @ gq_cols)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_weight_gradient_is_rotated(getkey):
    """With the Hadamard transform the weight gradient is the float64 GEMM of the rotated
    activation and gradient, each quantized by the reference along the tokens."""
    x = jax.random.normal(getkey(), (64, 96))
    w = jax.random.normal(getkey(), (96, 48)) * 0.05
    g = jax.random.normal(getkey(), (64, 48))
    recipe = fp8ax.NVFP4Scaling(stochastic_gradients=False, seed=3)
    _, vjp = jax.vjp(lambda w: fp8ax.Fp8DotGeneral.init(recipe)(x, w, DIMS), w)
    (dw,) = vjp(g)
    h = np.asarray(recipe.weight_gradient_rotation(), np.float64)
    rx = np.einsum("bnk,jk->bnj", np.asarray(x, np.float64).T.reshape(96, 4, 16), h).reshape(96, 64).T
    rg = np.einsum("bnk,jk->bnj", np.asarray(g, np.float64).T.reshape(48, 4, 16), h).reshape(48, 64).T
    want = dequantized(rx.astype(np.float32), (16, 1)).T @ dequantized(rg.astype(np.float32), (16, 1))
    np.testing.assert_allclose(np.asarray(dw), want, rtol=0, atol=1e-3 * np.abs(want).max())
    # ... and differs from the unrotated one (the rotation is applied at all).
    (dw_plain,) = jax.vjp(
        lambda w: fp8ax.Fp8DotGeneral.init(fp8ax.NVFP4Scaling(stochastic_gradients=False, hadamard=False))(x, w, DIMS),
        w,
    )[1](g)
    assert float(jnp.max(jnp.abs(dw - dw_plain))) > 1e-2 * float(jnp.max(jnp.abs(dw)))


def test_hadamard_is_orthogonal_reproducible_and_keyed():
    h = np.asarray(hadamard_16(jax.random.key(0)), np.float64)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-7)
    np.testing.assert_array_equal(h, np.asarray(hadamard_16(jax.random.key(0))))
    assert not np.array_equal(h, np.asarray(hadamard_16(jax.random.key(1))))
    assert set(np.unique(np.abs(h))) == {0.25}
    # The GEMM of two operands rotated along their contraction is unchanged in exact
    # arithmetic: in float64, to rounding.
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 64, 3)), rng.standard_normal((64, 7))
    ra = np.asarray(_rotate(jnp.asarray(a, jnp.float32), (1,), jnp.asarray(h, jnp.float32)), np.float64)
    rb = np.asarray(_rotate(jnp.asarray(b, jnp.float32), (0,), jnp.asarray(h, jnp.float32)), np.float64)
    np.testing.assert_allclose(np.einsum("akc,kn->acn", ra, rb), np.einsum("akc,kn->acn", a, b), atol=1e-4)
    assert not np.allclose(ra, a)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    y = jnp.asarray([0.1, 0.3, 0.75, 1.2, 2.5, 3.3, 5.0, -4.6, 6.0, 0.0, -0.25], jnp.float32)
    key = jax.random.key(7)
    r = stochastic_round_e2m1(y, key)
    assert r.dtype == jnp.float4_e2m1fn
    np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(stochastic_round_e2m1(y, key), np.float32))
    draws = np.asarray(jax.vmap(lambda k: stochastic_round_e2m1(y, k))(jax.random.split(key, 20000)), np.float32)
    grid = np.asarray(E2M1_GRID)
    a = np.abs(np.asarray(y))
    lo = grid[np.searchsorted(grid, a, side="right") - 1]
    hi = grid[np.minimum(np.searchsorted(grid, a, side="right"), 7)]
    # Only the two neighbours, with the mean at the input: the standard error of 20000
    # draws of a two-point variable is at most (hi - lo) / 2 / sqrt(20000) <= 0.0071.
    assert np.all((np.abs(draws) == lo) | (np.abs(draws) == hi))
    np.testing.assert_allclose(draws.mean(axis=0), np.asarray(y), atol=5 * 0.0071)


def test_switches(getkey):
    """Each trick can be turned off: 1x16 weight blocks, round-to-nearest gradients."""
    r = fp8ax.NVFP4Scaling(two_d_weights=False, stochastic_gradients=False, hadamard=False)
    assert r.tile_for((64, 32), (0,), "rhs") == (16, 1) and not r.contraction_independent("rhs")
    assert not r.stochastic("grad") and r.weight_gradient_rotation() is None
    full = fp8ax.NVFP4Scaling()
    assert full.tile_for((64, 32), (0,), "rhs") == (16, 16) and full.contraction_independent("rhs")
    assert full.stochastic("grad") and not full.stochastic("lhs")
    with pytest.raises(TypeError, match="`hadamard` must be a bool, got 1"):
        fp8ax.NVFP4Scaling(hadamard=1)


def test_serving_stores_packed_values_and_both_scales(getkey):
    """A served NVFP4 MLP: its output is the training forward's, bit for bit; each weight
    is stored as two FP4 codes per byte with its E4M3 block scales (as bits) and its
    float32 tensor scale, about a quarter of the bf16 weights' checkpoint."""
    base = eqx.nn.MLP(64, 16, 128, 2, key=getkey())
    model = fp8ax.fp8_linear_layers(base, fp8ax.Fp8Config(recipe=fp8ax.NVFP4Scaling()))
    served = fp8ax.to_serving(model)
    x = jax.random.normal(getkey(), (8, 64))
    np.testing.assert_array_equal(np.asarray(jax.vmap(served)(x)), np.asarray(jax.vmap(model)(x)))
    layer = served.layers[1]
    assert layer.weight.dtype == jnp.uint8 and layer.weight.shape == (128, 64)  # 128 x 128 values
    dg = layer.dot_general
    assert dg.weight_scale.dtype == jnp.uint8 and dg.weight_scale.shape == (8, 8)  # 16 x 16 blocks
    assert dg.weight_outer_scale.dtype == jnp.float32 and dg.weight_outer_scale.shape == ()

    def size(tree):
        buf = io.BytesIO()
        eqx.tree_serialise_leaves(buf, tree)
        return len(buf.getvalue())

    stored = size([(lyr.weight, lyr.dot_general) for lyr in served.layers])
    bf16 = size([lyr.weight.astype(jnp.bfloat16) for lyr in base.layers])
    assert 0.25 < stored / bf16 < 0.3  # 4 bits + 8 / 256 bits per element + headers, against 16
    # And it round-trips through a checkpoint.
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, served)
    buf.seek(0)
    back = eqx.tree_deserialise_leaves(buf, served)
    np.testing.assert_array_equal(np.asarray(jax.vmap(back)(x)), np.asarray(jax.vmap(model)(x)))


def test_block_scaled_gemm_layout(getkey, monkeypatch):
    """`block_scaled_gemm=True` hands the three NVFP4 GEMMs to `jax.nn.scaled_matmul`
    (E2M1 values, an E4M3 scale per 16 elements of K, the 16x16 weight blocks repeated per
    row) and multiplies by the two tensor scales; with the function's documented
    definition in its place (JAX lowers it for GPUs only) forward and gradients equal the
    dequantized GEMMs (float32 sums of the same exact products: within 1e-6 of the
    largest entry)."""
    from test_mx import _documented_scaled_matmul

    calls = []

    def fake(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type=jnp.float32):
        calls.append((lhs.dtype, lhs_scales.dtype, lhs.shape[-1] // lhs_scales.shape[-1]))
        return _documented_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type)

    monkeypatch.setattr(jax.nn, "scaled_matmul", fake)
    x = jax.random.normal(getkey(), (64, 96))
    w = jax.random.normal(getkey(), (96, 48)) * 0.05
    g = jax.random.normal(getkey(), (64, 48))
    results = {}
    for flag in (True, False):
        dg = fp8ax.Fp8DotGeneral.init(fp8ax.NVFP4Scaling(), block_scaled_gemm=flag)
        out, vjp = jax.vjp(lambda x, w: dg(x, w, DIMS), x, w)
        results[flag] = (out, *vjp(g))
    assert calls == [(jnp.float4_e2m1fn, jnp.float8_e4m3fn, 16)] * 3
    for got, want in zip(results[True], results[False]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))
