# The GEMM on quantized operands: FP8 or int8 on the low-precision values with the
# scales applied to the result, block-scaled (MX, NVFP4) through `jax.nn.scaled_matmul`
# where the device has it, per-chunk for scales that vary along the contraction, and
# emulated in float32 otherwise. Shared by the dense, grouped and serving paths.

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._quantized import QuantizedArray
from .._tensor_core import emulated_dot_general
from .call import Call, float32_of, is_16_bit_float, is_fp8_dtype, plainly_scaled
from .dims import explicit_out_sharding
from .scaled import block_scaled_dot, rescale


def _low_precision_pair(qa, qb, dims) -> str | None:
    """The accumulation a GEMM of the two quantized values can run with, if any: their
    scales are constant along the axes it contracts, so they factor out."""
    (lc, rc), _ = dims
    if not (qa.constant_along(lc) and qb.constant_along(rc) and plainly_scaled(qa) and plainly_scaled(qb)):
        return None
    da, db = np.dtype(qa.values.dtype), np.dtype(qb.values.dtype)
    if da == db == np.dtype(np.int8):
        return "int32"
    if is_fp8_dtype(da) and is_fp8_dtype(db):
        return "float32"
    return None


def _epilogue_dtype(qa, qb, out_dtype) -> bool:
    """Whether the scales of an FP8 GEMM go into its epilogue in `out_dtype`: two
    tensor-wise scales and a 16-bit floating output."""
    return np.ndim(qa.scale) == np.ndim(qb.scale) == 0 and is_16_bit_float(out_dtype)


# A GEMM is split into chunks of the contraction no shorter than this; scales that vary
# faster (per element) are dequantized instead.
_MIN_CHUNK = 8


def chunk_lengths(qa: QuantizedArray, qb: QuantizedArray, dims) -> tuple[int, ...] | None:
    """For each contracted pair of axes, the length of the chunks over which both
    operands' scales are constant (tiles of equal extent, or one of them constant along
    the whole axis); None if there is none of at least `_MIN_CHUNK` elements."""
    (lc, rc), _ = dims
    out = []
    for la, rb in zip(lc, rc):
        n = qa.values.shape[la]
        ea, eb = qa.tile_extent(la), qb.tile_extent(rb)
        c = ea if ea == eb or eb == n else (eb if ea == n else None)
        if c is None or c < min(_MIN_CHUNK, n):
            return None
        out.append(c)
    return tuple(out)


def _others(q, axes) -> tuple[int, ...]:
    return tuple(d for d in range(q.values.ndim) if d not in axes)


def fp8_pair(qa, qb) -> bool:
    return all(q is not None and is_fp8_dtype(q.values.dtype) for q in (qa, qb))


def _dequantize(q: QuantizedArray, dtype):
    if q.outer_scale is not None:
        return q.dequantize(dtype, outer=False)  # the outer scale multiplies the GEMM's result
    if q.layout == "tensor" and plainly_scaled(q):
        # XLA's pattern for an FP8 GEMM: convert to the compute dtype, multiply by the
        # scale in that dtype, dot. `"qdq"` mode relies on XLA rewriting exactly this.
        return q.values.astype(dtype) * q.scale.astype(dtype)
    # Row and block scales: dequantize in float32 (exact for power-of-two MX scales).
    return q.dequantize(dtype)


def _emulated(call: Call, qa, qb):
    """The emulated accumulation for a GEMM of `qa` and `qb`, as a `(x, y, dims) ->
    float32` function, if the settings ask for one and both operands are quantized to a
    floating-point format (what runs on an FP8 tensor core); else None."""
    setting = call.settings.accumulation
    if setting is None or qa is None or qb is None:
        return None
    if not all(jnp.issubdtype(q.values.dtype, jnp.floating) for q in (qa, qb)):
        return None  # int8: exact in int32
    return functools.partial(emulated_dot_general, setting=setting)


_MX_GEMM_VALUES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
_E8M0 = np.dtype(jnp.float8_e8m0fnu)
_FP4 = np.dtype(jnp.float4_e2m1fn)


def _blackwell_default_device() -> bool:
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return False
    return int(str(capability).split(".")[0]) >= 10


def _block_format(q, contract: int) -> str | None:
    """`"mxfp8"` or `"nvfp4"` if `q` is a block format `jax.nn.scaled_matmul` takes for a
    GEMM contracting `contract` (whole blocks: 32 E4M3/E5M2 values per E8M0 scale, or 16
    E2M1 values per E4M3 scale times a tensor scale), else None. Blocks that also span
    free axes (NVFP4's 16x16 weight blocks) are repeated per row."""
    values, scale = np.dtype(q.values.dtype), np.dtype(q.scale.dtype)
    if values in _MX_GEMM_VALUES and scale == _E8M0 and not q.int_exponent and q.outer_scale is None:
        kind, block = "mxfp8", 32
    elif values == _FP4 and scale == np.dtype(jnp.float8_e4m3fn) and q.outer_scale is not None:
        kind, block = "nvfp4", 16
    else:
        return None
    if q.tile is None or q.tile[contract] != block or q.values.shape[contract] % block:
        return None
    return kind


def _block_scaled_pair(call: Call, qa, qb, dims) -> bool:
    """Whether the GEMM of `qa` and `qb` runs as `jax.nn.scaled_matmul`: two operands of
    the same block format (MXFP8, not E5M2 on both sides; or NVFP4) along their one
    contracting axis, and the settings (or, by default, the default device) ask for it."""
    wanted = call.settings.block_scaled_gemm
    if wanted is False or call.settings.mode != "direct" or call.settings.accumulation is not None:
        return False
    if qa is None or qb is None:
        return False
    (lc, rc), _ = dims
    if len(lc) != 1:
        return False
    kind = _block_format(qa, lc[0])
    if kind is None or _block_format(qb, rc[0]) != kind:
        return False
    if np.dtype(qa.values.dtype) == np.dtype(qb.values.dtype) == np.dtype(jnp.float8_e5m2):
        return False  # cuDNN has no E5M2 x E5M2 kernel
    return True if wanted else _blackwell_default_device()


def _block_scaled_gemm(qa, qb, dims):
    """`dot_general` of two block-scaled operands through `jax.nn.scaled_matmul` ((B, M,
    K) x (B, N, K), a scale per block of K), in float32, times the operands' tensor scales,
    laid out as `dot_general`'s output."""
    (lc, rc), (lb, rb) = dims

    def as_bmk(q, contract, batch):
        free = [d for d in range(q.values.ndim) if d != contract and d not in batch]
        order = list(batch) + free + [contract]
        shape = q.values.shape
        nb = int(np.prod([shape[d] for d in batch], dtype=np.int64))
        nf = int(np.prod([shape[d] for d in free], dtype=np.int64))
        values = jnp.transpose(q.values, order).reshape(nb, nf, shape[contract])
        rows = q.expanded_scale([d for d in range(q.values.ndim) if d != contract])  # one scale per row and block
        scale = jnp.transpose(rows, order).reshape(nb, nf, -1)
        return values, scale, [shape[d] for d in batch], [shape[d] for d in free]

    a, sa, batch_shape, a_free = as_bmk(qa, lc[0], lb)
    b, sb, _, b_free = as_bmk(qb, rc[0], rb)
    out = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
    out = _times_outer(out, _outer_product(qa, qb))
    return out.reshape(tuple(batch_shape) + tuple(a_free) + tuple(b_free))


def run_gemm(call: Call, qa, a, qb, b, dims, precision, out_dtype, scale=None):
    """`a . b` from their quantized forms (`None`: use the high-precision operand).
    `scale`, if given, is `qa.scale * qb.scale` in float32, computed beforehand."""
    ref = np.result_type(call.lhs_dtype, call.rhs_dtype)
    emulate = _emulated(call, qa, qb)
    if _block_scaled_pair(call, qa, qb, dims):
        return _block_scaled_gemm(qa, qb, dims).astype(out_dtype)
    if call.settings.mode == "direct" and qa is not None and qb is not None:
        pair = _low_precision_pair(qa, qb, dims)
        if pair is None and fp8_pair(qa, qb) and plainly_scaled(qa) and plainly_scaled(qb):
            chunks = chunk_lengths(qa, qb, dims)
            if chunks is not None:
                # Scales that vary along the contraction (blocks, tiles): one GEMM per chunk
                # of the contraction over which both are constant, each accumulated in
                # float32 and scaled, summed in float32 in order (DeepSeek-V3's promotion).
                (lc, rc), _ = dims
                out = block_scaled_dot(
                    qa.values,
                    qa.expanded_scale(_others(qa, lc)),
                    qb.values,
                    qb.expanded_scale(_others(qb, rc)),
                    dims,
                    chunks,
                    precision,
                    accumulate=emulate,
                )
                return out.astype(out_dtype)
        if pair is not None:
            # The kernel's computation: low-precision values, wide accumulation, then the
            # scales (one scalar multiply for two tensor-wise scales).
            emulated = emulate if pair == "float32" else None  # the emulation replaces the GEMM
            if pair == "float32" and emulated is None and _epilogue_dtype(qa, qb, out_dtype):
                # A 16-bit layer: the GEMM writes its dtype and the scales multiply that, one
                # scalar in the same dtype. XLA:GPU folds the multiply (and the dtype) into
                # the FP8 GEMM's epilogue, on the cuBLASLt and the Triton path alike, so no
                # float32 product is written and read again. (An f32 product, scaled, then
                # converted is what XLA leaves as a separate kernel: with its excess-
                # precision rule the consumers read the f32 product.) XLA:CPU rounds the
                # product to the dtype before the scale multiply, a GPU after: at most one
                # unit in the last place apart.
                out = _dot(qa.values, qb.values, dims, precision, out_dtype)
                if scale is None:
                    scale = lax.mul(float32_of(qa.scale), float32_of(qb.scale))
                scale = lax.convert_element_type(scale, out_dtype)
                sharding = explicit_out_sharding(qa.values, qb.values, dims)
                return lax.mul(out, lax.broadcast_in_dim(scale, out.shape, (), out_sharding=sharding))
            if emulated is not None:
                acc = emulated(qa.values, qb.values, dims)
            else:
                acc_dtype = jnp.int32 if pair == "int32" else jnp.float32
                acc = _dot(qa.values, qb.values, dims, precision, acc_dtype)
            return rescale(
                acc, qa.expanded_scale(), qa.values.shape, qb.expanded_scale(), qb.values.shape, dims
            ).astype(out_dtype)
    # Dequantize-then-GEMM: `"qdq"` mode, MX blocks, or an operand kept in high precision.
    # Two-level scales (NVFP4): the inner dequantization (FP4 values times E4M3 scales)
    # is exact, and the per-tensor outer scales multiply the GEMM's result.
    outer = _outer_product(qa, qb)
    if emulate is not None and qa is not None and qb is not None:  # (both are, when `emulate` is)
        # Block formats: the values times their block scales, exact in float32.
        out = emulate(qa.dequantize(np.float32, outer=False), qb.dequantize(np.float32, outer=False), dims)
        return _times_outer(out, outer).astype(out_dtype)
    da = _dequantize(qa, ref) if qa is not None else a.astype(ref)
    db = _dequantize(qb, ref) if qb is not None else b.astype(ref)
    pref = jnp.float32 if ref == np.float32 or outer is not None else None
    return _times_outer(_dot(da, db, dims, precision, pref), outer).astype(out_dtype)


def _dot(a, b, dims, precision, preferred):
    """`lax.dot_general`, sharded as its operands imply under explicit sharding."""
    sharding = explicit_out_sharding(a, b, dims)
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=preferred, out_sharding=sharding)


def _outer_product(qa, qb):
    """The product of the two operands' outer (per-tensor) scales, or None if neither
    has one."""
    outers = [q.outer_scale for q in (qa, qb) if q is not None and q.outer_scale is not None]
    if not outers:
        return None
    return outers[0] if len(outers) == 1 else lax.mul(outers[0], outers[1])


def _times_outer(out, outer):
    if outer is None:
        return out
    out = lax.convert_element_type(out, np.float32)
    return lax.mul(out, lax.broadcast_in_dim(outer, out.shape, ()))


def ndim_of(res) -> int:
    return res.values.ndim if isinstance(res, QuantizedArray) else res.ndim
