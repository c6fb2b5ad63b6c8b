# A float32 "max-accumulating" dtype for FP8 scaling state.
#
# Why this exists (the full argument is in docs/state.md):
#
# fp8ax returns the *new* scaling state as the "gradient" of the state leaves. JAX adds
# the cotangents of a value that is used more than once (a layer called twice, a layer
# closed over by `lax.scan`, a layer under `vmap` with a batched input). Adding two
# "new states" is meaningless: it doubles amaxes and scales. What we want is the state
# that one merged observation would give, and for amax histories and scales that is the
# elementwise maximum (see `_dot_general.py`: every per-use new state is monotone in the
# use's amax, and all uses see the same old state).
#
# JAX picks the accumulation by dtype. For ordinary dtypes it is `+`; for an *extended*
# dtype it is the dtype's `add` rule. So inside a differentiated function the state is
# held in `MAXF32`, a float32 whose cotangents accumulate with `max`. The conversion
# f32 -> MAXF32 must happen *before* the value fans out to its uses: converting inside
# each call would sum again across calls. `_state.ScalingState` therefore converts when
# it is unflattened from traced leaves, which is where `jax.grad`/`eqx.filter_grad`
# rebuild the model, i.e. once, above every use. Its pytree leaves are always float32, so
# `eqx.filter_grad`, optimisers, serialisation and users only ever see float32.
#
# Two JAX gaps are bridged here, both covered by tests:
# - the builtin transpose of an extended-dtype conversion reads `.dtype` from an
#   `UndefinedPrimal` in jax 0.10's backward pass, so both conversions are `custom_vjp`s;
# - a `vmap`ped use whose input is batched but whose state is not would have its state
#   cotangents reduce-*summed* over the batch (and extended dtypes have no `sum`), so
#   `merged_amax` reduces observed amaxes with `max` over such axes first (see there).
#
# This module touches `jax._src`; the supported JAX range is pinned in pyproject.toml.

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_util as _ad_util
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import earray as _earray
from jax._src.interpreters import pxla as _pxla
from jax.custom_batching import custom_vmap


class _MaxF32Rules:
    # Physical representation: a plain float32 per element.
    @staticmethod
    def physical_element_aval(dtype):
        return _core.ShapedArray((), np.dtype(np.float32))

    @staticmethod
    def convert_from(dtype, other_dtype) -> bool:
        return other_dtype == np.dtype(np.float32)

    @staticmethod
    def convert_to(other_dtype, dtype) -> bool:
        return other_dtype == np.dtype(np.float32)

    # Cotangent accumulation: max instead of +.
    @staticmethod
    def add(dtype, x, y):
        return _raw_to_max(lax.max(_raw_to_f32(x), _raw_to_f32(y)))

    # Every state value is >= 0 (scales > 0, amaxes >= 0), so 0 is the identity of max,
    # and an unused layer's cotangent reads as 0 whether or not JAX instantiates it here.
    @staticmethod
    def zero(dtype):
        return _raw_to_max(np.array(0.0, np.float32))

    @staticmethod
    def tangent_dtype(dtype):
        return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
        fill = lax.convert_element_type(fill_value, np.float32)
        return _raw_to_max(lax.full(shape, fill, np.float32))

    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
        phys_aval = _core.physical_aval(aval)
        handler = _pxla.global_result_handlers[_core.ShapedArray](phys_aval, out_sharding, committed)
        return lambda bufs: _earray.EArray(aval, handler(bufs))

    # Same shape physically, so shardings carry over unchanged.
    @staticmethod
    def physical_sharding(aval, sharding):
        return sharding

    @staticmethod
    def logical_sharding(aval, phys_sharding):
        return phys_sharding


class maxf32(_dtypes.extended):
    """Scalar type of `MAXF32` arrays."""


@dataclasses.dataclass(frozen=True)
class _MaxF32DType(_dtypes.ExtendedDType):
    _rules: type = _MaxF32Rules
    type: type = maxf32

    @property
    def name(self) -> str:
        return "maxf32"

    def __repr__(self) -> str:
        return "maxf32"


MAXF32 = _MaxF32DType()

# Eager (un-jitted) accumulation of two concrete MAXF32 arrays: route through a jitted add,
# whose lowering applies the `add` rule above.
_ad_util.raw_jaxval_adders[_earray.EArray] = jax.jit(_ad_util.add_jaxvals)


def _raw_to_max(x):
    return lax.convert_element_type(x, MAXF32)


def _raw_to_f32(x):
    return lax.convert_element_type(x, np.float32)


@jax.custom_vjp
def to_max(x):
    """float32 -> MAXF32; the cotangent goes back to float32."""
    return _raw_to_max(x)


to_max.defvjp(lambda x: (_raw_to_max(x), None), lambda _, g: (_raw_to_f32(g),))


@jax.custom_vjp
def to_f32(x):
    """MAXF32 -> float32; the cotangent goes back to MAXF32."""
    return _raw_to_f32(x)


to_f32.defvjp(lambda x: (_raw_to_f32(x), None), lambda _, g: (_raw_to_max(g),))


def is_max(x) -> bool:
    return getattr(x, "dtype", None) == MAXF32


def as_f32(x):
    """float32 view of a state value held in either representation (no autodiff link)."""
    return _raw_to_f32(x) if is_max(x) else x


def raw_to_max(value):
    """float32 -> MAXF32 with no autodiff link (for cotangents built in a custom VJP)."""
    return _raw_to_max(value)


@custom_vmap
def merged_amax(amax, state):
    """The amax of one observation, merged with `max` over data axes.

    `state` only tells which `vmap` axes are *data* axes: an axis that maps the input
    but not the state (per-example `eqx.nn.Linear` under `jax.vmap`) is part of one
    observation, so its amaxes are reduced with max. An axis that maps the state too
    (stacked layers, `eqx.filter_vmap` ensembles) holds independent copies and stays.
    """
    del state
    return amax


@merged_amax.def_vmap
def _merged_amax_vmap(axis_size, in_batched, amax, state):
    amax_batched, state_batched = in_batched
    if amax_batched and not state_batched:
        # Recurse so an enclosing vmap applies the same rule to its own axis.
        return merged_amax(jnp.max(amax, axis=0), state), False
    if not amax_batched and state_batched:
        return jnp.broadcast_to(amax, (axis_size, *jnp.shape(amax))), True
    return amax, amax_batched
