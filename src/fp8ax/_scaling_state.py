# Delayed scaling's state: one array per operand, `[unit, scale, *amax_history]`, and the
# reads of its parts (the stored values, and what they stand for through the unit).

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from ._formats import select
from ._maxgrad import as_f32
from ._state import AbstractState

# Where a `ScalingState`'s array holds what (the last axis): the unit, the scale, then the
# amax history.
UNIT, SCALE, HISTORY = 0, 1, 2


class ScalingState(AbstractState):
    """Delayed-scaling state of one operand: a scale and an amax history, in one array.

    The state is one float32 pytree leaf, `data`, of shape `(history_length + 2,)` (or
    `(*batch, history_length + 2)` for stacked layers): `[unit, scale, *amax_history]`.
    An [`fp8ax.Fp8DotGeneral`][] holds the states of its three operands as one, with a
    role axis of size 3 among its batch dimensions, `(3, history_length + 2)`: one state
    leaf per converted layer, and one kernel writing it per step (docs/state.md, "What
    the state costs").

    - `scale` (a property): the *dequantization* scale, shape `()` (or `(*batch,)`): a
      tensor `x` is quantized as `x / scale` and recovered as `q * scale` (the
      Flax/Haliax convention; TransformerEngine's `scale_inv`).
    - `amax_history` (a property): shape `(history_length,)` (or
      `(*batch, history_length)`), the newest amax at index 0. An entry of 0 means
      "nothing recorded".
    - `unit` (a property): what the stored scale and history are multiples of. fp8ax
      writes 1 (and 0 for "nothing written"), and reads the state as `scale / unit` and
      `amax_history / unit`. A training loop that averages gradients over `k`
      microbatches by dividing every gradient leaf by `k` (Levanter's) divides the new
      state and its unit alike, so the state it writes back still reads the same. A
      `unit` of 0 (a state that is all zero, such as the zero "gradient" of a layer the
      step did not call, written over the state by an update that does not skip it)
      reads as a fresh state.

    The state [`fp8ax.DelayedScaling`][] owns (an [`fp8ax.AbstractState`][]). `data` is an
    ordinary float32 pytree leaf: `eqx.filter_grad` differentiates it,
    `eqx.tree_serialise_leaves` saves it, and its "gradient" is the new state (see
    [`fp8ax.apply_updates`][]). Inside a trace it accumulates cotangents by max (see
    [`fp8ax.AbstractState`][]): the unit, the scale and each history entry alike.
    """

    fields = ("data",)
    entry_ndims = (1,)
    __slots__ = ()

    def __init__(self, scale: Any, amax_history: Any, unit: Any = 1.0):
        """**Arguments:**

        - `scale`: the dequantization scale, float32 of shape `batch_shape`.
        - `amax_history`: float32 of shape `(*batch_shape, history_length)`.
        - `unit`: what `scale` and `amax_history` are multiples of (1, the unit fp8ax
          writes, by default; see above).
        """
        scale = jnp.asarray(scale, jnp.float32)
        history = jnp.asarray(amax_history, jnp.float32)
        if history.ndim < 1 or history.shape[:-1] != scale.shape:
            raise ValueError(
                "`amax_history` must have shape `(*scale.shape, history_length)`, got scale "
                f"{tuple(scale.shape)} and amax_history {tuple(history.shape)}."
            )
        unit = jnp.broadcast_to(jnp.asarray(unit, jnp.float32), scale.shape)
        super().__init__(jnp.concatenate([unit[..., None], scale[..., None], history], axis=-1))

    @classmethod
    def init(cls, history_length: int, batch_shape: tuple[int, ...] = ()) -> "ScalingState":
        """Fresh state: unit 1, scale 1, empty (all-zero) history."""
        if isinstance(history_length, bool) or not isinstance(history_length, int | np.integer) or history_length < 1:
            raise ValueError(f"`history_length` must be an int >= 1, got {history_length!r}.")
        data = np.zeros((*batch_shape, int(history_length) + 2), np.float32)
        data[..., UNIT] = data[..., SCALE] = 1
        return cls._make((jnp.asarray(data),), None, None)

    @property
    def scale(self) -> Any:
        """The dequantization scale this state stands for (the stored scale / `unit`)."""
        return self._read()[0]

    @property
    def amax_history(self) -> Any:
        """The amax history this state stands for (the stored history / `unit`)."""
        return self._read()[1]

    @property
    def unit(self) -> Any:
        """The stored unit (1 as fp8ax writes it)."""
        return self._leaf(0)[..., UNIT]

    def _read(self) -> tuple:
        data = self._leaf(0)
        if not hasattr(data, "shape"):  # a placeholder (`eqx.tree_at`'s, a filter's None)
            raise AttributeError(
                "A `ScalingState`'s `scale` and `amax_history` are read from its one array, `data` "
                "([unit, scale, *amax_history]); they are not pytree leaves of their own. To replace them, replace "
                "the state: `dg.with_states(lhs=fp8ax.ScalingState(scale, amax_history))`."
            )
        return read_state((data,))

    def written(self):
        # A call that observed nothing reports unit 0, and so does the zero cotangent of
        # an unused layer; a call's new state has unit 1 (or 1/k after a loop divided
        # every gradient by k).
        # (`lax` rather than indexing: `apply_updates` traces this for every state.)
        data = as_f32(self._values[0])
        return lax.gt(lax.index_in_dim(data, UNIT, axis=data.ndim - 1, keepdims=False), np.float32(0))


def pack_state(unit: Any, scale: Any, *history: Any) -> Any:
    """A `ScalingState`'s array from its parts (traced or concrete float32 arrays): the
    unit, the scale, and the history's pieces in order, each with the history's axis
    last (one `concatenate` for the whole array)."""
    last = np.ndim(unit)
    return lax.concatenate([lax.expand_dims(unit, (last,)), lax.expand_dims(scale, (last,)), *history], last)


def stored_parts(state: tuple) -> tuple:
    """`(unit, scale, history)` as stored, each still a multiple of the unit, from a
    delayed-scaling state: `(data,)` (a `ScalingState`'s array), `(scale, amax_history,
    unit)` or `(scale, amax_history)` (unit 1). NumPy float32 on NumPy arrays; sliced with
    `lax` otherwise (traced values: free inside the kernels that read them; JAX arrays:
    on their devices, keeping their sharding)."""
    if _numpy(*state):
        state = tuple(np.asarray(v, np.float32) for v in state)
        if len(state) == 1:
            return state[0][..., UNIT], state[0][..., SCALE], state[0][..., HISTORY:]
        scale, history = state[:2]
        return (state[2] if len(state) == 3 else np.ones_like(scale)), scale, history
    state = tuple(as_f32(jnp.asarray(v)) for v in state)
    if len(state) == 1:
        data = state[0]
        last = data.ndim - 1
        return (
            lax.index_in_dim(data, UNIT, last, keepdims=False),
            lax.index_in_dim(data, SCALE, last, keepdims=False),
            stored_history(state),
        )
    scale, history = state[:2]
    return (state[2] if len(state) == 3 else lax.full_like(scale, 1)), scale, history


def stored_columns(states: list) -> tuple:
    """The stored units and the stored scales of several delayed-scaling states (traced
    or JAX arrays; the forms of `stored_parts`), each stacked along a new last axis, and
    the states' stored histories. A `ScalingState`'s unit and scale are sliced straight
    into the stack, keeping the sliced axis, rather than taken out as scalars and widened
    again (each operation here is repeated in every layer of the program XLA compiles)."""
    units, scales, histories = [], [], []
    for state in states:
        if len(state) == 1:
            data = as_f32(jnp.asarray(state[0]))
            last = data.ndim - 1
            units.append(lax.slice_in_dim(data, UNIT, UNIT + 1, axis=last))
            scales.append(lax.slice_in_dim(data, SCALE, SCALE + 1, axis=last))
            histories.append(stored_history((data,)))
            continue
        unit, scale, history = (jnp.asarray(v, jnp.float32) for v in stored_parts(state))
        units.append(lax.expand_dims(unit, (unit.ndim,)))
        scales.append(lax.expand_dims(scale, (scale.ndim,)))
        histories.append(history)
    last = units[0].ndim - 1
    return lax.concatenate(units, last), lax.concatenate(scales, last), histories


def stacked_parts(datas: list) -> tuple:
    """The stored units, scales and histories of several `ScalingState` arrays (float32,
    traced or JAX arrays of one shape), stacked along a new axis before the last: the
    units and the scales `(..., n)`, the histories `(..., n, history_length)`: one
    `concatenate` of the arrays and three slices, where reading each state apart
    (`stored_columns`) takes three slices per state and a `concatenate` per part (see
    `DelayedScaling.plan`, which reads them so where it lowers for GPUs)."""
    last = datas[0].ndim - 1
    data = lax.concatenate([lax.expand_dims(d, (last,)) for d in datas], last)
    top = last + 1

    def column(i):
        return lax.squeeze(lax.slice_in_dim(data, i, i + 1, axis=top), (top,))

    return column(UNIT), column(SCALE), lax.slice_in_dim(data, HISTORY, data.shape[top], axis=top)


def stored_history(state: tuple) -> Any:
    """The stored history of a delayed-scaling state alone (see `stored_parts`), sliced
    with `lax`: what a call's new state is written from."""
    if len(state) != 1:
        return as_f32(jnp.asarray(state[1]))
    data = as_f32(jnp.asarray(state[0]))
    return lax.slice_in_dim(data, HISTORY, data.shape[-1], axis=data.ndim - 1)


def _numpy(*values) -> bool:
    """Whether every value is host data (NumPy or a Python number), read with NumPy."""
    return all(isinstance(v, np.ndarray | np.generic | float | int) for v in values)


def unit_inverse(unit: Any) -> Any:
    """`1 / unit`, and 0 for a unit of 0 (nothing written): the multiplier that reads a
    stored value (see `through_unit`). One division per state, on a scalar (on the
    stacked operands of a call, one small kernel for all of them)."""
    if _numpy(unit):
        unit = np.asarray(unit, np.float32)
        written = unit != 0
        return np.where(written, np.float32(1) / np.where(written, unit, np.float32(1)), np.float32(0))
    written = lax.ne(unit, np.float32(0))
    return select(
        written, lax.div(np.float32(1), select(written, unit, lax.full_like(unit, 1))), lax.full_like(unit, 0)
    )


def through_unit(inv: Any, x: Any, fresh: float) -> Any:
    """What a stored value `x` stands for (see `ScalingState`): `x` times `inv`
    (`unit_inverse` of its unit, broadcast against it), `fresh` where the unit is 0 (an
    all-zero state reads as a fresh one). A unit of 1 reads exactly; a negative or NaN
    one (the state went through an optimizer) gives a value the state's checks find
    corrupt."""
    if _numpy(inv, x):
        inv, x = np.asarray(inv, np.float32), np.asarray(x, np.float32)
        with np.errstate(invalid="ignore"):
            return np.where(inv != 0, x * inv, np.float32(fresh))
    inv = jnp.broadcast_to(inv, jnp.shape(x)) if jnp.shape(inv) != jnp.shape(x) else inv
    return select(lax.ne(inv, np.float32(0)), lax.mul(x, inv), lax.full_like(x, fresh))


def read_state(state: tuple) -> tuple:
    """The `(scale, amax_history)` a delayed-scaling state stands for (see
    `stored_parts` for the forms it takes): the stored values divided by the unit."""
    unit, scale, history = stored_parts(state)
    if _numpy(unit) and np.all(unit == 1):
        return scale, history
    inv = unit_inverse(unit)
    wide = inv[..., None] if isinstance(inv, np.ndarray) else lax.expand_dims(inv, (inv.ndim,))
    return through_unit(inv, scale, 1), through_unit(wide, history, 0)
