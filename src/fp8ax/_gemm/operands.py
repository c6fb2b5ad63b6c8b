# Quantizing a GEMM's operands: the call's settings, each operand's recipe and format,
# the plans that let a recipe work on several operands of one call at once, the state
# handed in and out, and the checks on what a recipe returns. The dense and the grouped
# GEMMs (and serving) quantize through these.

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _haliax
from .._boundaries import vma
from .._maxgrad import as_f32, merged_amax
from .._quantized import QuantizedArray
from .._recipes import Operand
from .._rounding import content_key
from .settings import GemmSettings, Role, quantizing_recipe, stateful_recipe

ROLES: tuple[Role, ...] = ("lhs", "rhs", "grad")


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


def lay_out_by_axis_mapping(q, axes: tuple[str, ...] | None):
    """Sharding constraint on a quantized weight: the layout the current Haliax axis
    mapping gives its named axes. The weight is quantized where it lies (sharded, for
    FSDP), so the all-gather that XLA's SPMD partitioner inserts to reach this layout
    moves FP8 values (without it, `"qdq"` mode gathers the dequantized weight).

    The constraint is put on the FP8 bits viewed as uint8. Put on the FP8 array itself,
    XLA:CPU widens it to float32 before partitioning and gathers 4 bytes per value."""
    if axes is None or len(axes) != q.ndim:
        return q
    if _haliax.current_axis_mapping() is None:
        return q
    bits = lax.bitcast_convert_type(q, jnp.uint8)
    return lax.bitcast_convert_type(_haliax.shard_by_axis_mapping(bits, axes), q.dtype)


def operand_for(call: Call, role: Role, x, axes, state=None, key=None, plan=None):
    merge = _merge_for(state[0]) if state is not None else (lambda v: v)
    return Operand(x, tuple(axes), _role_dtype(call, role), state, key, merge, plan, role)


def quantize(call: Call, role: Role, x, axes, state=None, key=None, plan=None):
    """Operand `role` quantized along `axes` (contracted), and its new state. `(None,
    None)` if the settings keep that operand in high precision."""
    return quantize_together(call, [(role, x, axes, state, key, plan)])[0]


def quantize_together(call: Call, items) -> list:
    """`quantize` of several `(role, x, axes, state, key, plan)` of one call, each
    recipe quantizing its operands in one `quantize_operands` (so that delayed scaling
    decides once whether they calibrate)."""
    out: list[Any] = [(None, None)] * len(items)
    for recipe, idx in _by_recipe(call, [item[0] for item in items]):
        ops = [operand_for(call, *items[i]) for i in idx]
        for i, op, result in zip(idx, ops, recipe.quantize_operands(ops)):
            out[i] = checked_result(recipe, op, result)
    return out


def checked_result(recipe, op, result):
    """A recipe's `(quantized, new_state)` for `op`, checked where a mistake would
    otherwise surface far away (in the VJP's cotangents, or as a wrong state)."""
    name = type(recipe).__name__
    if not (isinstance(result, tuple | list) and len(result) == 2):
        raise TypeError(
            f"{name}.quantize_operands must give a `(quantized, new_state)` pair per operand, got {result!r}."
        )
    q, new = result
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"{name} must quantize to an `fp8ax.QuantizedArray`, got {_described(q)}.")
    if op.state is None:
        return result
    if not (isinstance(new, tuple | list) and len(new) == len(op.state)):
        raise TypeError(
            f"{name} must return the new state as a tuple of {len(op.state)} arrays (one per field of its state "
            f"type, in order, as it received them), got {_described(new)}"
            + (f" of length {len(new)}." if isinstance(new, tuple | list) else ".")
        )
    for old, value in zip(op.state, new):
        if jnp.shape(value) != jnp.shape(old):
            raise ValueError(
                f"{name} returned a new state array of shape {jnp.shape(value)} for one of shape {jnp.shape(old)}."
            )
    return q, tuple(new)


def _described(x) -> str:
    """What a recipe returned, for an error: an array by its shape and dtype (a recipe runs
    traced, inside the GEMM pass's `jit`, so its arrays are tracers), else its type."""
    if isinstance(x, jax.Array):
        return f"an array of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def _by_recipe(call: Call, roles) -> list:
    """`(recipe, indices into roles)` for the roles a recipe quantizes, in order."""
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


def grad_once(call: Call) -> bool:
    """Whether the output gradient is quantized once for both backward GEMMs: a
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
def _gemms(call: Call) -> tuple[tuple[str, Role, Role, np.dtype], ...]:
    return (
        ("fwd", "lhs", "rhs", call.out_dtype),
        ("dlhs", "grad", "rhs", call.lhs_dtype),
        ("drhs", "lhs", "grad", call.rhs_dtype),
    )


def _role_dtype(call: Call, role: Role) -> np.dtype:
    return quantizing_recipe(call.settings, role).dtype_for(role)


def planned_scales(call: Call, plans: dict) -> dict:
    """Each role's planned scale (`AbstractStatefulRecipe.planned_scale`), None where
    the role has no plan or its recipe plans no scale."""
    return {r: None if plans[r] is None else stateful_recipe(call.settings).planned_scale(plans[r]) for r in ROLES}


def is_fp8_dtype(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def is_16_bit_float(dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def plan_call(call: Call, states: dict) -> tuple[dict, dict]:
    """Each stateful operand's plan (see `AbstractStatefulRecipe.plan`): a recipe plans
    the operands it quantizes with state in this call, forward ones and the gradient,
    together, in the forward pass.

    Also the output scale of each GEMM whose two operands have planned scales (known
    from the state alone, delayed scaling after its first call) and whose scales go into
    its epilogue: their product, computed here beside the scales. The plans and the
    products go behind one optimization barrier. Without it XLA:GPU merges the scalar
    arithmetic of a cast's scale with that of the next state (which reads the tensor's
    amax), and the FP8 cast waits on the reduction of its own input; and a product
    computed next to its GEMM is a kernel of its own on the cuBLASLt path."""
    plans = dict.fromkeys(ROLES)
    roles = [r for r in ROLES if states[r] is not None]
    if "fwd" in call.settings.high_precision_gemms:
        roles = [r for r in roles if r == "grad"]
    if not grad_once(call):
        roles = [r for r in roles if r != "grad"]
    for _, idx in _by_recipe(call, roles):  # (a state's recipe is the settings' own)
        planned = stateful_recipe(call.settings).plan(
            [states[roles[i]] for i in idx], [_role_dtype(call, roles[i]) for i in idx]
        )
        plans.update((roles[i], p) for i, p in zip(idx, planned))
    scales = planned_scales(call, plans)
    if all(s is None for s in scales.values()):
        return plans, {}
    products = {}
    for name, a, b, out_dtype in _gemms(call):
        sa, sb = scales.get(a), scales.get(b)
        if sa is not None and sb is not None and _epilogue_scaled(call, name, a, b, out_dtype):
            products[name] = lax.mul(float32_of(sa), float32_of(sb))
    return lax.optimization_barrier((plans, products))


def _epilogue_scaled(call: Call, name: str, a: Role, b: Role, out_dtype) -> bool:
    """Whether GEMM `name` runs on two FP8 operands with tensor-wise scales and puts
    their product into its epilogue (`run_gemm`'s first branch), as far as the settings
    tell; `run_gemm` checks the operands themselves."""
    st = call.settings
    if st.mode != "direct" or name in st.high_precision_gemms:
        return False
    return is_fp8_dtype(_role_dtype(call, a)) and is_fp8_dtype(_role_dtype(call, b)) and is_16_bit_float(out_dtype)


def reusable(call: Call, role: Role, q) -> bool:
    """Whether a forward-quantized operand serves the backward GEMM too."""
    return q is not None and quantizing_recipe(call.settings, role).contraction_independent(role)


def plainly_scaled(q) -> bool:
    """Whether `q`'s scale is a float32 multiplier of its values (not E8M0's power of two,
    no implicit exponent): what a kernel's scaling multiplies by."""
    return np.dtype(q.scale.dtype) == np.dtype(np.float32) and q.int_exponent == 0


def float32_of(x):
    return lax.convert_element_type(jnp.asarray(x), np.float32)


def states_by_role(raw) -> dict:
    if not raw:
        return dict.fromkeys(ROLES)
    # The same recipe's state for each role: as many arrays each, in its `fields` order.
    f32, n = [as_f32(v) for v in raw], len(raw) // len(ROLES)
    return {role: tuple(f32[n * i : n * (i + 1)]) for i, role in enumerate(ROLES)}


def gradient_keys(recipe, g) -> tuple:
    """The keys the output gradient `g` is rounded with in the two backward GEMMs: from
    the recipe's `rounding_seed("grad")` and `g`'s contents; `(None, None)` to round to
    nearest."""
    seed = None if recipe is None else recipe.rounding_seed("grad")
    if seed is None:
        return None, None
    return tuple(jax.random.split(content_key(seed, g)))
