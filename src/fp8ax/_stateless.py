# The GEMMs of a dot general whose operands are quantised by stateless recipes
# (CurrentScaling, MXScaling, Int8Scaling), with per-operand recipes and GEMMs that can
# stay in high precision. See `_current.py` for the recipes.

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

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
    the contracting dims (one per row)."""
    (lc, rc), (lb, rb) = dims

    def layout(scale, shape, batch, contract, argname):
        scale = jnp.asarray(scale, jnp.float32)
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
    return acc.astype(jnp.float32) * (ls * rs)


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
        return rescale(acc, qa.scale, a.shape, qb.scale, b.shape, dims).astype(out_dtype)
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
