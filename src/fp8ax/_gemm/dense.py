# The one GEMM pipeline of fp8ax: quantize, then GEMM, for every recipe.
#
# A call quantizes each operand for its role (lhs, rhs: the recipe's forward format;
# grad: its gradient format) along the axes its GEMM contracts, into a `QuantizedArray`,
# and runs the GEMM on the quantized values. One custom VJP computes the forward GEMM and
# both backward GEMMs that way. A stateful recipe (delayed scaling) reads each operand's
# state and returns the new one; the new state leaves as the "gradient" of the state
# (see `_maxgrad.py` for how several uses of a layer are merged). For stateless recipes
# the state is empty and nothing else changes.
#
# What is reused: an operand whose scale is tensor-wise (delayed and tensor-wise current
# scaling, round to nearest) does not depend on the axes a GEMM contracts, so it is
# quantized once, in the forward pass, and the backward GEMMs use that FP8 copy (it is
# also the smaller residual). Row-wise and MX scales depend on the contracting axes, so
# each backward GEMM quantizes its operands again along its own axes (as
# TransformerEngine and torchao do), from the high-precision residual.

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from .. import _boundaries
from .._quantized import QuantizedArray
from .backward import backward_precision, three_gemm_backward
from .call import ROLES, Call, reusable, states_by_role
from .dims import bwd_layout, oriented_gemm, sharded_like
from .kernels import (
    ndim_of,
    run_gemm,
)
from .operands import lay_out_by_axis_mapping, quantize, quantize_together
from .passes import once_per_signature, state_in, state_out
from .plans import plan_call, planned_scales
from .residuals import keep, kept
from .settings import Role, stateful_recipe


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def quantized_dot(call: Call, lhs, rhs, *state) -> Array:
    """`dot_general(lhs, rhs, call.dims)` computed on quantized operands; `state` holds the
    raw arrays of a stateful recipe's state of the three operands, in its `fields` order,
    each with a role axis (`Call.state_role_axes`; for delayed scaling one array,
    `(..., 3, history_length + 2)`), and is empty otherwise. The VJP returns the new state
    as the state's cotangent."""
    return _fwd(call, lhs, rhs, *state)[0]


def _fwd(call: Call, lhs, rhs, *raw):
    return _forward(call, lhs, rhs, *state_in(raw))


@once_per_signature("fp8ax.Fp8DotGeneral.forward")
def _forward(call: Call, lhs, rhs, *raw):
    st = call.settings
    states = states_by_role(raw, call.state_role_axes)
    plans, products = plan_call(call, states)
    (lc, rc), _ = call.dims
    ql = qr = new_l = new_r = None
    if "fwd" not in st.high_precision_gemms:
        (ql, new_l), (qr, new_r) = quantize_together(
            call,
            [("lhs", lhs, lc, states["lhs"], None, plans["lhs"]), ("rhs", rhs, rc, states["rhs"], None, plans["rhs"])],
        )
        if qr is not None and states["rhs"] is not None and st.fp8_all_gather_axes is not None:
            qr = qr.with_values(lay_out_by_axis_mapping(qr.values, st.fp8_all_gather_axes))
    # A GEMM's precomputed output scale serves only operands quantized with the planned
    # scales (the very arrays the plan holds).
    planned = planned_scales(call, plans)

    def is_planned(q, role):
        return q is not None and planned[role] is not None and q.scale is planned[role]

    fwd_scale = products.get("fwd") if is_planned(ql, "lhs") and is_planned(qr, "rhs") else None
    out = run_gemm(call, ql, lhs, qr, rhs, call.dims, call.fwd_precision, call.out_dtype, fwd_scale)
    # Keep the quantized operand for the backward pass where it serves as it is (tensor
    # scale, GEMM not in high precision); otherwise the operand itself.
    res_l = ql if reusable(call, "lhs", ql) and "drhs" not in st.high_precision_gemms else lhs
    res_r = qr if reusable(call, "rhs", qr) and "dlhs" not in st.high_precision_gemms else rhs
    # The backward GEMMs' output scales, where the forward copy they reuse is planned
    # (the gradient's side is checked in `_bwd`).
    bwd_scales = (
        products.get("dlhs") if res_r is qr and is_planned(qr, "rhs") else None,
        products.get("drhs") if res_l is ql and is_planned(ql, "lhs") else None,
    )
    # Low-precision arrays leave as their bits, which a saving remat policy cannot round,
    # and the small float32 and bool ones in two vectors, two kernels per layer inside a
    # scan (residuals.py).
    with_state = (states["lhs"] is not None, states["rhs"] is not None)
    return out, keep((res_l, res_r), (new_l, new_r), (states["grad"], plans["grad"], bwd_scales), with_state)


def _bwd(call: Call, residuals, g):
    if any(call.state_is_max) and _boundaries.in_unchecked_shard_map_transpose():
        raise ValueError(_boundaries.UNCHECKED_SHARD_MAP)
    dlhs, drhs, *new = _backward(call, residuals, g)
    return (dlhs, drhs, *state_out(new, call.state_is_max))


@once_per_signature("fp8ax.Fp8DotGeneral.backward")
def _backward(call: Call, residuals, g):
    st = call.settings
    (res_l, res_r), (new_l, new_r), (g_state, g_plan, (dlhs_scale, drhs_scale)) = kept(residuals)
    (_, _), (_, rb) = call.dims
    lay = bwd_layout(call.dims, ndim_of(res_l), ndim_of(res_r))

    def planned(shared_g, scale):
        # A GEMM's planned output scale serves only the gradient quantized with its
        # planned scale (the forward side's copy is checked where it is used).
        if g_plan is None or shared_g is None or shared_g.scale is not stateful_recipe(st).planned_scale(g_plan):
            return None
        return scale

    def dlhs(g, shared_g, key):
        # d lhs = g . rhs, contracting g's rhs-free dims with rhs's free dims.
        if "dlhs" in st.high_precision_gemms:
            (qg, g1), (qr, r1) = (None, g), (None, res_r)
        else:
            qg = shared_g if shared_g is not None else quantize(call, "grad", g, lay.g_rfree, key=key)[0]
            g1 = g
            qr, r1 = _operand(call, "rhs", res_r, lay.r_free)
        scale = planned(shared_g, dlhs_scale) if (qg is shared_g and qr is res_r) else None
        out = oriented_gemm(
            _gemm_fn(call, qg, g1, qr, r1, st.dlhs_precision, call.lhs_dtype, scale),
            lay.g_rfree,
            lay.r_free,
            lay.g_batch,
            rb,
            lay.dlhs_ab,
            lay.dlhs_ba,
        )
        return sharded_like(out, res_l)

    def drhs(g, shared_g, key):
        scale = planned(shared_g, drhs_scale)
        return sharded_like(_batchable_drhs(call)(res_l, res_r, g, shared_g, scale, key), res_r)

    def quantize_grad(g):
        return quantize(call, "grad", g, lay.g_rfree, g_state, plan=g_plan)

    return three_gemm_backward(call, g, (new_l, new_r), quantize_grad, dlhs, drhs)


def _operand(call: Call, role: Role, res, axes, key=None):
    """A backward GEMM's operand: the forward's FP8 copy, or quantized along `axes`."""
    if isinstance(res, QuantizedArray):
        return res, res.values
    return quantize(call, role, res, axes, key=key)[0], res


def _gemm_fn(call: Call, qa, a, qb, b, precision, out_dtype, scale=None):
    """A backward GEMM, at `backward_precision`."""
    precision = backward_precision(precision, qa, qb)

    def gemm(swapped, dims):
        if swapped:
            return run_gemm(call, qb, b, qa, a, dims, precision, out_dtype, scale)
        return run_gemm(call, qa, a, qb, b, dims, precision, out_dtype, scale)

    return gemm


def _drhs(call: Call, res_l, res_r, g, shared_g, scale, key):
    """d rhs = lhs . g, contracting lhs's free dims with g's lhs-free dims. (`res_r` only
    gives the layout; `shared_g` is the gradient quantized once for both GEMMs, if it is;
    `scale` the GEMM's output scale, if it was planned.)"""
    st = call.settings
    (_, _), (lb, _) = call.dims
    lay = bwd_layout(call.dims, ndim_of(res_l), ndim_of(res_r))
    if "drhs" in st.high_precision_gemms:
        (ql, lhs), (qg, g2) = (None, res_l), (None, g)
    else:
        res_l, g = _rotated_for_drhs(call, res_l, g, shared_g, lay.l_free, lay.g_lfree)
        ql, lhs = _operand(call, "lhs", res_l, lay.l_free)
        qg, g2 = (shared_g, g) if shared_g is not None else (quantize(call, "grad", g, lay.g_lfree, key=key)[0], g)
    scale = scale if (ql is res_l and shared_g is not None and qg is shared_g) else None
    return oriented_gemm(
        _gemm_fn(call, ql, lhs, qg, g2, st.drhs_precision, call.rhs_dtype, scale),
        lay.l_free,
        lay.g_lfree,
        lb,
        lay.g_batch,
        lay.drhs_ab,
        lay.drhs_ba,
    )


def _rotate(x, axes, rotation):
    """`x` with its `axes` (flattened in order) multiplied, `n` consecutive elements at a
    time, by the `(n, n)` matrix `rotation`."""
    n = rotation.shape[0]
    rest = [d for d in range(x.ndim) if d not in axes]
    moved = jnp.transpose(x, rest + list(axes))
    lead = moved.shape[: len(rest)]
    blocks = moved.reshape(lead + (-1, n)).astype(jnp.float32)
    out = jnp.einsum("...k,jk->...j", blocks, rotation, precision=lax.Precision.HIGHEST)
    out = out.reshape(moved.shape).astype(x.dtype)
    return jnp.transpose(out, np.argsort(rest + list(axes)).tolist())


def _rotated_for_drhs(call: Call, res_l, g, shared_g, l_axes, g_axes):
    """The weight gradient's operands, rotated along their contraction if the recipe asks
    for it (`weight_gradient_rotation`) and both are quantized here from high precision
    by the same recipe, with a contraction a multiple of the rotation's size long."""
    st = call.settings
    recipe = st.operand_recipe("lhs")
    if recipe is None or recipe != st.operand_recipe("grad") or shared_g is not None:
        return res_l, g
    if isinstance(res_l, QuantizedArray):
        return res_l, g
    rotation = recipe.weight_gradient_rotation()
    if rotation is None:
        return res_l, g
    length = int(np.prod([res_l.shape[d] for d in l_axes], dtype=np.int64))
    if not l_axes or length % rotation.shape[0]:
        return res_l, g
    return _rotate(res_l, tuple(l_axes), rotation), _rotate(g, tuple(g_axes), rotation)


@functools.cache
def _batchable_drhs(call: Call):
    """The weight gradient of `call`, with a `vmap` rule for per-example calls.

    `jax.vmap` of a custom VJP vmaps its backward pass. For a per-example layer (inputs
    mapped, weight and state not: `jax.vmap(eqx.nn.Linear(...))`) that computes one
    weight gradient per example, an outer product each, and sums them: B GEMMs of rank 1
    instead of one. When the lhs and the gradient are quantized with scales the examples
    share (they come from the state, or the operand stays in high precision), the mapped
    axis is one more free axis of the lhs, so the rule folds it in: the same quantized
    values, one GEMM that also contracts over the examples. Otherwise (per-example
    scales: current scaling, MX, int8) it vmaps, as JAX would, and warns once. The input
    gradient needs no rule: `vmap` of `g . rhs` with an unmapped `rhs` is one GEMM already.
    """

    @custom_vmap
    def drhs(res_l, res_r, g, shared_g, scale, key):
        return _drhs(call, res_l, res_r, g, shared_g, scale, key)

    @drhs.def_vmap
    def rule(axis_size, in_batched, res_l, res_r, g, shared_g, scale, key):
        l_b, r_b, g_b, sg_b, s_b, k_b = in_batched
        lhs_b = l_b.values if isinstance(res_l, QuantizedArray) else l_b
        per_example = lhs_b and g_b and not any(jax.tree.leaves(r_b))
        if per_example and _shared_lhs(call, res_l, l_b) and _shared_grad(call, shared_g, sg_b):
            (lc, rc), (lb, rb) = call.dims
            dims = ((tuple(a + 1 for a in lc), rc), (tuple(a + 1 for a in lb), rb))
            # In the output, and so in `g`, batch dimensions come first, then the lhs's
            # free ones in order: the examples' axis is the first of those.
            g = jnp.moveaxis(g, 0, len(lb))
            if shared_g is not None:
                shared_g = shared_g.with_values(jnp.moveaxis(shared_g.values, 0, len(lb)))
            # The scales are the examples' shared ones, and so is their product.
            scale = None if s_b else scale
            return _batchable_drhs(call._replace(dims=dims))(res_l, res_r, g, shared_g, scale, key), False
        if per_example:
            _warn_per_example(call)
        axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
        out = jax.vmap(functools.partial(_drhs, call), in_axes=axes, axis_size=axis_size)(
            res_l, res_r, g, shared_g, scale, key
        )
        return out, True

    return drhs


def _shared_lhs(call: Call, res_l, l_b) -> bool:
    """Whether the weight gradient quantizes the lhs with a scale the examples share."""
    if call.settings.operand_recipe("lhs") is None or "drhs" in call.settings.high_precision_gemms:
        return True
    return isinstance(res_l, QuantizedArray) and not l_b.scale  # the forward's FP8 copy


def _shared_grad(call: Call, shared_g, sg_b) -> bool:
    if call.settings.operand_recipe("grad") is None or "drhs" in call.settings.high_precision_gemms:
        return True
    return shared_g is not None and not sg_b.scale


_WARNED: set = set()


def _warn_per_example(call: Call):
    recipes = tuple(repr(call.settings.operand_recipe(r)) for r in ROLES)
    if recipes in _WARNED:
        return
    _WARNED.add(recipes)
    # The recipe by its class name: its repr runs over several lines.
    names = sorted({type(call.settings.operand_recipe(r)).__name__ for r in ROLES} - {"NoneType"})
    warnings.warn(
        f"fp8ax: a layer with per-example scales ({', '.join(names)}) is called per example under "
        "`jax.vmap`, so each example is quantized with its own scale, and its weight gradient "
        "is one GEMM per example (an outer product each), summed: much slower than one GEMM. "
        "Call the layer on the whole batch, or use a recipe whose scales the examples share "
        "(`fp8ax.DelayedScaling`, the default), which fp8ax runs as one batched GEMM. "
        "(This warning is shown once per recipe.)",
        stacklevel=2,
    )


quantized_dot.defvjp(_fwd, _bwd)
