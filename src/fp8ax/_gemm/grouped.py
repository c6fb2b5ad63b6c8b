# Grouped GEMMs (mixture-of-experts) on quantized operands: `jax.lax.ragged_dot` with
# fp8ax's pipeline semantics.
#
# A grouped GEMM multiplies consecutive groups of rows of `lhs` (M, K), the tokens routed
# to each expert, by that expert's weight `rhs[g]` (K, N). Its three GEMMs are ragged
# dots: the forward (M, K) x (G, K, N) -> (M, N); the input gradient, the output gradient
# (M, N) against the transposed expert weights -> (M, K); and the weight gradient, which
# contracts the tokens of each group: (M, K) x (M, N) -> (G, K, N).
#
# Each operand is quantized by the layer's recipe, along the axes its GEMM contracts, as
# in `dense.py` (the same `quantize_operands`, plans, state and max-merged state
# cotangents), so every recipe works here. The expert weights are quantized either as one
# tensor, or per expert (`per_expert_weights`: each expert's weight is a tensor of its
# own, with a state of its own, by `vmap` of the recipe over the experts). Where both
# operands' scales are constant along the contraction (tensor, per-expert and row scales),
# the ragged dot runs on the low-precision values with float32 accumulation and the
# result is multiplied by the scales, gathered per row for the group-dependent ones;
# otherwise (MX and other block scales, `"qdq"` mode) the operands are dequantized and
# the ragged dot runs in float32.

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

if TYPE_CHECKING:
    pass

from .._quantized import QuantizedArray
from .backward import backward_precision, three_gemm_backward
from .call import Call, float32_of, is_fp8_dtype, plainly_scaled, reusable, states_by_role
from .operands import checked_result, lay_out_by_axis_mapping, operand_for, quantize, quantize_together
from .passes import once_per_signature, state_in, state_out
from .plans import plan_call
from .residuals import keep, kept
from .settings import Role, quantizing_recipe

# The three ragged dots, as `jax.lax.RaggedDotDimensionNumbers`.
_RAGGED_DIMS = {
    # (M, K) x (G, K, N) -> (M, N): rows ragged, one weight per group.
    "fwd": lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), (0,), (0,)),
    # (M, N) x (G, K, N) -> (M, K): the output gradient against the transposed weights.
    "dlhs": lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), (0,), (0,)),
    # (M, K) x (M, N) -> (G, K, N): the tokens of each group contracted.
    "drhs": lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), (0,), ()),
}
# The axes each GEMM contracts, per operand: (first operand's, second operand's).
_CONTRACTED = {"fwd": ((1,), (1,)), "dlhs": ((1,), (2,)), "drhs": ((0,), (0,))}


class RaggedCall(NamedTuple):
    """The static part of one grouped-GEMM call."""

    call: Call  # settings, out dtype, precision, state layout, as for a dense call
    per_expert: bool  # the weights are quantized per expert, with per-expert state
    per_group: bool = False  # the tokens (and output gradients) of each group share a scale


def group_ids(group_sizes, rows: int) -> Array:
    """The group of each of `rows` rows (rows past the last group: the last group; their
    output rows are zero anyway)."""
    ends = jnp.cumsum(group_sizes)
    ids = jnp.searchsorted(ends, jnp.arange(rows, dtype=ends.dtype), side="right")
    return jnp.minimum(ids, group_sizes.shape[0] - 1)


def _factored(q: QuantizedArray, contracted) -> bool:
    """Whether `q`'s scale factors out of a GEMM contracting `contracted`."""
    return q.outer_scale is None and plainly_scaled(q) and q.constant_along(contracted)


def _output_scale(kind: str, sa, sb, ids) -> Array:
    """The product of the two operands' (factored) scales, laid out like the output of
    ragged dot `kind`; `ids` are the rows' groups."""
    sa, sb = float32_of(sa), float32_of(sb)
    if kind == "fwd":  # sa: () or (M, 1); sb: () or (G, 1, N|1) -> (M, N|1)
        sb = sb if sb.ndim == 0 else sb[:, 0, :][ids]
        return sa * sb
    if kind == "dlhs":  # sa (grad): () or (M, 1); sb (weights): () or (G, K|1, 1) -> (M, K|1)
        sb = sb if sb.ndim == 0 else sb[:, :, 0][ids]
        return sa * sb
    # drhs: sa (lhs): () or (1, K|1); sb (grad): () or (1, N|1) -> (1, K|1, N|1)
    sa = sa if sa.ndim == 0 else sa[:, :, None]
    sb = sb if sb.ndim == 0 else sb[:, None, :]
    return sa * sb


def ragged_gemm(rc: RaggedCall, kind: str, qa, a, qb, b, group_sizes, precision, out_dtype):
    """Ragged dot `kind` of two operands from their quantized forms (`None`: use the
    high-precision operand), in `out_dtype`."""
    st = rc.call.settings
    ca, cb = _CONTRACTED[kind]
    if st.mode == "direct" and qa is not None and qb is not None and _factored(qa, ca) and _factored(qb, cb):
        va, vb = qa.values, qb.values
        ints = np.dtype(va.dtype) == np.dtype(vb.dtype) == np.dtype(np.int8)
        if ints or (is_fp8_dtype(va.dtype) and is_fp8_dtype(vb.dtype)):
            # The kernel's computation: low-precision values, wide accumulation, then the
            # scales (per row for the group-dependent ones).
            acc = _batchable_ragged(kind, precision, np.dtype(np.int32 if ints else np.float32))(va, vb, group_sizes)
            ids = group_ids(group_sizes, a.shape[0]) if kind != "drhs" else None
            scale = _output_scale(kind, qa.expanded_scale(), qb.expanded_scale(), ids)
            return (float32_of(acc) * scale).astype(out_dtype)
    # Dequantize, then a float32 ragged dot: block scales, `"qdq"` mode, an operand kept
    # in high precision. The dequantization of FP8/FP4 values and their scales is exact
    # in float32 (a two-level NVFP4 scale rounds once).
    da = qa.dequantize(jnp.float32) if qa is not None else float32_of(a)
    db = qb.dequantize(jnp.float32) if qb is not None else float32_of(b)
    out = _batchable_ragged(kind, precision, np.dtype(np.float32))(da, db, group_sizes)
    return out.astype(out_dtype)


@functools.cache
def _batchable_ragged(kind: str, precision, preferred: np.dtype):
    """`jax.lax.ragged_dot_general` for ragged dot `kind`, with a `vmap` rule: JAX has no
    batching rule for a ragged dot mapped over anything but its first axis (jax 0.10:
    "ragged_dot vmap over any dim but 0 - NYI"), so under `vmap` (a layer called per
    example, or on the halves of a batch) the mapped calls run one after another
    (`lax.map`), each a ragged dot of its own."""
    dims = _RAGGED_DIMS[kind]

    @custom_vmap
    def ragged(a, b, group_sizes):
        return lax.ragged_dot_general(a, b, group_sizes, dims, precision, preferred_element_type=preferred)

    @ragged.def_vmap
    def rule(axis_size, in_batched, a, b, group_sizes):
        batched = [x if m else None for x, m in zip((a, b, group_sizes), in_batched)]

        def one(xs):
            args = [x if m else full for x, m, full in zip(xs, in_batched, (a, b, group_sizes))]
            return ragged(*args)

        return lax.map(one, batched), True

    return ragged


def quantize_weights(rc: RaggedCall, w, axes, state, plan, group_sizes=None):
    """The expert weights quantized along `axes` (of the (G, K, N) weights), and their
    new state: as one tensor, or per expert (each expert's weight a tensor of its own,
    with its own entry of the state). Per expert, an expert with no tokens (its
    `group_sizes` entry 0) observes nothing: its amax goes into its state as 0, "no
    observation", as for an unused layer, so the step keeps its state."""
    if not rc.per_expert:
        return quantize(rc.call, "rhs", w, axes, state, plan=plan)
    call = rc.call
    recipe = quantizing_recipe(call.settings, "rhs")
    inner = tuple(a - 1 for a in axes)

    def one(wg, sg, used):
        op = operand_for(call, "rhs", wg, inner, sg)
        if used is not None:
            merge = op.merge
            op = op._replace(merge=lambda v: jax.tree.map(lambda a: jnp.where(used, a, jnp.zeros_like(a)), merge(v)))
        q, new = checked_result(recipe, op, recipe.quantize_operands([op])[0])
        return (q.values, q.scale, q.outer_scale), new

    used = None if group_sizes is None or state is None else lax.gt(group_sizes, jnp.zeros_like(group_sizes))
    # The static layout of one expert's result, for the stacked one.
    proto = jax.eval_shape(lambda: one(w[0], _slice0(state), None))[0]
    if proto[2] is not None:
        raise ValueError(
            "`per_expert_weights=True` needs a recipe with one level of scales, but this recipe gives the weights a "
            "per-tensor outer scale (NVFP4). Use `per_expert_weights=False`."
        )
    layout = jax.eval_shape(lambda: quantize(call, "rhs", w[0], inner, _slice0(state))[0])
    (values, scale, _), new = jax.vmap(one)(w, state, used)
    if scale.ndim == 1:  # one scale per expert: keep the weights' rank
        scale = scale.reshape((w.shape[0],) + (1,) * (w.ndim - 1))
    tile = None if layout.tile is None else (1,) + tuple(layout.tile)
    return QuantizedArray(values, scale, tile, layout.int_exponent), new


def quantize_tokens(rc: RaggedCall, role: Role, x, axes, state, plan, group_sizes, key=None):
    """Tokens (`"lhs"`, (M, K)) or output gradients (`"grad"`, (M, N)) quantized along
    `axes`, and their new state: as one tensor, or (`rc.per_group`) the rows of
    each group as a tensor of their own, with their own scale and entry of the state.
    Per group, the recipe quantizes the whole array with the other groups' rows set to
    zero (so a group without rows observes nothing), under `vmap` over the groups, and
    each row takes its group's values; the scale becomes one per row. Rows past the last
    group are zeros."""
    if not rc.per_group:
        return quantize(rc.call, role, x, axes, state, key=key, plan=plan)
    call = rc.call
    recipe = quantizing_recipe(call.settings, role)
    rows = jnp.arange(x.shape[0], dtype=group_sizes.dtype)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes

    def one(start, end, sg):
        inside = lax.bitwise_and(lax.ge(rows, start), lax.lt(rows, end))
        xg = jnp.where(lax.broadcast_in_dim(inside, x.shape, (0,)), x, jnp.zeros_like(x))
        op = operand_for(call, role, xg, axes, sg, key)
        q, new = checked_result(recipe, op, recipe.quantize_operands([op])[0])
        return (q.values, q.scale), new

    (values, scales), new = jax.vmap(one)(starts, ends, state)
    if scales.ndim != 1:
        raise ValueError(
            f"`per_group_tokens=True` needs one scale per tensor for the {role}, but {type(recipe).__name__} gives a "
            f"scale of shape {scales.shape[1:]}."
        )
    ids = group_ids(group_sizes, x.shape[0])
    values = jnp.take_along_axis(values, ids[None, :, None], axis=0)[0]
    return QuantizedArray(values, scales[ids][:, None]), new


def _slice0(state):
    return None if state is None else tuple(s[0] for s in state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ragged_quantized_dot(rc: RaggedCall, lhs, rhs, group_sizes, *state) -> Array:
    """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` on quantized operands; `state` as for
    `dense.quantized_dot` (the rhs state with a leading expert axis if `rc.per_expert`).
    The VJP returns the new state as the state's cotangent."""
    return _fwd(rc, lhs, rhs, group_sizes, *state)[0]


def _fwd(rc: RaggedCall, lhs, rhs, group_sizes, *raw):
    return _forward(rc, lhs, rhs, group_sizes, *state_in(raw))


@once_per_signature("fp8ax.Fp8RaggedDot.forward")
def _forward(rc: RaggedCall, lhs, rhs, group_sizes, *raw):
    call = rc.call
    st = call.settings
    states = states_by_role(raw)
    # Per-expert weights and per-group tokens plan their own scales (under `vmap`).
    plan_states = dict(states)
    if rc.per_expert:
        plan_states["rhs"] = None
    if rc.per_group:
        plan_states["lhs"] = plan_states["grad"] = None
    plans, _ = plan_call(call, plan_states)
    ql = qr = new_l = new_r = None
    if "fwd" not in st.high_precision_gemms:
        if rc.per_expert or rc.per_group:
            ql, new_l = quantize_tokens(rc, "lhs", lhs, (1,), states["lhs"], plans["lhs"], group_sizes)
            qr, new_r = quantize_weights(rc, rhs, (1,), states["rhs"], plans["rhs"], group_sizes)
        else:
            (ql, new_l), (qr, new_r) = quantize_together(
                call,
                [
                    ("lhs", lhs, (1,), states["lhs"], None, plans["lhs"]),
                    ("rhs", rhs, (1,), states["rhs"], None, plans["rhs"]),
                ],
            )
        if qr is not None and states["rhs"] is not None and st.fp8_all_gather_axes is not None:
            qr = qr.with_values(lay_out_by_axis_mapping(qr.values, st.fp8_all_gather_axes))
    out = ragged_gemm(rc, "fwd", ql, lhs, qr, rhs, group_sizes, call.fwd_precision, call.out_dtype)
    res_l = ql if reusable(call, "lhs", ql) and "drhs" not in st.high_precision_gemms else lhs
    res_r = qr if reusable(call, "rhs", qr) and "dlhs" not in st.high_precision_gemms else rhs
    # As in `dense._fwd`: low-precision arrays leave as their bits, small float32 ones
    # packed (residuals.py).
    with_state = (plan_states["lhs"] is not None, plan_states["rhs"] is not None)  # one scale for all, from the state
    return out, keep((res_l, res_r), (group_sizes, new_l, new_r), (states["grad"], plans["grad"]), with_state)


def _operand(rc: RaggedCall, role: Role, res, axes, key=None):
    """A backward GEMM's operand: the forward's quantized copy, or quantized along `axes`."""
    if isinstance(res, QuantizedArray):
        return res, None
    if role == "rhs":
        return quantize_weights(rc, res, axes, None, None)[0], res
    return quantize(rc.call, role, res, axes, key=key)[0], res


def _bwd(rc: RaggedCall, residuals, g):
    dlhs, drhs, *new = _backward(rc, residuals, g)
    return (dlhs, drhs, None, *state_out(new, rc.call.state_is_max))


@once_per_signature("fp8ax.Fp8RaggedDot.backward")
def _backward(rc: RaggedCall, residuals, g):
    call = rc.call
    st = call.settings
    (res_l, res_r), (group_sizes, new_l, new_r), (g_state, g_plan) = kept(residuals)
    hp = st.high_precision_gemms
    lhs_shape = res_l.values.shape if isinstance(res_l, QuantizedArray) else res_l.shape
    rhs_shape = res_r.values.shape if isinstance(res_r, QuantizedArray) else res_r.shape

    def dlhs(g, shared_g, key):
        # d lhs = g . rhs^T per group: contracts the output features.
        if "dlhs" in hp:
            qg = qr = None
            r1 = res_r.dequantize(jnp.float32) if isinstance(res_r, QuantizedArray) else res_r
        else:
            qg = (
                shared_g
                if shared_g is not None
                else quantize_tokens(rc, "grad", g, (1,), None, None, group_sizes, key)[0]
            )
            qr, r1 = _operand(rc, "rhs", res_r, (2,))
        precision = backward_precision(st.dlhs_precision, qg, qr)
        out = ragged_gemm(rc, "dlhs", qg, g, qr, r1, group_sizes, precision, call.lhs_dtype)
        assert out.shape == lhs_shape, (out.shape, lhs_shape)
        return out

    def drhs(g, shared_g, key):
        # d rhs = lhs^T . g per group: contracts the tokens of each group.
        if "drhs" in hp:
            ql = qg = None
            l2 = res_l.dequantize(jnp.float32) if isinstance(res_l, QuantizedArray) else res_l
        else:
            ql, l2 = _operand(rc, "lhs", res_l, (0,))
            qg = (
                shared_g
                if shared_g is not None
                else quantize_tokens(rc, "grad", g, (0,), None, None, group_sizes, key)[0]
            )
        precision = backward_precision(st.drhs_precision, ql, qg)
        out = ragged_gemm(rc, "drhs", ql, l2, qg, g, group_sizes, precision, call.rhs_dtype)
        assert out.shape == rhs_shape, (out.shape, rhs_shape)
        return out

    def quantize_grad(g):
        return quantize_tokens(rc, "grad", g, (1,), g_state, g_plan, group_sizes)

    return three_gemm_backward(call, g, (new_l, new_r), quantize_grad, dlhs, drhs)


ragged_quantized_dot.defvjp(_fwd, _bwd)


@functools.lru_cache(maxsize=256)
def ragged_out_dtype(lhs_dtype, rhs_dtype, preferred) -> np.dtype:
    out = jax.eval_shape(
        functools.partial(lax.ragged_dot, preferred_element_type=preferred),
        jax.ShapeDtypeStruct((2, 2), lhs_dtype),
        jax.ShapeDtypeStruct((1, 2, 2), rhs_dtype),
        jax.ShapeDtypeStruct((1,), np.int32),
    )
    return np.dtype(out.dtype)
