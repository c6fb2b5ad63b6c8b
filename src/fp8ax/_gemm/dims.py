# Dimension bookkeeping of a dot general and its two backward GEMMs, and the sharding of
# a result. Numerics layer: imports nothing from fp8ax.

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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
