# The recipe interface, and delayed scaling (the one recipe that keeps state).
#
# Every recipe quantises one operand of a GEMM, for a role (forward operand or output
# gradient: the recipe's `fwd_dtype` or `grad_dtype`) and the axes that GEMM contracts,
# into a `QuantizedArray` whose scale has a declared layout. A stateful recipe reads its
# state and returns the new one; the GEMM pipeline (`_pipeline.py`) is the same for all.
# The pipeline hands a recipe the operands of one call together (`plan`, then
# `quantize_operands`), so that a recipe can compute once per call what it would
# otherwise compute per operand: delayed scaling stacks the operands' states and reduces
# their histories together.

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from . import _formats
from ._boundaries import vma
from ._quantized import QuantizedArray, ScaleLayout
from ._state import AbstractState, ScalingState

# What `quantize_operand` returns besides the quantised array: the new state of the
# operand (a `(scale, amax_history)` pair), or None for a stateless recipe.
NewState = tuple[Array, Array] | None


def _fwd_dtype(value):
    return _formats.as_fp8_dtype(value, "fwd_dtype")


def _grad_dtype(value):
    return _formats.as_fp8_dtype(value, "grad_dtype")


def _no_merge(value):
    return value


class Operand(NamedTuple):
    """One operand of a call, as [`fp8ax.AbstractScalingRecipe.quantize_operands`][]
    takes it: the arguments of `quantize_operand`, plus the operand's `plan` and its
    `role` in the GEMM (`"lhs"`, `"rhs"` or `"grad"`; None when not known), by which a
    recipe picks per-role behaviour (its format, a weight's 2D blocks)."""

    x: Array
    contracting_axes: tuple[int, ...]
    dtype: np.dtype
    state: tuple[Array, ...] | None = None
    key: Any = None
    merge: Callable[[Array], Array] = _no_merge
    plan: Any = None
    role: str | None = None


def _as_operands(operands) -> list[Operand]:
    operands = list(operands)
    for op in operands:
        if not isinstance(op, Operand):
            raise TypeError(
                f"`operands` must be a sequence of `fp8ax.Operand`, got an element of type {type(op).__name__}."
            )
    return operands


class AbstractScalingRecipe(eqx.Module):
    """How a low-precision dot general quantises its operands: the one interface of every
    fp8ax recipe.

    A recipe is configuration only (all of its fields are static). It names the formats
    of the forward operands and of the output gradient (`fwd_dtype`, `grad_dtype`), the
    layout of its scales (`scale_layout`), and implements one method,
    `quantize_operand`: quantise one GEMM operand along the axes that GEMM contracts,
    reading the operand's state and returning the new one if the recipe keeps state.

    - *stateful* recipes ([`fp8ax.DelayedScaling`][]) also implement `init_state`: the
      scale comes from a state that training writes back through the gradient (see
      [`fp8ax.apply_updates`][]);
    - *stateless* recipes ([`fp8ax.AbstractStatelessRecipe`][]: current, MX, int8)
      implement `quantize`: the scale comes from the tensor itself, and modules carry no
      state.

    Concrete recipes are final: to change one, wrap it rather than subclass it.
    """

    fwd_dtype: eqx.AbstractVar[np.dtype]
    grad_dtype: eqx.AbstractVar[np.dtype]

    @property
    def stateful(self) -> bool:
        """Whether the recipe keeps state between steps."""
        return False

    @property
    def scale_layout(self) -> ScaleLayout:
        """The layout of the scales this recipe makes: `"tensor"`, `"row"` or `"block"`
        (see [`fp8ax.QuantizedArray`][]). A tensor-wise scale does not depend on the
        contracting axes, so the GEMM pipeline reuses a forward operand, quantised once,
        in the backward GEMMs."""
        raise NotImplementedError

    def dtype_for(self, role: str) -> np.dtype:
        """The format operand `role` (`"lhs"`, `"rhs"` or `"grad"`) is quantised to:
        `grad_dtype` for the output gradient, `fwd_dtype` for the others."""
        return self.grad_dtype if role == "grad" else self.fwd_dtype

    def contraction_independent(self, role: str) -> bool:
        """Whether operand `role` is quantised the same whatever axes its GEMM contracts,
        so that the forward pass's quantised copy serves the backward GEMMs too (and the
        output gradient is quantised once for both). True for tensor-wise scales (the
        default derives it from `scale_layout`); a recipe with 2D weight blocks says so
        for `"rhs"`."""
        del role
        return self.scale_layout == "tensor"

    def stochastic(self, role: str) -> bool:
        """Whether operand `role` is rounded stochastically (it then needs a `key`).
        The default rounds everything to nearest."""
        del role
        return False

    def weight_gradient_rotation(self) -> Array | None:
        """An orthogonal `(n, n)` matrix that both operands of the weight-gradient GEMM
        (the activation and the output gradient) are multiplied by along their
        contraction, `n` elements at a time, before they are quantised (NVFP4's random
        Hadamard transform); the GEMM is unchanged in exact arithmetic. None (the
        default): no rotation."""
        return None

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> AbstractState | None:
        """Fresh state for one operand (`batch_shape` for stacked layers): an instance of
        the recipe's own [`fp8ax.AbstractState`][] subclass; None for a stateless recipe.

        A stateful recipe owns its state type: the GEMM pipeline passes the state's arrays
        (in its `fields` order) to `plan` and `quantize_operand(s)` as a tuple, and the
        rest of fp8ax asks the recipe about them with the methods below, which receive
        the same tuple of concrete (NumPy) or traced float32 arrays, with the stacked-layer
        dimensions in front."""
        del batch_shape
        return None

    def state_observed(self, state: tuple[Array, ...]) -> np.ndarray:
        """Per stacked layer (a bool array of the state's batch shape): whether the state
        holds an observation, so that its scale comes from data. `fp8ax.to_serving`
        refuses a state that has observed nothing. Concrete arrays only. Stateful recipes
        must define it."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no `state_observed`: a stateful recipe must say whether its state "
            "has seen data (a stateless one has no state to ask about)."
        )

    def state_valid(self, state: tuple[Array, ...]) -> np.ndarray:
        """Per stacked layer: whether the state is one fp8ax's updates can have written (a
        state that went through an optimiser is not). Concrete arrays only. The default
        accepts finite, non-negative arrays."""
        ok = None
        for value, extra in zip(state, self._entry_ndims()):
            value = np.asarray(value)
            here = np.all(np.isfinite(value) & (value >= 0), axis=tuple(range(value.ndim - extra, value.ndim)))
            ok = here if ok is None else ok & here
        return ok

    def _entry_ndims(self) -> tuple[int, ...]:
        return type(self.init_state()).entry_ndims

    def serving_scale(self, state: tuple[Array, ...], dtype: np.dtype) -> Array:
        """The dequantisation scale, frozen from one layer's state (no stacked dimensions),
        that serving quantises the input operand with, to `dtype`. `fp8ax.to_serving`
        calls it under `jax.jit` (and `vmap` for stacked layers). A stateful recipe that
        can be served defines it; the default refuses."""
        del state, dtype
        raise NotImplementedError(
            f"{type(self).__name__} does not say how to freeze its state for serving (`serving_scale`)."
        )

    def state_stats(self, state: tuple[Array, ...]) -> dict[str, np.ndarray]:
        """Named numbers from one operand's state, for [`fp8ax.scaling_stats`][]: each a
        NumPy array of the state's batch shape. Concrete arrays only. The default reports
        nothing."""
        del state
        return {}

    def state_history(self, state: tuple[Array, ...]) -> np.ndarray | None:
        """The amaxes the state remembers, newest first (shape `(*batch, n)`), for
        [`fp8ax.plot_amax_history`][]; None (the default) if it remembers none."""
        del state
        return None

    def quantize_operand(
        self,
        x: Array,
        contracting_axes: tuple[int, ...],
        dtype: np.dtype,
        *,
        state: tuple[Array, ...] | None = None,
        key: Any = None,
        merge: Callable[[Array], Array] = _no_merge,
    ) -> tuple[QuantizedArray, NewState]:
        """Quantises `x`, one operand of a GEMM that contracts `contracting_axes`, to
        `dtype` (the recipe's `fwd_dtype` or `grad_dtype`).

        **Arguments:**

        - `x`: the operand.
        - `contracting_axes`: the axes of `x` the GEMM contracts.
        - `dtype`: the low-precision format.
        - `state`: for a stateful recipe, the arrays of the operand's state (float32, in
          the `fields` order of the recipe's state type: `(scale, amax_history)` for
          delayed scaling); None otherwise. (Keyword only argument.)
        - `key`: a PRNG key for stochastic rounding, or None. (Keyword only argument.)
        - `merge`: reduces a per-call observation (an amax, or a pytree of values
          observed together) to one value for the whole observation: a max over `vmap`
          data axes and `shard_map` shards the state does not vary over. (Keyword only
          argument.)

        **Returns:**

        `(quantized, new_state)`: a [`fp8ax.QuantizedArray`][], and the arrays of the
        operand's state after this call, in the same order (None for a stateless recipe). The new
        state must be monotone non-decreasing in what the call observed: several uses of
        a layer are merged with an elementwise max.
        """
        raise NotImplementedError

    def plan(self, states: Sequence[tuple[Array, ...] | None], dtypes: Sequence[np.dtype] | None = None) -> list[Any]:
        """What the operands of one call share, decided once from their states.

        The GEMM pipeline calls this once per call, in the forward pass, with the state
        of every operand of the call that this recipe quantises with state (forward
        operands and output gradient) and the format each is quantised to (`dtypes`, in
        the same order; None when unknown), and hands each operand its plan in
        `quantize_operands`, in the forward pass or the backward one. A plan is a pytree
        of arrays (it is kept for the backward pass). The default plans nothing: one None
        per state.
        """
        del dtypes
        return [None] * len(states)

    def planned_scale(self, plan: Any) -> Array | None:
        """The tensor-wise scale an operand with this `plan` will be quantised with, if
        its state alone decides it (None otherwise, the default).

        The pipeline multiplies the planned scales of a GEMM's two operands into the
        GEMM's output scale beside them, and puts the plans and those products behind
        one optimisation barrier: an FP8 cast then depends on nothing computed from its
        own tensor, and each GEMM's scale is ready with its operands' (on XLA:GPU, in the
        same kernel)."""
        del plan
        return None

    def quantize_operands(self, operands: Sequence[Operand]) -> list[tuple[QuantizedArray, NewState]]:
        """Quantises several operands of one call, each as `quantize_operand` would, with
        their plans (see `plan`). The default quantises them one by one."""
        return [
            self.quantize_operand(op.x, op.contracting_axes, op.dtype, state=op.state, key=op.key, merge=op.merge)
            for op in _as_operands(operands)
        ]


CORRUPT_STATE = (
    "fp8ax: an FP8 scaling state (scale, amax history) holds negative or non-finite values: "
    "it went through an optimiser as if it were a gradient and was added to by "
    "`eqx.apply_updates`. The gradient of an FP8 layer's state is its new value, which "
    "must replace the old one: split it off with "
    "`overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)`, give the optimiser "
    "`grads`, and apply both with `model = fp8ax.apply_updates(model, updates, overwrite)`."
)


def _history_bounds(history):
    """`(max, min)` of the history over its last axis, in one reduction. The max serves
    the delayed scale and the "history empty" test (0); together they tell a corrupt
    history, holding entries no fp8ax update writes: the max is NaN or inf, or the min
    is negative (XLA's `max` and `min` propagate NaN). XLA:CPU compiles this into one
    kernel, where a plain max over the 1024 entries takes two (it splits the reduction)
    and a max over a select of the bad entries took three."""
    return _formats.max_min(history, history, (history.ndim - 1,))


def _positive_finite(x):
    return lax.bitwise_and(lax.is_finite(x), lax.gt(x, np.float32(0)))


def _bad_scale(scale):
    """A scale that is not positive and finite, which no fp8ax update writes either."""
    return lax.bitwise_not(_positive_finite(scale))


def _corrupt(longest, lowest, scale):
    """Whether a state holds values no fp8ax update writes (see `_history_bounds`)."""
    bad_history = lax.bitwise_or(lax.bitwise_not(lax.is_finite(longest)), lax.lt(lowest, np.float32(0)))
    return lax.bitwise_or(bad_history, _bad_scale(scale))


def _calibrates(longest, lowest, scale, corrupt=None):
    """Whether a call calibrates: its history is empty (its max is 0) or its state is
    corrupt (`corrupt`, if it is already computed)."""
    if corrupt is None:
        corrupt = _corrupt(longest, lowest, scale)
    return lax.bitwise_or(lax.eq(longest, np.float32(0)), corrupt)


def _fenced(used, inv=None):
    """`(used, 1 / used)` behind an optimisation barrier: the scale a cast uses, computed
    apart from everything that reads the tensor's amax. Without it XLA:GPU merges the
    scalar arithmetic of the scale with that of the next state (one multi-output fusion
    of the two `select`s), and the FP8 cast then waits on the reduction of its own input,
    a second pass over the tensor that delayed scaling exists to avoid."""
    if inv is None:
        inv = _formats.reciprocal(used)
    return lax.optimization_barrier((used, inv))


def _require_states(states):
    """DelayedScaling quantises every operand with its `(scale, amax_history)`."""
    for state in states:
        if state is None:
            raise ValueError("`state` is required: DelayedScaling quantises with the state of the operand.")
        if not (isinstance(state, tuple | list) and len(state) == 2):
            raise TypeError(f"`state` must be a `(scale, amax_history)` pair, got {type(state).__name__}.")


class _Plan(NamedTuple):
    """Delayed scaling's plan for one operand of a call."""

    calibrates: Array | None  # the operand's flag "calibrates" (None without `calibrate_first_call`)
    longest: Array | None  # the history's max (None where the delayed scale is planned)
    lowest: Array | None  # and min
    used: Array | None = None  # the delayed scale, from the state alone (None if planned without formats)
    inv: Array | None = None  # and its reciprocal, the cast's multiplier


def _groups(states) -> list[list[int]]:
    """Indices of `states` that can be stacked into one array: the same shapes and, inside
    `jax.shard_map`, the same manual axes (in order of first appearance)."""
    groups: dict[Any, list[int]] = {}
    for i, (scale, history) in enumerate(states):
        key = (jnp.shape(scale), jnp.shape(history), vma(scale), vma(history))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _column(x, i):
    return lax.index_in_dim(x, i, axis=-1, keepdims=False)


class DelayedScaling(AbstractScalingRecipe):
    """Per-tensor delayed scaling, with the semantics of TransformerEngine's `DelayedScaling`.

    The scale a call uses comes from the amax history as it stood before the call:

        amax  = max(history)        ("max")   or   history[0]   ("most_recent")
        scale = amax / fp8_max * 2**margin

    where `fp8_max` is the largest finite value of the operand's format (448 for E4M3,
    57344 for E5M2). A zero or non-finite amax keeps the previous scale. A history that no
    fp8ax update could have written (a negative, NaN or inf entry: the state went through
    an optimiser) counts as empty with `calibrate_first_call` (the call calibrates), and
    otherwise gives no amax, so the previous scale is kept; fp8ax raises on such a state
    wherever it sees its values (an eager call, `fp8ax.calibrate`, `fp8ax.to_serving`,
    `fp8ax.scaling_stats`, `fp8ax.check_state`). The call's own
    amax then goes to the front of the history (index 0), the rest shifts back by one and
    the oldest entry drops. A call whose tensor is all zero or holds a NaN/inf observes
    nothing: the state stays exactly as it was (the call itself still runs, and a NaN
    propagates to its result as it would without FP8).

    `scale` is the *dequantisation* scale: quantise as `x / scale`.
    """

    # Defaults live in `__init__` only.
    history_length: int = eqx.field(static=True)
    margin: int = eqx.field(static=True)
    amax_compute_algo: Literal["max", "most_recent"] = eqx.field(static=True)
    calibrate_first_call: bool = eqx.field(static=True)
    fwd_dtype: np.dtype = eqx.field(static=True, converter=_fwd_dtype)
    grad_dtype: np.dtype = eqx.field(static=True, converter=_grad_dtype)

    def __init__(
        self,
        history_length: int = 1024,
        margin: int = 0,
        amax_compute_algo: Literal["max", "most_recent"] = "max",
        calibrate_first_call: bool = True,
        *,
        formats: Literal["hybrid", "e4m3"] = "hybrid",
        fwd_dtype=None,
        grad_dtype=None,
    ):
        """**Arguments:**

        - `history_length`: number of past amaxes kept per tensor (>= 1).
        - `margin`: extra headroom, in powers of two (>= 0): the scale is multiplied by
          `2**margin`. A float equal to an integer (`2.0`, as TransformerEngine passes
          it) is accepted and stored as that integer.
        - `amax_compute_algo`: `"max"` (the maximum over the history) or `"most_recent"`
          (the newest entry).
        - `calibrate_first_call`: while the history is still empty (the first step), take
          the amax of the tensor being quantised instead of keeping the initial scale
          of one. Without it the first step clips values above the format maximum (448
          for E4M3) and flushes small gradients to zero. `False` gives Haliax's and
          Flax's first step exactly; later scales can differ from theirs in the last bit
          (they compute the same quotient in another order). Either way a training step
          is one program, the same on the first step as on every later one. With it,
          each cast picks its scale with a `select` on "history empty", so the cast
          depends on the reduction of its own tensor's amax on every step (as in
          [`fp8ax.CurrentScaling`][]); without it, the cast depends on the state alone
          and can run beside that reduction. On an H200 the difference was within the
          noise (a decoder layer's step: 26.02 against 25.92 ms; see the "Training on a
          GPU" page), and the first step's calibration showed in the loss after 23
          steps (1.383 against 1.461).
        - `formats`: `"hybrid"` (default: E4M3 forward, E5M2 gradients) or `"e4m3"`
          (E4M3 everywhere). (Keyword only argument.)
        - `fwd_dtype`: FP8 format of the forward operands, overriding `formats` (E4M3,
          `jnp.float8_e4m3fn`, by default). (Keyword only argument.)
        - `grad_dtype`: FP8 format of the output gradient, overriding `formats`
          (`jnp.float8_e5m2` for `"hybrid"`). (Keyword only argument.)
        """
        self.history_length = history_length
        # TransformerEngine passes `margin` as a float (`margin=0.0`): accept a float that
        # equals an integer, and store the integer.
        if isinstance(margin, float | np.floating) and float(margin).is_integer():
            margin = int(margin)
        self.margin = margin
        self.amax_compute_algo = amax_compute_algo
        self.calibrate_first_call = calibrate_first_call
        self.fwd_dtype, self.grad_dtype = _formats.dtypes_from_formats(formats, fwd_dtype, grad_dtype)

    def __check_init__(self):
        if isinstance(self.history_length, bool) or not isinstance(self.history_length, int | np.integer):
            raise TypeError(f"`history_length` must be an int >= 1, got {self.history_length!r}.")
        if self.history_length < 1:
            raise ValueError(f"`history_length` must be >= 1, got {self.history_length}.")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int | np.integer):
            raise TypeError(f"`margin` must be an int >= 0 (or a float equal to one), got {self.margin!r}.")
        if self.margin < 0:
            raise ValueError(f"`margin` must be >= 0, got {self.margin}.")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"`amax_compute_algo` must be 'max' or 'most_recent', got {self.amax_compute_algo!r}.")
        if not isinstance(self.calibrate_first_call, bool):
            raise TypeError(f"`calibrate_first_call` must be a bool, got {self.calibrate_first_call!r}.")

    @property
    def stateful(self) -> bool:
        return True

    @property
    def scale_layout(self) -> ScaleLayout:
        return "tensor"

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> ScalingState:
        return ScalingState.init(self.history_length, batch_shape)

    def state_observed(self, state):
        _, history = state
        return np.max(np.asarray(history), axis=-1) > 0

    def state_valid(self, state):
        scale, history = (np.asarray(v) for v in state)
        good_history = np.all(np.isfinite(history) & (history >= 0), axis=-1)
        return good_history & np.isfinite(scale) & (scale > 0)

    def serving_scale(self, state, dtype):
        # The scale the next call would use, from the history alone.
        scale, history = state
        return dataclasses.replace(self, calibrate_first_call=False).scale_for_call(
            scale, history, jnp.zeros((), jnp.float32), _formats.fp8_max(dtype)
        )

    def state_stats(self, state):
        scale, history = (np.asarray(v) for v in state)
        return {"scale": scale, "amax": history[..., 0], "amax_history_max": history.max(axis=-1)}

    def state_history(self, state):
        return np.asarray(state[1])

    def _checked(self, amax, scale, fp8_max, *, finite_amax: bool = False):
        # One multiply by a float32 constant, `2**margin / fp8_max` rounded once. Flax's
        # `1 / ((fp8_max / amax) / 2**margin)` is the same number mathematically, but XLA
        # simplifies it differently in different programs (inside `lax.scan` or not),
        # which would make the state depend by an ulp on how a layer was called.
        # `fp8_max` may be a tuple: one format per entry of the last axis (several
        # operands' states stacked), the same float32 multiply for each.
        #
        # The scale is at least the smallest normal float32, as in current scaling: a
        # smaller product would be flushed to zero (XLA does on CPUs and GPUs), which
        # used to keep the old scale and flush a tensor of tiny values (amax below about
        # 5.3e-36 for E4M3) to zero.
        factor = np.float32(2.0**self.margin) / np.asarray(fp8_max, np.float64)
        new = _formats.scale_from_amax(amax, factor.astype(np.float32))
        if finite_amax and np.all(factor <= 1):
            # A finite amax times a factor <= 1 cannot overflow: only zero (an empty
            # history) remains.
            return _formats.select(lax.gt(amax, np.float32(0)), new, scale)
        # Covers a zero, NaN or inf amax, and a product that overflows.
        return _formats.select(lax.bitwise_and(_positive_finite(amax), lax.is_finite(new)), new, scale)

    def _past_amax(self, amax_history, longest):
        return longest if self.amax_compute_algo == "max" else amax_history[..., 0]

    def scale_for_call(
        self,
        scale: Float[Array, ""],
        amax_history: Float[Array, " history"],
        amax: Float[Array, ""],
        fp8_max: float,
    ) -> Float[Array, ""]:
        """The dequantisation scale one call uses, from the state before the call (and,
        while the history is empty or corrupt and `calibrate_first_call` is set, the
        call's own `amax`). Without `calibrate_first_call`, a history that no fp8ax update
        writes (a negative, NaN or inf entry) gives no amax and the scale stays."""
        # History entries are >= 0, and all 0 until something is recorded. A history
        # holding anything else gives no amax, as in `quantize_operand`.
        longest, lowest = _history_bounds(amax_history)
        past = self._past_amax(amax_history, longest)
        past = _formats.select(lax.ge(lowest, np.float32(0)), past, lax.full_like(past, 0))
        if self.calibrate_first_call:
            past = _formats.select(_calibrates(longest, lowest, scale), amax, past)
        return self._checked(past, scale, fp8_max)

    def next_state(
        self,
        scale_used: Float[Array, ""],
        amax_history: Float[Array, " history"],
        amax: Float[Array, ""],
    ) -> tuple[Float[Array, ""], Float[Array, " history"]]:
        """The state after one call that used `scale_used` and observed `amax`. Monotone
        non-decreasing in `amax` for a fixed old state."""
        # A call that observed nothing usable (an all-zero or non-finite tensor) reports
        # scale 0: "no observation". If no use of the layer observed anything,
        # `apply_updates` keeps the old state untouched; otherwise the max-merge ignores it.
        valid = _positive_finite(amax)
        zero = lax.full_like(amax, 0)
        recorded = _formats.select(valid, amax, zero)
        kept = lax.slice_in_dim(amax_history, 0, amax_history.shape[-1] - 1, axis=-1)
        history = lax.concatenate([lax.expand_dims(recorded, (recorded.ndim,)), kept], recorded.ndim)
        return _formats.select(valid, scale_used, zero), history

    def quantize_operand(self, x, contracting_axes, dtype, *, state=None, key=None, merge=_no_merge):
        return self.quantize_operands([Operand(x, contracting_axes, dtype, state, key, merge)])[0]

    def plan(self, states, dtypes=None):
        # Each history's (max, min), from which the state alone decides each operand's
        # delayed scale; with `dtypes`, the plan holds those scales and their reciprocals.
        # With `calibrate_first_call` it also holds each operand's flag "calibrates" (an
        # empty or corrupt history), and the delayed scale is only one side of the
        # `select` in `quantize_operands`, so no scale is planned.
        #
        # The operands' states are stacked and computed on together (the same float32
        # operations, entry by entry): one reduction over the histories and one scalar
        # kernel for a call's scales on XLA:GPU, instead of two kernels per operand.
        _require_states(states)
        if dtypes is not None and len(dtypes) != len(states):
            raise ValueError(f"`dtypes` must give one format per state ({len(states)}), got {len(dtypes)}.")
        plans: list[Any] = [None] * len(states)
        for idx in _groups(states):
            scales = _formats.stack([states[i][0] for i in idx])
            histories = _formats.stack([states[i][1] for i in idx], axis=-2)
            longest, lowest = _history_bounds(histories)
            used = inv = None
            if dtypes is not None:
                past = self._past_amax(histories, longest)
                past = _formats.select(lax.ge(lowest, np.float32(0)), past, lax.full_like(longest, 0))
                used = self._checked(past, scales, tuple(_formats.fp8_max(dtypes[i]) for i in idx))
                inv = _formats.reciprocal(used)
            flags = _calibrates(longest, lowest, scales) if self.calibrate_first_call else None
            for k, i in enumerate(idx):
                plans[i] = _Plan(
                    None if flags is None else _column(flags, k),
                    None if used is not None else _column(longest, k),
                    None if used is not None else _column(lowest, k),
                    None if used is None else _column(used, k),
                    None if inv is None else _column(inv, k),
                )
        return plans

    def planned_scale(self, plan):
        # With `calibrate_first_call` the scale may come from the tensor's own amax.
        if not isinstance(plan, _Plan) or plan.calibrates is not None:
            return None
        return plan.used

    def quantize_operands(self, operands):
        # Delayed scaling: the values are quantised with the scale the history gives,
        # and the tensor's amax (for the next state) is computed beside the cast, not
        # before it: nothing in the cast waits for a reduction over the tensor, so a
        # compiler can fuse both into one pass.
        #
        # With `calibrate_first_call`, an operand whose history is empty (a fresh layer's
        # first call) or corrupt takes the scale from its own amax instead, through a
        # `select` on its flag: one program for the first step and every later one, with
        # no conditional and no host callback (so JAX's persistent compilation cache
        # stores it). The price is that the cast depends on the tensor's amax on every
        # step, as in current scaling.
        operands = _as_operands(operands)
        _require_states([op.state for op in operands])
        if any(op.plan is None for op in operands):
            plans = self.plan([op.state for op in operands], [op.dtype for op in operands])
            plans = lax.optimization_barrier(plans)  # see `_fenced` (the pipeline does this itself)
            operands = [op._replace(plan=p) for op, p in zip(operands, plans)]
        results = []
        for op in operands:
            (scale, history), p = op.state, op.plan
            fp8_max = _formats.fp8_max(op.dtype)
            if p.used is not None:
                used, inv = p.used, p.inv  # planned from the state alone
            else:  # a plan made without the formats
                past = self._past_amax(history, p.longest)
                past = _formats.select(lax.ge(p.lowest, np.float32(0)), past, lax.full_like(p.longest, 0))
                used = self._checked(past, scale, fp8_max)
                inv = None
            # One observation for the whole call: under `vmap` and `shard_map`, the max
            # over the examples and shards the state does not vary over.
            seen = op.merge(_formats.amax(op.x))
            if p.calibrates is not None:
                # A history no fp8ax update writes (a negative, NaN or inf entry: the state
                # went through an optimiser) calibrates too, so training stays right;
                # fp8ax raises on it wherever it sees the state's values
                # (`fp8ax.check_state`).
                # (A corrupt scale is no fallback for a tensor that observes nothing: 1.)
                fallback = _formats.select(_bad_scale(scale), lax.full_like(scale, 1), scale)
                used = _formats.select(p.calibrates, self._checked(seen, fallback, fp8_max), used)
                inv = None
            used, inv = _fenced(used, inv) if inv is None else (used, inv)
            values = _formats.quantize(op.x, used, op.dtype, inv=inv)
            results.append((QuantizedArray(values, used), self.next_state(used, history, seen)))
        return results
