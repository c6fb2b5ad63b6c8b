# A low-precision GEMM's result times its operands' scales: the rescale by per-tensor or
# per-row scales (`rescale`), and the GEMM cut into chunks of the contraction over which
# block scales are constant (`block_scaled_dot`). Numerics layer: imports nothing from
# fp8ax.

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array


def _scale_layout(
    scale: Array, operand_shape: tuple[int, ...], batch: tuple[int, ...], contract: tuple[int, ...], argname: str
) -> tuple[Array, int]:
    """`scale` transposed to (batch dims, free dims), contracting dims dropped; and the
    number of free dims."""
    if scale.ndim != len(operand_shape):
        raise ValueError(
            f"`{argname}` must have the operand's rank {len(operand_shape)} (keepdims), got shape {scale.shape}."
        )
    for d, (s, n) in enumerate(zip(scale.shape, operand_shape)):
        if d in contract and s != 1:
            raise ValueError(
                f"`{argname}` must have size 1 along the contracting dimensions {contract}, got shape {scale.shape}."
            )
        if s not in (1, n):
            raise ValueError(f"`{argname}` of shape {scale.shape} does not broadcast to the operand's {operand_shape}.")
    free = tuple(d for d in range(scale.ndim) if d not in batch and d not in contract)
    kept = batch + free
    scale = jnp.transpose(scale, kept + contract).reshape(tuple(scale.shape[d] for d in kept))
    return scale, len(free)


def rescale(acc, lhs_scale, lhs_shape, rhs_scale, rhs_shape, dims) -> Array:
    """`float32(acc)` times the outer product of the two operands' scales, laid out as
    dot_general's output: batch dims, then lhs free dims, then rhs free dims.

    A scale is a scalar (one per tensor) or has its operand's rank with size 1 along
    the contracting dims (one per row). Two scalars cost one scalar multiply."""
    acc = lax.convert_element_type(acc, np.float32)
    lhs_scale = lax.convert_element_type(jnp.asarray(lhs_scale), np.float32)
    rhs_scale = lax.convert_element_type(jnp.asarray(rhs_scale), np.float32)
    if lhs_scale.ndim == rhs_scale.ndim == 0:
        # `lax` rather than `*`: an array operator traces a few hundred Python calls.
        return lax.mul(acc, lax.broadcast_in_dim(lax.mul(lhs_scale, rhs_scale), acc.shape, ()))
    (lc, rc), (lb, rb) = dims

    def layout(scale, shape, batch, contract, argname):
        if scale.ndim == 0:
            scale = jnp.reshape(scale, (1,) * len(shape))
        return _scale_layout(scale, tuple(shape), tuple(batch), tuple(contract), argname)

    ls, n_lfree = layout(lhs_scale, lhs_shape, lb, lc, "lhs_scale")
    rs, n_rfree = layout(rhs_scale, rhs_shape, rb, rc, "rhs_scale")
    nb = len(lb)
    # lhs: (batch, lhs free, 1...); rhs: (batch, 1..., rhs free). Same rank, so the
    # product is the outer product over the free dims (size-1 dims broadcast).
    ls = ls.reshape(ls.shape + (1,) * n_rfree)
    rs = rs.reshape(rs.shape[:nb] + (1,) * n_lfree + rs.shape[nb:])
    return acc * (ls * rs)


def _chunked(v: Array, scale: Array, contract: tuple[int, ...], chunks: tuple[int, ...]):
    """`v` with its contracted axes cut into chunks, the chunk index first:
    `(n_chunks, *v.shape with each contracted axis of length its chunk)`; and `scale`
    (one entry per chunk along the contracted axes, or size 1 there) as
    `(n_chunks, *scale's other axes)`."""
    counts = tuple(-(-v.shape[d] // c) for d, c in zip(contract, chunks))
    pad = [(0, 0)] * v.ndim
    for d, c, k in zip(contract, chunks, counts):
        pad[d] = (0, k * c - v.shape[d])
    if any(hi for _, hi in pad):
        v = jnp.pad(v, pad)  # zeros add nothing to any chunk's sum
    split, where = [], {}
    for d in range(v.ndim):
        if d in contract:
            i = contract.index(d)
            where[d] = len(split)
            split += [counts[i], chunks[i]]
        else:
            split.append(v.shape[d])
    v = v.reshape(split)
    front = [where[d] for d in contract]
    v = jnp.transpose(v, front + [a for a in range(v.ndim) if a not in front])
    v = v.reshape((-1,) + v.shape[len(contract) :])
    scale = jnp.broadcast_to(
        scale, tuple(counts[contract.index(d)] if d in contract else scale.shape[d] for d in range(scale.ndim))
    )
    rest = [d for d in range(scale.ndim) if d not in contract]
    scale = jnp.transpose(scale, list(contract) + rest).reshape((-1,) + tuple(scale.shape[d] for d in rest))
    return v, scale


def block_scaled_dot(
    a: Array, a_scale: Array, b: Array, b_scale: Array, dims, chunks, precision=None, accumulate=None
) -> Array:
    """`dot_general(a * a_scale, b * b_scale, dims)` in float32 for scales that vary
    along the contraction: the contraction is cut into chunks (`chunks[i]` elements
    along the `i`-th contracted pair) over which both scales are constant; each chunk's
    GEMM runs on the values with float32 accumulation, is multiplied by the outer product
    of its two scales, and the chunks are summed in order in float32 (DeepSeek-V3's
    promotion of Tensor Core partial sums every 128 elements of K).

    `a_scale`, `b_scale` have their operand's rank (or are scalars): one entry per chunk
    (or size 1) along the contracted axes, and size 1 or the full size elsewhere.
    `accumulate(x, y, dims)`, if given, computes each chunk's float32 GEMM instead of
    `lax.dot_general` (the emulated tensor-core accumulation)."""
    (lc, rc), (lb, rb) = dims
    lc, rc = tuple(lc), tuple(rc)
    a_scale = jnp.reshape(a_scale, (1,) * a.ndim) if jnp.ndim(a_scale) == 0 else a_scale
    b_scale = jnp.reshape(b_scale, (1,) * b.ndim) if jnp.ndim(b_scale) == 0 else b_scale
    ac, sa = _chunked(a, a_scale.astype(jnp.float32), lc, chunks)
    bc, sb = _chunked(b, b_scale.astype(jnp.float32), rc, chunks)
    nb = len(lb)
    # A chunk's scales, laid out as dot_general's output (batch, lhs free, rhs free).
    a_rest = [d for d in range(a.ndim) if d not in lc]
    b_rest = [d for d in range(b.ndim) if d not in rc]
    a_free = [d for d in a_rest if d not in lb]
    b_free = [d for d in b_rest if d not in rb]
    sa = jnp.transpose(sa, [0] + [1 + a_rest.index(d) for d in tuple(lb) + tuple(a_free)])
    sb = jnp.transpose(sb, [0] + [1 + b_rest.index(d) for d in tuple(rb) + tuple(b_free)])
    sa = sa.reshape(sa.shape + (1,) * len(b_free))
    sb = sb.reshape(sb.shape[: 1 + nb] + (1,) * len(a_free) + sb.shape[1 + nb :])

    def one(i):
        if accumulate is not None:
            acc = accumulate(ac[i], bc[i], dims)
        else:
            acc = lax.dot_general(ac[i], bc[i], dims, precision=precision, preferred_element_type=jnp.float32)
        return acc * (sa[i] * sb[i])

    if ac.shape[0] == 1:
        return one(0)

    # Every chunk is added in the loop body, the first one to zeros: XLA:CPU contracts a
    # multiply and the add that consumes it into a fused multiply-add, and with the first
    # chunk outside the loop it paired the products differently in different programs
    # (eager and jitted calls differed in the last bit). Inside one loop body the pairing
    # is the same in every program.
    def step(acc, i):
        return acc + one(i), None

    out, _ = lax.scan(step, jnp.zeros(jax.eval_shape(one, 0).shape, jnp.float32), jnp.arange(ac.shape[0]))
    return out
