# Quantizing a GEMM's operands with their recipes: the operand a recipe receives (its
# format, state, plan and how its observation is merged under `vmap` and `shard_map`),
# several operands of one call in one `quantize_operands`, and the checks on what a
# recipe returns. The dense and the grouped GEMMs (and serving) quantize through these.

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import _haliax
from .._boundaries import vma
from .._maxgrad import merged_amax
from .._quantized import QuantizedArray
from .._recipes import Operand
from .call import Call, by_recipe, role_dtype
from .settings import Role


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
    return Operand(x, tuple(axes), role_dtype(call, role), state, key, merge, plan, role)


def quantize(call: Call, role: Role, x, axes, state=None, key=None, plan=None):
    """Operand `role` quantized along `axes` (contracted), and its new state. `(None,
    None)` if the settings keep that operand in high precision."""
    return quantize_together(call, [(role, x, axes, state, key, plan)])[0]


def quantize_together(call: Call, items) -> list:
    """`quantize` of several `(role, x, axes, state, key, plan)` of one call, each
    recipe quantizing its operands in one `quantize_operands` (so that delayed scaling
    decides once whether they calibrate)."""
    out: list[Any] = [(None, None)] * len(items)
    for recipe, idx in by_recipe(call, [item[0] for item in items]):
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
