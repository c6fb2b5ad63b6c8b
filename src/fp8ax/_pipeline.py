# The one GEMM pipeline of fp8ax: quantise, then GEMM, for every recipe.
#
# A call quantises each operand for its role (lhs, rhs: the recipe's forward format;
# grad: its gradient format) along the axes its GEMM contracts, into a `QuantizedArray`,
# and runs the GEMM on the quantised values. One custom VJP computes the forward GEMM and
# both backward GEMMs that way. A stateful recipe (delayed scaling) reads each operand's
# state and returns the new one; the new state leaves as the "gradient" of the state
# (see `_maxgrad.py` for how several uses of a layer are merged). For stateless recipes
# the state is empty and nothing else changes.
#
# What is reused: an operand whose scale is tensor-wise (delayed and tensor-wise current
# scaling, round to nearest) does not depend on the axes a GEMM contracts, so it is
# quantised once, in the forward pass, and the backward GEMMs use that FP8 copy (it is
# also the smaller residual). Row-wise and MX scales depend on the contracting axes, so
# each backward GEMM quantises its operands again along its own axes (as
# TransformerEngine and torchao do), from the high-precision residual.

import functools
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jaxtyping import Array

from . import _boundaries, _haliax
from ._accumulation import emulated_dot_general
from ._boundaries import vma
from ._layout import block_scaled_dot, bwd_layout, oriented_gemm, rescale
from ._maxgrad import as_f32, merged_amax, raw_to_max
from ._quantized import QuantizedArray
from ._recipes import Operand
from ._rounding import content_key
from ._settings import GemmSettings

ROLES = ("lhs", "rhs", "grad")


class Call(NamedTuple):
    """The static part of one call: the settings, whole, plus what the call site adds."""

    settings: GemmSettings
    dims: tuple
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    fwd_precision: lax.Precision | None  # the settings' own, or the caller's `precision`
    state_is_max: tuple[bool, ...]  # which state values arrive in the max-accumulating dtype
    lhs_vma: frozenset  # `jax.shard_map` axes the operands vary over (empty outside shard_map)
    rhs_vma: frozenset


def reduce_to(value, target_vma: frozenset, reduce):
    """Inside `jax.shard_map`: reduce `value` over the manual axes it varies over but
    `target_vma` does not, so it has the type of a value that varies over those only."""
    extra = tuple(sorted(vma(value) - target_vma))
    return reduce(value, extra) if extra else value


def _merge_for(scale):
    """One observation per state: under `jax.shard_map`, a tensor that varies over a manual
    axis its state does not vary over is one shard of a bigger tensor, so its amax is the
    max over the shards; under `jax.vmap`, data axes are merged by `merged_amax`. (Under
    `jax.jit` with shardings, XLA computes the global max by itself.)"""

    def merge(value):
        # `value`: one observation, or a pytree of values observed together.
        return merged_amax(jax.tree.map(lambda v: reduce_to(v, vma(scale), lax.pmax), value), scale)

    return merge


def _lay_out_by_axis_mapping(q, axes: tuple[str, ...] | None):
    """Sharding constraint on a quantised weight: the layout the current Haliax axis
    mapping gives its named axes. The weight is quantised where it lies (sharded, for
    FSDP), so the all-gather that XLA's SPMD partitioner inserts to reach this layout
    moves FP8 values (without it, `"qdq"` mode gathers the dequantised weight).

    The constraint is put on the FP8 bits viewed as uint8. Put on the FP8 array itself,
    XLA:CPU widens it to float32 before partitioning and gathers 4 bytes per value."""
    if axes is None or len(axes) != q.ndim:
        return q
    if _haliax.current_axis_mapping() is None:
        return q
    hax = _haliax.hax()
    bits = lax.bitcast_convert_type(q, jnp.uint8)
    named = hax.NamedArray(bits, tuple(hax.Axis(name, size) for name, size in zip(axes, q.shape)))
    return lax.bitcast_convert_type(hax.shard(named).array, q.dtype)


def _operand_for(call: Call, role: str, x, axes, state=None, key=None, plan=None):
    merge = _merge_for(state[0]) if state is not None else (lambda v: v)
    return Operand(x, tuple(axes), _role_dtype(call, role), state, key, merge, plan, role)


def _quantise(call: Call, role: str, x, axes, state=None, key=None, plan=None):
    """Operand `role` quantised along `axes` (contracted), and its new state. `(None,
    None)` if the settings keep that operand in high precision."""
    return _quantise_together(call, [(role, x, axes, state, key, plan)])[0]


def _quantise_together(call: Call, items) -> list:
    """`_quantise` of several `(role, x, axes, state, key, plan)` of one call, each
    recipe quantising its operands in one `quantize_operands` (so that delayed scaling
    decides once whether they calibrate)."""
    out = [(None, None)] * len(items)
    for recipe, idx in _by_recipe(call, [item[0] for item in items]):
        ops = [_operand_for(call, *items[i]) for i in idx]
        for i, op, result in zip(idx, ops, recipe.quantize_operands(ops)):
            out[i] = _checked_result(recipe, op, result)
    return out


def _checked_result(recipe, op, result):
    """A recipe's `(quantized, new_state)` for `op`, checked where a mistake would
    otherwise surface far away (in the VJP's cotangents, or as a wrong state)."""
    name = type(recipe).__name__
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise TypeError(
            f"{name}.quantize_operands must give a `(quantized, new_state)` pair per operand, got {result!r}."
        )
    q, new = result
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"{name} must quantise to an `fp8ax.QuantizedArray`, got {type(q).__name__}.")
    if op.state is None:
        return result
    if not (isinstance(new, tuple | list) and len(new) == len(op.state)):
        raise TypeError(
            f"{name} must return the new state as a tuple of {len(op.state)} arrays (one per field of its state "
            f"type, in order, as it received them), got {type(new).__name__}"
            + (f" of length {len(new)}." if isinstance(new, tuple | list) else ".")
        )
    for old, value in zip(op.state, new):
        if jnp.shape(value) != jnp.shape(old):
            raise ValueError(
                f"{name} returned a new state array of shape {jnp.shape(value)} for one of shape {jnp.shape(old)}."
            )
    return q, tuple(new)


def _by_recipe(call: Call, roles) -> list:
    """`(recipe, indices into roles)` for the roles a recipe quantises, in order."""
    groups = []
    for i, role in enumerate(roles):
        recipe = call.settings.operand_recipe(role)
        if recipe is None:
            continue
        for group in groups:
            if group[0] == recipe:
                group[1].append(i)
                break
        else:
            groups.append((recipe, [i]))
    return groups


def _grad_once(call: Call) -> bool:
    """Whether the output gradient is quantised once for both backward GEMMs: a
    tensor-wise, round-to-nearest recipe (and a stateful recipe observes it once)."""
    recipe = call.settings.operand_recipe("grad")
    hp = call.settings.high_precision_gemms
    return (
        recipe is not None
        and recipe.contraction_independent("grad")
        and not recipe.stochastic("grad")
        and not ("dlhs" in hp and "drhs" in hp)
    )


# The three GEMMs of a call: (name, its operands in order, the dtype it writes).
def _gemms(call: Call):
    return (
        ("fwd", "lhs", "rhs", call.out_dtype),
        ("dlhs", "grad", "rhs", call.lhs_dtype),
        ("drhs", "lhs", "grad", call.rhs_dtype),
    )


def _role_dtype(call: Call, role: str) -> np.dtype:
    return call.settings.operand_recipe(role).dtype_for(role)


def _planned_scales(call: Call, plans: dict) -> dict:
    """Each role's planned scale (`AbstractScalingRecipe.planned_scale`), None where
    the role has no plan or its recipe plans no scale."""
    return {r: None if plans[r] is None else call.settings.operand_recipe(r).planned_scale(plans[r]) for r in ROLES}


def _is_fp8(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _is_16_bit_float(dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _plans(call: Call, states: dict) -> tuple[dict, dict]:
    """Each stateful operand's plan (see `AbstractScalingRecipe.plan`): a recipe plans
    the operands it quantises with state in this call, forward ones and the gradient,
    together, in the forward pass.

    Also the output scale of each GEMM whose two operands have planned scales (known
    from the state alone, delayed scaling after its first call) and whose scales go into
    its epilogue: their product, computed here beside the scales. The plans and the
    products go behind one optimisation barrier. Without it XLA:GPU merges the scalar
    arithmetic of a cast's scale with that of the next state (which reads the tensor's
    amax), and the FP8 cast waits on the reduction of its own input; and a product
    computed next to its GEMM is a kernel of its own on the cuBLASLt path."""
    plans = dict.fromkeys(ROLES)
    roles = [r for r in ROLES if states[r] is not None]
    if "fwd" in call.settings.high_precision_gemms:
        roles = [r for r in roles if r == "grad"]
    if not _grad_once(call):
        roles = [r for r in roles if r != "grad"]
    for recipe, idx in _by_recipe(call, roles):
        planned = recipe.plan([states[roles[i]] for i in idx], [_role_dtype(call, roles[i]) for i in idx])
        plans.update((roles[i], p) for i, p in zip(idx, planned))
    scales = _planned_scales(call, plans)
    if all(s is None for s in scales.values()):
        return plans, {}
    products = {}
    for name, a, b, out_dtype in _gemms(call):
        sa, sb = scales.get(a), scales.get(b)
        if sa is not None and sb is not None and _epilogue_scaled(call, name, a, b, out_dtype):
            products[name] = lax.mul(_f32(sa), _f32(sb))
    return lax.optimization_barrier((plans, products))


def _epilogue_scaled(call: Call, name: str, a: str, b: str, out_dtype) -> bool:
    """Whether GEMM `name` runs on two FP8 operands with tensor-wise scales and puts
    their product into its epilogue (`_gemm`'s first branch), as far as the settings
    tell; `_gemm` checks the operands themselves."""
    st = call.settings
    if st.mode != "direct" or name in st.high_precision_gemms:
        return False
    return _is_fp8(_role_dtype(call, a)) and _is_fp8(_role_dtype(call, b)) and _is_16_bit_float(out_dtype)


def _reusable(call: Call, role: str, q) -> bool:
    """Whether a forward-quantised operand serves the backward GEMM too."""
    recipe = call.settings.operand_recipe(role)
    return q is not None and recipe.contraction_independent(role)


def _plainly_scaled(q) -> bool:
    """Whether `q`'s scale is a float32 multiplier of its values (not E8M0's power of two,
    no implicit exponent): what a kernel's scaling multiplies by."""
    return np.dtype(q.scale.dtype) == np.dtype(np.float32) and q.int_exponent == 0


def _low_precision_pair(qa, qb, dims) -> str | None:
    """The accumulation a GEMM of the two quantised values can run with, if any: their
    scales are constant along the axes it contracts, so they factor out."""
    (lc, rc), _ = dims
    if not (qa.constant_along(lc) and qb.constant_along(rc) and _plainly_scaled(qa) and _plainly_scaled(qb)):
        return None
    da, db = np.dtype(qa.values.dtype), np.dtype(qb.values.dtype)
    if da == db == np.dtype(np.int8):
        return "int32"
    if _is_fp8(da) and _is_fp8(db):
        return "float32"
    return None


def _epilogue_dtype(qa, qb, out_dtype) -> bool:
    """Whether the scales of an FP8 GEMM go into its epilogue in `out_dtype`: two
    tensor-wise scales and a 16-bit floating output."""
    return np.ndim(qa.scale) == np.ndim(qb.scale) == 0 and _is_16_bit_float(out_dtype)


def _f32(x):
    return lax.convert_element_type(jnp.asarray(x), np.float32)


# A GEMM is split into chunks of the contraction no shorter than this; scales that vary
# faster (per element) are dequantised instead.
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


def _fp8_pair(qa, qb) -> bool:
    return all(q is not None and _is_fp8(q.values.dtype) for q in (qa, qb))


def _dequantise(q: QuantizedArray, dtype):
    if q.outer_scale is not None:
        return q.dequantize(dtype, outer=False)  # the outer scale multiplies the GEMM's result
    if q.layout == "tensor" and _plainly_scaled(q):
        # XLA's pattern for an FP8 GEMM: convert to the compute dtype, multiply by the
        # scale in that dtype, dot. `"qdq"` mode relies on XLA rewriting exactly this.
        return q.values.astype(dtype) * q.scale.astype(dtype)
    # Row and block scales: dequantise in float32 (exact for power-of-two MX scales).
    return q.dequantize(dtype)


def _emulated(call: Call, qa, qb):
    """The emulated accumulation for a GEMM of `qa` and `qb`, as a `(x, y, dims) ->
    float32` function, if the settings ask for one and both operands are quantised to a
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


def _gemm(call: Call, qa, a, qb, b, dims, precision, out_dtype, scale=None):
    """`a . b` from their quantised forms (`None`: use the high-precision operand).
    `scale`, if given, is `qa.scale * qb.scale` in float32, computed beforehand."""
    ref = np.result_type(call.lhs_dtype, call.rhs_dtype)
    emulate = _emulated(call, qa, qb)
    if _block_scaled_pair(call, qa, qb, dims):
        return _block_scaled_gemm(qa, qb, dims).astype(out_dtype)
    if call.settings.mode == "direct" and qa is not None and qb is not None:
        pair = _low_precision_pair(qa, qb, dims)
        if pair is None and _fp8_pair(qa, qb) and _plainly_scaled(qa) and _plainly_scaled(qb):
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
            emulated = emulate is not None and pair == "float32"  # the emulation replaces the GEMM
            if pair == "float32" and not emulated and _epilogue_dtype(qa, qb, out_dtype):
                # A 16-bit layer: the GEMM writes its dtype and the scales multiply that, one
                # scalar in the same dtype. XLA:GPU folds the multiply (and the dtype) into
                # the FP8 GEMM's epilogue, on the cuBLASLt and the Triton path alike, so no
                # float32 product is written and read again. (An f32 product, scaled, then
                # converted is what XLA leaves as a separate kernel: with its excess-
                # precision rule the consumers read the f32 product.) XLA:CPU rounds the
                # product to the dtype before the scale multiply, a GPU after: at most one
                # unit in the last place apart.
                out = lax.dot_general(qa.values, qb.values, dims, precision=precision, preferred_element_type=out_dtype)
                if scale is None:
                    scale = lax.mul(_f32(qa.scale), _f32(qb.scale))
                scale = lax.convert_element_type(scale, out_dtype)
                return lax.mul(out, lax.broadcast_in_dim(scale, out.shape, ()))
            if emulated:
                acc = emulate(qa.values, qb.values, dims)
            else:
                acc_dtype = jnp.int32 if pair == "int32" else jnp.float32
                acc = lax.dot_general(qa.values, qb.values, dims, precision=precision, preferred_element_type=acc_dtype)
            return rescale(
                acc, qa.expanded_scale(), qa.values.shape, qb.expanded_scale(), qb.values.shape, dims
            ).astype(out_dtype)
    # Dequantise-then-GEMM: `"qdq"` mode, MX blocks, or an operand kept in high precision.
    # Two-level scales (NVFP4): the inner dequantisation (FP4 values times E4M3 scales)
    # is exact, and the per-tensor outer scales multiply the GEMM's result.
    outer = _outer_product(qa, qb)
    if emulate is not None:
        # Block formats: the values times their block scales, exact in float32.
        out = emulate(qa.dequantize(np.float32, outer=False), qb.dequantize(np.float32, outer=False), dims)
        return _times_outer(out, outer).astype(out_dtype)
    da = _dequantise(qa, ref) if qa is not None else a.astype(ref)
    db = _dequantise(qb, ref) if qb is not None else b.astype(ref)
    pref = jnp.float32 if ref == np.float32 or outer is not None else None
    out = lax.dot_general(da, db, dims, precision=precision, preferred_element_type=pref)
    return _times_outer(out, outer).astype(out_dtype)


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


def _ndim(res) -> int:
    return res.values.ndim if isinstance(res, QuantizedArray) else res.ndim


def _states(raw) -> dict:
    if not raw:
        return dict.fromkeys(ROLES)
    # The same recipe's state for each role: as many arrays each, in its `fields` order.
    f32, n = [as_f32(v) for v in raw], len(raw) // len(ROLES)
    return {role: tuple(f32[n * i : n * (i + 1)]) for i, role in enumerate(ROLES)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def quantized_dot(call: Call, lhs, rhs, *state) -> Array:
    """`dot_general(lhs, rhs, call.dims)` computed on quantised operands; `state` holds the
    raw arrays of the lhs, rhs and grad states of a stateful recipe, one after the other
    (each in its `fields` order: `(lhs scale, lhs history, rhs ..., grad ...)` for delayed
    scaling), and is empty otherwise. The VJP returns the new state as the state's cotangent."""
    return _fwd(call, lhs, rhs, *state)[0]


def _fwd(call: Call, lhs, rhs, *raw):
    st = call.settings
    states = _states(raw)
    plans, products = _plans(call, states)
    (lc, rc), _ = call.dims
    ql = qr = new_l = new_r = None
    if "fwd" not in st.high_precision_gemms:
        (ql, new_l), (qr, new_r) = _quantise_together(
            call,
            [("lhs", lhs, lc, states["lhs"], None, plans["lhs"]), ("rhs", rhs, rc, states["rhs"], None, plans["rhs"])],
        )
        if qr is not None and states["rhs"] is not None and st.fp8_all_gather_axes is not None:
            qr = qr.with_values(_lay_out_by_axis_mapping(qr.values, st.fp8_all_gather_axes))
    # A GEMM's precomputed output scale serves only operands quantised with the planned
    # scales (the very arrays the plan holds).
    planned = _planned_scales(call, plans)

    def is_planned(q, role):
        return q is not None and planned[role] is not None and q.scale is planned[role]

    fwd_scale = products.get("fwd") if is_planned(ql, "lhs") and is_planned(qr, "rhs") else None
    out = _gemm(call, ql, lhs, qr, rhs, call.dims, call.fwd_precision, call.out_dtype, fwd_scale)
    # Keep the quantised operand for the backward pass where it serves as it is (tensor
    # scale, GEMM not in high precision); otherwise the operand itself.
    res_l = ql if _reusable(call, "lhs", ql) and "drhs" not in st.high_precision_gemms else lhs
    res_r = qr if _reusable(call, "rhs", qr) and "dlhs" not in st.high_precision_gemms else rhs
    # The backward GEMMs' output scales, where the forward copy they reuse is planned
    # (the gradient's side is checked in `_bwd`).
    bwd_scales = (
        products.get("dlhs") if res_r is qr and is_planned(qr, "rhs") else None,
        products.get("drhs") if res_l is ql and is_planned(ql, "lhs") else None,
    )
    return out, (res_l, res_r, new_l, new_r, states["grad"], plans["grad"], bwd_scales)


def _bwd(call: Call, residuals, g):
    if any(call.state_is_max) and _boundaries.in_unchecked_shard_map_transpose():
        raise ValueError(_boundaries.UNCHECKED_SHARD_MAP)
    st = call.settings
    res_l, res_r, new_l, new_r, g_state, g_plan, (dlhs_scale, drhs_scale) = residuals
    (_, _), (_, rb) = call.dims
    lay = bwd_layout(call.dims, _ndim(res_l), _ndim(res_r))
    hp = st.high_precision_gemms
    grad_recipe = st.operand_recipe("grad")

    stochastic = _stochastic(grad_recipe)
    keys = jax.random.split(content_key(grad_recipe.seed, g)) if stochastic else (None, None)
    # A tensor-wise, round-to-nearest gradient is quantised once for both GEMMs (and a
    # stateful recipe observes it once).
    shared_g, new_g = None, None
    if _grad_once(call):
        shared_g, new_g = _quantise(call, "grad", g, lay.g_rfree, g_state, plan=g_plan)
    g_planned = g_plan is not None and shared_g is not None and (shared_g.scale is grad_recipe.planned_scale(g_plan))
    if not g_planned:
        dlhs_scale = drhs_scale = None

    # d lhs = g . rhs, contracting g's rhs-free dims with rhs's free dims.
    if "dlhs" in hp:
        (qg1, g1), (qr1, r1) = (None, g), (None, res_r)
    else:
        qg1, g1 = (
            (shared_g, g) if shared_g is not None else (_quantise(call, "grad", g, lay.g_rfree, key=keys[0])[0], g)
        )
        qr1, r1 = _operand(call, "rhs", res_r, lay.r_free)
    dlhs_scale = dlhs_scale if (qg1 is shared_g and qr1 is res_r) else None
    dlhs = oriented_gemm(
        _gemm_fn(call, qg1, g1, qr1, r1, st.dlhs_precision, call.lhs_dtype, dlhs_scale),
        lay.g_rfree,
        lay.r_free,
        lay.g_batch,
        rb,
        lay.dlhs_ab,
        lay.dlhs_ba,
    )
    drhs = _batchable_drhs(call)(res_l, res_r, g, shared_g, drhs_scale, keys[1])
    # Inside `jax.shard_map` the cotangent of an operand that does not vary over a manual
    # axis (a replicated weight) is summed over it, as JAX's own `dot_general` does.
    dlhs = reduce_to(dlhs, call.lhs_vma, lax.psum)
    drhs = reduce_to(drhs, call.rhs_vma, lax.psum)
    if not call.state_is_max:
        return dlhs, drhs
    new = [v for pair in (new_l, new_r, new_g) for v in pair]
    cts = tuple(
        raw_to_max(v.astype(jnp.float32)) if m else v.astype(jnp.float32) for v, m in zip(new, call.state_is_max)
    )
    return (dlhs, drhs, *cts)


def _stochastic(recipe) -> bool:
    return recipe is not None and recipe.stochastic("grad")


def _operand(call: Call, role: str, res, axes, key=None):
    """A backward GEMM's operand: the forward's FP8 copy, or quantised along `axes`."""
    if isinstance(res, QuantizedArray):
        return res, res.values
    return _quantise(call, role, res, axes, key=key)[0], res


def _gemm_fn(call: Call, qa, a, qb, b, precision, out_dtype, scale=None):
    """A backward GEMM. On two FP8 operands its default precision is `HIGHEST`: XLA:GPU
    then accumulates in full precision, not with cuBLASLt's fast FP8 accumulation, which
    loses accuracy over the long contractions of the weight gradient (TransformerEngine,
    torchao and DeepSeek-V3 make the same choice). Any other precision is kept."""
    if precision in (None, lax.Precision.DEFAULT) and _fp8_pair(qa, qb):
        precision = lax.Precision.HIGHEST

    def gemm(swapped, dims):
        if swapped:
            return _gemm(call, qb, b, qa, a, dims, precision, out_dtype, scale)
        return _gemm(call, qa, a, qb, b, dims, precision, out_dtype, scale)

    return gemm


def _drhs(call: Call, res_l, res_r, g, shared_g, scale, key):
    """d rhs = lhs . g, contracting lhs's free dims with g's lhs-free dims. (`res_r` only
    gives the layout; `shared_g` is the gradient quantised once for both GEMMs, if it is;
    `scale` the GEMM's output scale, if it was planned.)"""
    st = call.settings
    (_, _), (lb, _) = call.dims
    lay = bwd_layout(call.dims, _ndim(res_l), _ndim(res_r))
    if "drhs" in st.high_precision_gemms:
        (ql, lhs), (qg, g2) = (None, res_l), (None, g)
    else:
        res_l, g = _rotated_for_drhs(call, res_l, g, shared_g, lay.l_free, lay.g_lfree)
        ql, lhs = _operand(call, "lhs", res_l, lay.l_free)
        qg, g2 = (shared_g, g) if shared_g is not None else (_quantise(call, "grad", g, lay.g_lfree, key=key)[0], g)
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
    return jnp.transpose(out, np.argsort(rest + list(axes)))


def _rotated_for_drhs(call: Call, res_l, g, shared_g, l_axes, g_axes):
    """The weight gradient's operands, rotated along their contraction if the recipe asks
    for it (`weight_gradient_rotation`) and both are quantised here from high precision
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
    instead of one. When the lhs and the gradient are quantised with scales the examples
    share (they come from the state, or the operand stays in high precision), the mapped
    axis is one more free axis of the lhs, so the rule folds it in: the same quantised
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
    """Whether the weight gradient quantises the lhs with a scale the examples share."""
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
        "`jax.vmap`, so each example is quantised with its own scale, and its weight gradient "
        "is one GEMM per example (an outer product each), summed: much slower than one GEMM. "
        "Call the layer on the whole batch, or use a recipe whose scales the examples share "
        "(`fp8ax.DelayedScaling`, the default), which fp8ax runs as one batched GEMM. "
        "(This warning is shown once per recipe.)",
        stacklevel=2,
    )


quantized_dot.defvjp(_fwd, _bwd)
