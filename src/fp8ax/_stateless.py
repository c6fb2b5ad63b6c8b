# The GEMMs of a dot general whose operands are quantised by stateless recipes
# (CurrentScaling, MXScaling, Int8Scaling), with per-operand recipes and GEMMs that can
# stay in high precision. See `_current.py` for the recipes.

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._current import AbstractStatelessRecipe, QuantizedArray, content_key
from ._dot_general import _reduce_to, bwd_layout, oriented_gemm

GEMMS = ("fwd", "dlhs", "drhs")


class StatelessStatic(NamedTuple):
    dims: tuple
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    preferred: np.dtype | None
    fwd_precision: lax.Precision | None
    dlhs_precision: lax.Precision | None
    drhs_precision: lax.Precision | None
    mode: str
    lhs: AbstractStatelessRecipe | None  # None: this operand is not quantised
    rhs: AbstractStatelessRecipe | None
    grad: AbstractStatelessRecipe | None
    high_precision: frozenset  # GEMMs computed without quantisation
    lhs_vma: frozenset
    rhs_vma: frozenset


def _quantise(recipe, x, contracting, role, key=None) -> QuantizedArray | None:
    if recipe is None:
        return None
    dtype = recipe.grad_dtype if role == "grad" else recipe.fwd_dtype
    return recipe.quantize(x, tuple(contracting), dtype, key)


def _output_scale(q: QuantizedArray, shape, contract, batch, lhs_side: bool, n_other_free: int):
    """A factorised scale laid out as dot_general's output (batch, lhs free, rhs free)."""
    scale = q.scale
    if jnp.ndim(scale) == 0:
        return scale
    keep = tuple(1 if d in contract else shape[d] for d in range(len(shape)))
    scale = jnp.broadcast_to(scale, keep)
    free = tuple(d for d in range(len(shape)) if d not in contract and d not in batch)
    scale = jnp.transpose(scale, tuple(batch) + free + tuple(contract))
    nb = len(batch)
    sizes = tuple(shape[d] for d in tuple(batch) + free)
    if lhs_side:
        return jnp.reshape(scale, sizes + (1,) * n_other_free)
    return jnp.reshape(scale, sizes[:nb] + (1,) * n_other_free + sizes[nb:])


def _low_precision_pair(qa, qb) -> str | None:
    """The accumulation a GEMM of the two quantised values can run with, if any."""
    if qa is None or qb is None or not (qa.scale_factorises and qb.scale_factorises):
        return None
    da, db = np.dtype(qa.values.dtype), np.dtype(qb.values.dtype)
    if da == db == np.dtype(np.int8):
        return "int32"
    if da.itemsize == db.itemsize == 1 and jnp.issubdtype(da, jnp.floating) and jnp.issubdtype(db, jnp.floating):
        return "float32"
    return None


def _gemm(st: StatelessStatic, qa, a, qb, b, dims, precision, out_dtype):
    """`a . b` from their quantised forms (`None`: use the high-precision operand)."""
    ref = np.result_type(st.lhs_dtype, st.rhs_dtype)
    pair = _low_precision_pair(qa, qb) if st.mode == "direct" else None
    if pair is not None:
        # The kernel's computation: low-precision values, wide accumulation, then the
        # outer product of the scales.
        acc_dtype = jnp.int32 if pair == "int32" else jnp.float32
        acc = lax.dot_general(qa.values, qb.values, dims, precision=precision, preferred_element_type=acc_dtype)
        (ac, bc), (ab, bb) = dims
        n_afree = a.ndim - len(ac) - len(ab)
        n_bfree = b.ndim - len(bc) - len(bb)
        sa = _output_scale(qa, a.shape, ac, ab, True, n_bfree)
        sb = _output_scale(qb, b.shape, bc, bb, False, n_afree)
        return (acc.astype(jnp.float32) * sa * sb).astype(out_dtype)
    # Emulation: dequantise (exact in float32 for power-of-two block scales) and run a
    # float32-accumulating GEMM in the compute dtype.
    da = qa.dequantize(ref) if qa is not None else a.astype(ref)
    db = qb.dequantize(ref) if qb is not None else b.astype(ref)
    pref = jnp.float32 if ref == np.float32 else None
    return lax.dot_general(da, db, dims, precision=precision, preferred_element_type=pref).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def stateless_dot(st: StatelessStatic, lhs, rhs):
    return _fwd(st, lhs, rhs)[0]


def _fwd(st: StatelessStatic, lhs, rhs):
    (lc, rc), _ = st.dims
    if "fwd" in st.high_precision:
        ql = qr = None
    else:
        ql = _quantise(st.lhs, lhs, lc, "lhs")
        qr = _quantise(st.rhs, rhs, rc, "rhs")
    out = _gemm(st, ql, lhs, qr, rhs, st.dims, st.fwd_precision, st.out_dtype)
    # The backward GEMMs contract other axes, so they quantise the operands again.
    return out, (lhs, rhs)


def _bwd(st: StatelessStatic, residuals, g):
    lhs, rhs = residuals
    (_, _), (lb, rb) = st.dims
    lay = bwd_layout(st.dims, lhs.ndim, rhs.ndim)
    stochastic = st.grad is not None and getattr(st.grad, "grad_rounding", "nearest") == "stochastic"
    key = content_key(st.grad.seed, g) if stochastic else None
    keys = jax.random.split(key) if stochastic else (None, None)

    def gemm_fn(qa, a, qb, b, precision, out_dtype):
        def gemm(swapped, dims):
            if swapped:
                return _gemm(st, qb, b, qa, a, dims, precision, out_dtype)
            return _gemm(st, qa, a, qb, b, dims, precision, out_dtype)

        return gemm

    # d lhs = g . rhs, contracting g's rhs-free dims with rhs's free dims.
    if "dlhs" in st.high_precision:
        qg1 = qr1 = None
    else:
        qg1 = _quantise(st.grad, g, lay.g_rfree, "grad", keys[0])
        qr1 = _quantise(st.rhs, rhs, lay.r_free, "rhs")
    dlhs = oriented_gemm(gemm_fn(qg1, g, qr1, rhs, st.dlhs_precision, st.lhs_dtype),
                         lay.g_rfree, lay.r_free, lay.g_batch, rb, lay.dlhs_ab, lay.dlhs_ba)
    # d rhs = lhs . g, contracting lhs's free dims with g's lhs-free dims.
    if "drhs" in st.high_precision:
        ql2 = qg2 = None
    else:
        ql2 = _quantise(st.lhs, lhs, lay.l_free, "lhs")
        qg2 = _quantise(st.grad, g, lay.g_lfree, "grad", keys[1])
    drhs = oriented_gemm(gemm_fn(ql2, lhs, qg2, g, st.drhs_precision, st.rhs_dtype),
                         lay.l_free, lay.g_lfree, lb, lay.g_batch, lay.drhs_ab, lay.drhs_ba)
    # Inside `jax.shard_map`: a replicated operand's cotangent is summed over the axes the
    # data varies over, as for JAX's own dot_general.
    return _reduce_to(dlhs, st.lhs_vma, lax.psum), _reduce_to(drhs, st.rhs_vma, lax.psum)


stateless_dot.defvjp(_fwd, _bwd)
