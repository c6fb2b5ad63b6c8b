# The static part of one GEMM call (`Call`) and what its settings say of each operand:
# its recipe and format, whether the gradient is quantized once for both backward GEMMs,
# whether a forward copy serves a backward GEMM, the gradient's rounding keys, the state
# arrays by role; and the dtype tests the kernels and the plans share.

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._maxgrad import as_f32
from .._rounding import content_key
from .settings import GemmSettings, Role, quantizing_recipe

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
    # Where the three operands' states are one state with a role axis (`Fp8DotGeneral`'s),
    # that axis of each state array, counted from its end (negative); empty where they
    # arrive as three states, one after the other (`Fp8RaggedDot`'s).
    state_role_axes: tuple[int, ...] = ()


def states_by_role(raw, role_axes: tuple[int, ...] = ()) -> dict:
    """Each role's state as a tuple of float32 arrays in its `fields` order, from the raw
    state arrays a custom VJP receives: the rows of one state's arrays along their role
    axes (`Call.state_role_axes`), or three states one after the other."""
    if not raw:
        return dict.fromkeys(ROLES)
    f32 = [as_f32(v) for v in raw]
    if role_axes:
        return {
            role: tuple(
                lax.index_in_dim(v, i, v.ndim + ax, keepdims=False) for v, ax in zip(f32, role_axes, strict=True)
            )
            for i, role in enumerate(ROLES)
        }
    n = len(raw) // len(ROLES)
    return {role: tuple(f32[n * i : n * (i + 1)]) for i, role in enumerate(ROLES)}


def stacked_by_role(new_states, role_axes: tuple[int, ...]) -> tuple:
    """The new states of the three roles (`(lhs, rhs, grad)`, each a tuple of float32
    arrays in `fields` order) as the raw arrays of one state: each field's three rows
    stacked along its role axis (`states_by_role`'s inverse); three states one after the
    other without `role_axes`."""
    if not role_axes:
        return tuple(v for state in new_states for v in state)
    return tuple(
        lax.concatenate([lax.expand_dims(v, (v.ndim + 1 + ax,)) for v in rows], rows[0].ndim + 1 + ax)
        for rows, ax in zip(zip(*new_states), role_axes, strict=True)
    )


def role_dtype(call: Call, role: Role) -> np.dtype:
    return quantizing_recipe(call.settings, role).dtype_for(role)


def by_recipe(call: Call, roles) -> list:
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


def reusable(call: Call, role: Role, q) -> bool:
    """Whether a forward-quantized operand serves the backward GEMM too."""
    return q is not None and quantizing_recipe(call.settings, role).contraction_independent(role)


def gradient_keys(recipe, g) -> tuple:
    """The keys the output gradient `g` is rounded with in the two backward GEMMs: from
    the recipe's `rounding_seed("grad")` and `g`'s contents; `(None, None)` to round to
    nearest."""
    seed = None if recipe is None else recipe.rounding_seed("grad")
    if seed is None:
        return None, None
    return tuple(jax.random.split(content_key(seed, g)))


def is_fp8_dtype(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def is_16_bit_float(dtype) -> bool:
    return np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def float32_of(x):
    return lax.convert_element_type(jnp.asarray(x), np.float32)


def plainly_scaled(q) -> bool:
    """Whether `q`'s scale is a float32 multiplier of its values (not E8M0's power of two,
    no implicit exponent): what a kernel's scaling multiplies by."""
    return np.dtype(q.scale.dtype) == np.dtype(np.float32) and q.int_exponent == 0
