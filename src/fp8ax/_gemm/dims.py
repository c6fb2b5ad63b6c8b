# Dimension bookkeeping of a dot general and its two backward GEMMs, and the rescaling of
# a low-precision GEMM's result by its operands' scales. Numerics layer: imports nothing
# from fp8ax.

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec
from jaxtyping import Array

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def check_dimension_numbers(dimension_numbers, lhs_shape, rhs_shape):
    """`dimension_numbers` normalized to non-negative ints; errors name the argument."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in ds) for ds in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise TypeError(
            "`dimension_numbers` must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}."
        ) from None
    for name, ds, shape in (("lhs", lc + lb, lhs_shape), ("rhs", rc + rb, rhs_shape)):
        bad = [d for d in ds if not -len(shape) <= d < len(shape)]
        if bad:
            raise ValueError(f"`dimension_numbers` names dimensions {bad} of `{name}`, which has shape {shape}.")
    lc = tuple(d % len(lhs_shape) for d in lc)
    rc = tuple(d % len(rhs_shape) for d in rc)
    lb = tuple(d % len(lhs_shape) for d in lb)
    rb = tuple(d % len(rhs_shape) for d in rb)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"`dimension_numbers` pairs {len(lc)}/{len(lb)} lhs dims with {len(rc)}/{len(rb)} rhs dims.")
    lsz = tuple(lhs_shape[d] for d in lc)
    rsz = tuple(rhs_shape[d] for d in rc)
    if lsz != rsz:
        raise ValueError(
            f"`lhs` and `rhs` do not contract: lhs dims {lc} have sizes {lsz} but rhs dims {rc} have sizes {rsz} "
            f"(lhs shape {lhs_shape}, rhs shape {rhs_shape})."
        )
    lbs = tuple(lhs_shape[d] for d in lb)
    rbs = tuple(rhs_shape[d] for d in rb)
    if lbs != rbs:
        raise ValueError(f"batch dims of `lhs` {lb} (sizes {lbs}) and `rhs` {rb} (sizes {rbs}) differ.")
    return (lc, rc), (lb, rb)


def free_dims(ndim, contracting, batch):
    return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


class BwdLayout(NamedTuple):
    """Dimension bookkeeping of the two backward GEMMs of `dot_general(lhs, rhs, dims)`."""

    l_free: tuple
    r_free: tuple
    g_batch: tuple
    g_lfree: tuple
    g_rfree: tuple
    dlhs_ab: tuple  # layout of dlhs computed as g . rhs
    dlhs_ba: tuple  # ... as rhs . g
    drhs_ab: tuple  # layout of drhs computed as lhs . g
    drhs_ba: tuple  # ... as g . lhs


def bwd_layout(dims, l_ndim, r_ndim) -> BwdLayout:
    (lc, rc), (lb, rb) = dims
    # dot_general's output layout: (batch..., lhs free..., rhs free...).
    nb = len(lb)
    l_free = free_dims(l_ndim, lc, lb)
    r_free = free_dims(r_ndim, rc, rb)
    g_batch = tuple(range(nb))
    g_lfree = tuple(range(nb, nb + len(l_free)))
    g_rfree = tuple(range(nb + len(l_free), nb + len(l_free) + len(r_free)))
    # rhs contracting dim rc[i] stands for lhs dim lc[i] and vice versa; a GEMM's free
    # dims come out in axis order.
    lc_of_rc = tuple(lc[rc.index(d)] for d in sorted(rc))
    rc_of_lc = tuple(rc[lc.index(d)] for d in sorted(lc))
    return BwdLayout(
        l_free,
        r_free,
        g_batch,
        g_lfree,
        g_rfree,
        dlhs_ab=tuple(lb) + l_free + lc_of_rc,
        dlhs_ba=tuple(lb) + lc_of_rc + l_free,
        drhs_ab=tuple(rb) + rc_of_lc + r_free,
        drhs_ba=tuple(rb) + r_free + rc_of_lc,
    )


def oriented_gemm(gemm, a_contract, b_contract, a_batch, b_batch, layout_ab, layout_ba):
    """One backward GEMM, in the operand order whose result is already laid out as the
    gradient's operand (no transpose of the result), if either order gives that.

    `gemm(swapped, dims)` computes `a . b` (or `b . a` if `swapped`) with `dims`."""

    def in_order(layout):
        return list(layout) == sorted(layout)

    if not in_order(layout_ab) and in_order(layout_ba):
        out = gemm(True, ((b_contract, a_contract), (b_batch, a_batch)))
        layout = layout_ba
    else:
        out = gemm(False, ((a_contract, b_contract), (a_batch, b_batch)))
        layout = layout_ab
    return out if in_order(layout) else jnp.transpose(out, np.argsort(layout).tolist())


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


def explicit_out_sharding(a, b, dims):
    """Under JAX's explicit sharding (`jax.sharding.AxisType.Explicit`), the sharding of
    `lax.dot_general(a, b, dims)`'s result that the operands imply: each batch and free
    dimension keeps its operand's mesh axes (a mesh axis shards one dimension at most:
    the first keeps it), and a sharded contraction is summed over its devices. JAX asks
    for it where it cannot choose (a contraction sharded on both sides, as in a weight
    gradient over a sharded batch). None outside explicit sharding (the compiler
    chooses), as for JAX's own `dot_general`."""
    if not explicitly_sharded(a):
        return None
    sa, sb = jax.typeof(a).sharding, jax.typeof(b).sharding
    (ac, bc), (ab, bb) = dims

    def spec(s, ndim):
        return tuple(s.spec) + (None,) * (ndim - len(s.spec))

    pa, pb = spec(sa, a.ndim), spec(sb, b.ndim)
    entries = (
        [pa[i] for i in ab]
        + [pa[i] for i in range(a.ndim) if i not in ac and i not in ab]
        + [pb[i] for i in range(b.ndim) if i not in bc and i not in bb]
    )
    used: set = set()
    out = []
    for e in entries:
        names = () if e is None else (e if isinstance(e, tuple) else (e,))
        if used.intersection(names):
            e, names = None, ()
        used.update(names)
        out.append(e)
    return PartitionSpec(*out)


def sharded_like(x: Array, like) -> Array:
    """`x` (an operand's cotangent) with the sharding of `like` (the operand, or its
    `QuantizedArray`) under explicit sharding; `x` itself otherwise."""
    like = getattr(like, "values", like)
    return jax.sharding.reshard(x, jax.typeof(like).sharding.spec) if explicitly_sharded(like) else x


def explicitly_sharded(x) -> bool:
    """Whether `x`'s type carries a sharding over explicit mesh axes (JAX's
    sharding-in-types mode, `jax.sharding.AxisType.Explicit`)."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
