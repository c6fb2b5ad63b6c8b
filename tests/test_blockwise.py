"""DeepSeek-style blockwise FP8 (`fp8ax.BlockwiseScaling`) against an independent NumPy
reference: tiles quantized with float32 arithmetic and ml_dtypes' E4M3 rounding, GEMMs
computed in float64 chunk by chunk from the same quantized tiles."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import adam_trained

E4M3 = ml_dtypes.float8_e4m3fn
DIMS = (((1,), (0,)), ((), ()))


def reference_quantize(x, tile, power_of_two=False):
    """`(values as float32, scales)` of `x` cut into tiles of `tile` (partial at the
    ends): scale = amax / 448 in float32 (at least 2**-126; 1 for an all-zero tile or
    one holding a NaN or inf), optionally rounded up to a power of two; values =
    x * (1 / scale) clipped to +-448 and rounded to E4M3 (NaN stays NaN)."""
    x = np.asarray(x, np.float32)
    counts = tuple(-(-n // t) for n, t in zip(x.shape, tile))
    values = np.zeros(x.shape, np.float32)
    scales = np.zeros(counts, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for idx in np.ndindex(*counts):
            sl = tuple(slice(i * t, (i + 1) * t) for i, t in zip(idx, tile))
            block = x[sl]
            amax = np.float32(np.max(np.abs(block))) if not np.isnan(block).any() else np.float32(np.nan)
            s = max(np.float32(amax * np.float32(1 / 448)), np.float32(2.0**-126))
            if power_of_two:
                m, e = np.frexp(s)
                s = s if m == 0.5 else np.float32(2.0**e)
            if not (np.isfinite(amax) and amax > 0):
                s = np.float32(1)
            scales[idx] = s
            inv = np.float32(1) / np.float32(s)
            values[sl] = np.clip(block * inv, -448, 448).astype(E4M3).astype(np.float32)
    return values, scales


def expand(scales, tile, shape):
    for d, t in enumerate(tile):
        scales = np.repeat(scales, t, axis=d)
    return scales[tuple(slice(0, n) for n in shape)]


def chunked_matmul(a, sa, b, sb, chunk):
    """float64 `sum over K-chunks of (a * sa)[:, chunk] @ (b * sb)[chunk, :]`; `sa`, `sb`
    given per element (already expanded)."""
    a64, b64 = a.astype(np.float64) * sa, b.astype(np.float64) * sb
    out = np.zeros((a.shape[0], b.shape[1]))
    for c in range(0, a.shape[1], chunk):
        out += a64[:, c : c + chunk] @ b64[c : c + chunk]
    return out


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize(
    "shape,axes,role,tile",
    [
        ((48, 300), (1,), "lhs", (1, 128)),  # activation: 1x128 tiles, the last one partial
        ((300, 200), (0,), "rhs", (128, 128)),  # weight: 128x128 blocks
        ((260, 200), (1,), "grad", (1, 128)),
        ((260, 48), (0,), "lhs", (128, 1)),  # re-tiled for the weight gradient's GEMM
        ((4, 8, 32), (1, 2), "lhs", (1, 4, 32)),  # 128 consecutive elements of a 2-axis contraction
    ],
)
def test_quantize_matches_reference(shape, axes, role, tile, power_of_two, getkey):
    x = jax.random.normal(getkey(), shape) * jnp.exp(3 * jax.random.normal(getkey(), shape))
    q = fp8ax.quantize(x, fp8ax.BlockwiseScaling(power_of_two=power_of_two), axes, role=role)
    assert q.tile == tile and q.values.dtype == jnp.float8_e4m3fn and q.scale.dtype == jnp.float32
    values, scales = reference_quantize(x, tile, power_of_two)
    np.testing.assert_array_equal(np.asarray(q.scale), scales)  # bit for bit
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), values)
    if power_of_two:
        m, _ = np.frexp(np.asarray(q.scale))
        assert np.all(m == 0.5)
    # Dequantized: values times their tile's scale.
    np.testing.assert_array_equal(np.asarray(q.dequantize()), values * expand(scales, tile, shape))


def test_special_tiles():
    x = np.ones((2, 256), np.float32)
    x[0, :128] = 0  # an all-zero tile: scale 1
    x[0, 128] = np.nan  # a NaN: its tile gets scale 1, the NaN stays NaN
    x[1, :128] = 3e-37  # normal float32, amax / 448 below 2**-126: scale 2**-126
    x[1, 128:] = 1e6  # saturates nothing: the scale follows the amax
    q = fp8ax.quantize(jnp.asarray(x), fp8ax.BlockwiseScaling(), 1)
    values, scales = reference_quantize(x, (1, 128))
    np.testing.assert_array_equal(np.asarray(q.scale), scales)
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), values)
    assert scales[0, 0] == 1 and scales[0, 1] == 1 and scales[1, 0] == np.float32(2.0**-126)
    assert np.isnan(np.asarray(q.values, np.float32)[0, 128])
    assert np.all(np.asarray(q.values, np.float32)[1, :128] != 0)  # not flushed


def _operands(getkey, m=260, k=300, n=200):
    x = jax.random.normal(getkey(), (m, k))
    w = jax.random.normal(getkey(), (k, n)) * 0.05
    g = jax.random.normal(getkey(), (m, n))
    return x, w, g


@pytest.mark.parametrize("power_of_two", [False, True])
def test_gemms_match_float64_chunks(power_of_two, getkey):
    """Forward, input and weight gradients: one GEMM per 128-long chunk of the
    contraction, from the tiles each GEMM quantizes, against float64. The error left is
    the float32 accumulation inside and across chunks: within 2e-6 of the largest
    entry (measured 1e-7)."""
    x, w, g = _operands(getkey)
    recipe = fp8ax.BlockwiseScaling(power_of_two=power_of_two)
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    out, vjp = jax.vjp(lambda x, w: dg(x, w, DIMS), x, w)
    dx, dw = vjp(g)

    vx, sx = reference_quantize(x, (1, 128), power_of_two)
    vw, sw = reference_quantize(w, (128, 128), power_of_two)
    ref = chunked_matmul(vx, expand(sx, (1, 128), x.shape), vw, expand(sw, (128, 128), w.shape), 128)
    # d x = g . w^T, contracting the output features: g in 1x128 tiles along them, the
    # forward's quantized weight (its square blocks serve this contraction too).
    vg, sg = reference_quantize(g, (1, 128), power_of_two)
    ref_dx = chunked_matmul(vg, expand(sg, (1, 128), g.shape), vw.T, expand(sw, (128, 128), w.shape).T, 128)
    # d w = x^T . g, contracting the rows: x and g re-quantized in 128x1 tiles.
    vx2, sx2 = reference_quantize(x, (128, 1), power_of_two)
    vg2, sg2 = reference_quantize(g, (128, 1), power_of_two)
    ref_dw = chunked_matmul(vx2.T, expand(sx2, (128, 1), x.shape).T, vg2, expand(sg2, (128, 1), g.shape), 128)
    for got, want in ((out, ref), (dx, ref_dx), (dw, ref_dw)):
        err = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert err < 2e-6, err


def test_small_tiles_keep_their_precision(getkey):
    """Per-tile scales keep a tile of small values that one scale per tensor quantizes
    to a few levels: here only the small tile reaches the output (the weight's rows
    against the large tile are zero)."""
    x, w, _ = _operands(getkey, m=16, k=256, n=64)
    x = x.at[:, :128].multiply(1e-6)  # the first tile of every row is small
    w = w.at[128:].set(0)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    blockwise = fp8ax.Fp8DotGeneral.init(fp8ax.BlockwiseScaling())(x, w, DIMS)
    tensor = fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling())(x, w, DIMS)
    err_block = np.linalg.norm(np.asarray(blockwise) - exact) / np.linalg.norm(exact)
    err_tensor = np.linalg.norm(np.asarray(tensor) - exact) / np.linalg.norm(exact)
    # E4M3 rounds each element by up to 2**-4 relative (RMS about 3.6% per operand, so
    # about 5% for a product of random operands: measured 3.7%); a tile far below a
    # tensor-wide scale is flushed to zero (measured 100%).
    assert err_block < 0.06 and err_tensor > 0.5, (err_block, err_tensor)


def test_batched_and_multi_axis_contraction(getkey):
    """A 3-D activation contracting two axes (Haliax's attention output projection): the
    tiles run over the flattened contraction, and the weight's blocks line up with them."""
    x = jax.random.normal(getkey(), (3, 10, 4, 64))  # (batch, pos, heads, head_size)
    w = jax.random.normal(getkey(), (4, 64, 96)) * 0.1  # (heads, head_size, embed)
    dims = (((2, 3), (0, 1)), ((), ()))
    out = fp8ax.Fp8DotGeneral.init(fp8ax.BlockwiseScaling())(x, w, dims)
    qx = fp8ax.quantize(x, fp8ax.BlockwiseScaling(), (2, 3))
    qw = fp8ax.quantize(w, fp8ax.BlockwiseScaling(), (0, 1), role="rhs")
    assert qx.tile == (1, 1, 2, 64) and qw.tile == (2, 64, 96)
    a = np.asarray(qx.dequantize(), np.float64).reshape(30, 256)
    b = np.asarray(qw.dequantize(), np.float64).reshape(256, 96)
    want = (a @ b).reshape(3, 10, 96)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=2e-6 * np.abs(want).max())


@pytest.mark.filterwarnings("ignore:.*a layer with per-example scales:UserWarning")
def test_trains_and_serves_bit_exact(getkey):
    mlp = eqx.nn.MLP(64, 16, 320, 2, key=getkey())
    model = fp8ax.fp8_linear_layers(mlp, fp8ax.Fp8Config(recipe=fp8ax.BlockwiseScaling()))
    x = jax.random.normal(getkey(), (32, 64))
    y = jax.random.normal(getkey(), (32, 16))

    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    first = float(loss(model))
    model = adam_trained(model, loss, 20)
    assert float(loss(model)) < 0.7 * first
    serving = fp8ax.to_serving(model)
    hidden = serving.layers[1]
    assert hidden.weight.dtype == jnp.uint8  # FP8 bits
    assert hidden.dot_general.weight_scale.shape == (3, 3)  # 128x128 blocks of the 320x320 weight
    assert hidden.dot_general.tile == (128, 128)
    np.testing.assert_array_equal(np.asarray(jax.vmap(serving)(x)), np.asarray(jax.vmap(model)(x)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="`tile` must be an int >= 1"):
        fp8ax.BlockwiseScaling(tile=0)
    with pytest.raises(TypeError, match="`power_of_two` must be a bool"):
        fp8ax.BlockwiseScaling(power_of_two=1)
    with pytest.raises(ValueError, match="`role` must be 'lhs', 'rhs' or 'grad'"):
        fp8ax.quantize(jnp.ones((4, 4)), fp8ax.BlockwiseScaling(), 1, role="weight")


def test_quantized_array_checks_its_layout():
    values = jnp.ones((4, 8))
    with pytest.raises(TypeError, match="`tile` must be None or a tuple of ints"):
        fp8ax.QuantizedArray(values, jnp.ones((4, 1)), "ab")
    with pytest.raises(ValueError, match=r"`tile` must give one extent >= 1 per axis of `values` \(4, 8\)"):
        fp8ax.QuantizedArray(values, jnp.ones((4, 1)), (0, 4))
    with pytest.raises(ValueError, match=r"`scale` must have shape \(4, 2\) .* in tiles of \(1, 4\), got \(4, 3\)"):
        fp8ax.QuantizedArray(values, jnp.ones((4, 3)), (1, 4))
    with pytest.raises(ValueError, match="`scale` must be a scalar or have the rank of `values`"):
        fp8ax.QuantizedArray(values, jnp.ones((4, 3, 2)))
