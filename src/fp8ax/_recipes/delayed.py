# Delayed scaling: the one recipe that keeps state (a scale and an amax history per
# operand), and the check that tells a corrupt state from a real one.

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float

from .. import _formats
from .._boundaries import vma
from .._maxgrad import as_f32
from .._quantized import QuantizedArray, ScaleLayout
from .._scaling_state import (
    ScalingState,
    pack_state,
    read_state,
    stacked_parts,
    stored_columns,
    stored_history,
    unit_inverse,
)
from .base import AbstractStatefulRecipe, Operand, as_fwd_dtype, as_grad_dtype, as_operands, no_merge


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


def _kept_scale(scale):
    """The scale a call keeps when it has no amax: the state's, or 1 (a fresh state's)
    where that is 0 or corrupt."""
    return _formats.select(_bad_scale(scale), lax.full_like(scale, 1), scale)


def _calibrates(longest, lowest, scale):
    """Whether a call calibrates: its history is empty (its max is 0) or its state is
    corrupt, holding values no fp8ax update writes (see `_history_bounds`): the max is
    NaN or inf, the min negative, or the scale not positive and finite. (A max that is
    not positive and finite covers "empty" and the first case: a negative max has a
    negative min.)"""
    bad = lax.bitwise_or(lax.bitwise_not(_positive_finite(longest)), lax.lt(lowest, np.float32(0)))
    return lax.bitwise_or(bad, _bad_scale(scale))


def _required_states(states) -> list[tuple[Array, ...]]:
    """`states` as a list, checked: DelayedScaling quantizes every operand with its
    state: `(data,)` (a `ScalingState`'s array: unit, scale, amax history), or
    `(scale, amax_history, unit)`, or `(scale, amax_history)` (unit 1)."""
    states = list(states)
    for state in states:
        if state is None:
            raise ValueError("`state` is required: DelayedScaling quantizes with the state of the operand.")
        if not (isinstance(state, tuple | list) and len(state) in (1, 2, 3)):
            raise TypeError(
                "`state` must be a `ScalingState`'s `(data,)`, a `(scale, amax_history, unit)` triple or a "
                f"`(scale, amax_history)` pair, got {type(state).__name__}."
            )
    return [tuple(state) for state in states]


class _Plan(NamedTuple):
    """Delayed scaling's plan for one operand of a call."""

    calibrates: Array | None  # the operand's flag "calibrates" (None without `calibrate_first_call`)
    inv_unit: Array  # `unit_inverse` of the state's unit, which reads the stored values
    scale: Array | None  # the scale the state stands for, or 1 where that is 0 or corrupt (`_kept_scale`;
    # None where the delayed scale is planned)
    past: Array | None  # the amax the history gives (None where the delayed scale is planned)
    used: Array | None = None  # the delayed scale, from the state alone (planned with the formats
    inv: Array | None = None  # and without the first-call calibration), and its reciprocal


def _through_unit(inv, scale, longest):
    """The scale and the history's max a state stands for: the stored ones times the
    `unit_inverse` of its unit (see `ScalingState`), with no `select` for the units
    `through_unit` reads apart. A unit of 0 gives 0 for both, which the checks that
    follow take as a fresh state's ("no amax": the scale kept, and a kept scale that is
    not positive reads as 1); a negative or NaN unit gives negative or NaN values, which
    they reject alike. Each `select` is an instruction per operand per layer in the
    program XLA fuses: on the H100 compile of bench/state_cost.py's 16-block stack,
    these took 0.3 s of 3.5. Reading the bounds instead of the history (the max of a
    history times a positive number is its max times it) keeps the arithmetic on a few
    scalars."""
    return lax.mul(scale, inv), lax.mul(longest, inv)


def _groups(states) -> list[list[int]]:
    """Indices of `states` (as `plan` takes them) that can be stacked into one array: the
    same form, the same shapes and, inside `jax.shard_map`, the same manual axes (in order
    of first appearance)."""
    groups: dict[Any, list[int]] = {}
    for i, state in enumerate(states):
        key = tuple((jnp.shape(v), vma(v)) for v in state)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _read_apart(*states, newest: bool) -> tuple:
    """`(units, scales, longest, lowest, newest)` of delayed-scaling states of one shape,
    each stacked along a new last axis (`newest`, each history's newest stored entry:
    None unless asked for): each state read apart, its history's bounds in one variadic
    reduction with the others'. States in the `(data,)` form arrive as bare arrays (the
    branch of `_formats.platform_dependent`)."""
    states = [state if isinstance(state, tuple) else (state,) for state in states]
    units, scales, histories = stored_columns(states)
    last = units.ndim - 1
    bounds = _formats.max_min_each(histories, keepdims=True)
    longest, lowest = (lax.concatenate(column, last) for column in zip(*bounds))
    first = None
    if newest:
        first = lax.concatenate([lax.slice_in_dim(h, 0, 1, axis=h.ndim - 1) for h in histories], last)
    return units, scales, longest, lowest, first


def _read_stacked(*datas, newest: bool) -> tuple:
    """`_read_apart` of `ScalingState` arrays of one shape, stacked first: one
    `concatenate` and three slices (`stacked_parts`) and one reduction over the stacked
    histories, where reading them apart takes three slices per state and four
    concatenations. XLA:GPU fuses the stacking into the reduction, with the same kernels,
    and its compile of bench/state_cost.py's 16-block stack and Stacked decoder takes 4 to
    5% less time; XLA:CPU compiles it no faster, and keeps reading them apart
    (bench/README.md, run M)."""
    units, scales, stacked = stacked_parts(list(datas))
    last = stacked.ndim - 1
    longest, lowest = _formats.max_min(stacked, stacked, (last,))
    first = lax.squeeze(lax.slice_in_dim(stacked, 0, 1, axis=last), (last,)) if newest else None
    return units, scales, longest, lowest, first


@functools.cache
def _read_branches(newest: bool) -> tuple:
    # The same two functions for every call (JAX caches a branch's trace by its function).
    return functools.partial(_read_apart, newest=newest), functools.partial(_read_stacked, newest=newest)


def _columns(x, n: int) -> list:
    """The `n` entries of `x`'s last axis, each without it (one `split`); `n` Nones for a
    None `x`."""
    if x is None:
        return [None] * n
    if n == 1:
        return [lax.squeeze(x, (x.ndim - 1,))]
    return [lax.squeeze(part, (x.ndim - 1,)) for part in lax.split(x, (1,) * n, axis=x.ndim - 1)]


class DelayedScaling(AbstractStatefulRecipe):
    """Per-tensor delayed scaling, with the semantics of TransformerEngine's `DelayedScaling`.

    The scale a call uses comes from the amax history as it stood before the call:

        amax  = max(history)        ("max")   or   history[0]   ("most_recent")
        scale = amax / fp8_max * 2**margin

    where `fp8_max` is the largest finite value of the operand's format (448 for E4M3,
    57344 for E5M2). A zero or non-finite amax keeps the previous scale. A history that no
    fp8ax update could have written (a negative, NaN or inf entry: the state went through
    an optimizer) counts as empty with `calibrate_first_call` (the call calibrates), and
    otherwise gives no amax, so the previous scale is kept; fp8ax raises on such a state
    wherever it sees its values (an eager call, `fp8ax.calibrate`, `fp8ax.to_serving`,
    `fp8ax.scaling_stats`, `fp8ax.check_state`). The call's own
    amax then goes to the front of the history (index 0), the rest shifts back by one and
    the oldest entry drops. A call whose tensor is all zero or holds a NaN/inf observes
    nothing: the state stays exactly as it was (the call itself still runs, and a NaN
    propagates to its result as it would without FP8).

    `scale` is the *dequantization* scale: quantize as `x / scale`.
    """

    # Defaults live in `__init__` only.
    history_length: int = eqx.field(static=True)
    margin: int = eqx.field(static=True)
    amax_compute_algo: Literal["max", "most_recent"] = eqx.field(static=True)
    calibrate_first_call: bool = eqx.field(static=True)
    fwd_dtype: np.dtype = eqx.field(static=True, converter=as_fwd_dtype)
    grad_dtype: np.dtype = eqx.field(static=True, converter=as_grad_dtype)

    def __init__(
        self,
        history_length: int = 1024,
        margin: int = 0,
        amax_compute_algo: Literal["max", "most_recent"] = "max",
        calibrate_first_call: bool = False,
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
          the amax of the tensor being quantized instead of keeping the initial scale
          of one (default `False`). Without it the first step clips values above the
          format maximum (448 for E4M3) and flushes small gradients to zero, as
          TransformerEngine's, Haliax's and Flax's first step do (later scales can
          differ from theirs in the last bit: they compute the same quotient in another
          order); [`fp8ax.calibrate`][] before training gives that step real scales
          from a program of its own. Either way a training step is one program, the
          same on the first step as on every later one. With it, each cast picks its
          scale with a `select` on "history empty", so the cast depends on the
          reduction of its own tensor's amax on every step (as in
          [`fp8ax.CurrentScaling`][]); without it, the cast depends on the state alone
          and runs beside that reduction. On an H200 that cost a Llama step 5.5 ms of
          143 (see the "Training on a GPU" page), and the first step's calibration
          showed in the loss after 23 steps (0.830 against 0.947).
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
    def scale_layout(self) -> ScaleLayout:
        return "tensor"

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> ScalingState:
        return ScalingState.init(self.history_length, batch_shape)

    def state_observed(self, state):
        _, history = read_state(tuple(state))
        return np.max(history, axis=-1) > 0

    def state_valid(self, state):
        scale, history = read_state(tuple(state))
        good_history = np.all(np.isfinite(history) & (history >= 0), axis=-1)
        return good_history & np.isfinite(scale) & (scale > 0)

    def serving_scale(self, state, dtype):
        # The scale the next call would use, from the history alone.
        scale, history = (jnp.asarray(v, jnp.float32) for v in read_state(tuple(state)))
        return dataclasses.replace(self, calibrate_first_call=False).scale_for_call(
            scale, history, jnp.zeros((), jnp.float32), _formats.fp8_max(dtype)
        )

    def state_stats(self, state):
        scale, history = read_state(tuple(state))
        return {"scale": scale, "amax": history[..., 0], "amax_history_max": history.max(axis=-1)}

    def state_history(self, state):
        return read_state(tuple(state))[1]

    def _checked(self, amax, scale, fp8_max, *, kept: bool = False, ok=None):
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
        #
        # This runs on scalars, several times per layer, and XLA:CPU copies it into each
        # fusion that reads its result: it is kept to the fewest operations.
        factor = np.float32(2.0**self.margin) / np.asarray(fp8_max, np.float64)
        new = _formats.scale_from_amax(amax, factor.astype(np.float32))
        if not kept:
            scale = _kept_scale(scale)
        usable = _positive_finite(amax)
        if ok is not None:  # (the caller's own condition for using the amax)
            usable = lax.bitwise_and(usable, ok)
        if not np.all(factor <= 1):
            # A finite amax times a factor <= 1 cannot overflow; a larger factor can.
            usable = lax.bitwise_and(usable, lax.is_finite(new))
        return _formats.select(usable, new, scale)

    def _past_amax(self, amax_history, longest):
        return longest if self.amax_compute_algo == "max" else amax_history[..., 0]

    def scale_for_call(
        self,
        scale: Float[Array, ""],
        amax_history: Float[Array, " history"],
        amax: Float[Array, ""],
        fp8_max: float,
    ) -> Float[Array, ""]:
        """The dequantization scale one call uses, from the state before the call (and,
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
        _, scale, recorded, kept = self._next(scale_used, amax_history, amax)
        return scale, lax.concatenate([lax.expand_dims(recorded, (recorded.ndim,)), kept], recorded.ndim)

    def _next(self, scale_used, amax_history, amax):
        """`next_state` in parts: whether the call observed something, the new scale, the
        amax recorded and the entries kept from the history (all but the oldest)."""
        # A call that observed nothing usable (an all-zero or non-finite tensor) reports
        # scale 0: "no observation". If no use of the layer observed anything,
        # `apply_updates` keeps the old state untouched; otherwise the max-merge ignores it.
        valid = _positive_finite(amax)
        zero = lax.full_like(amax, 0)
        kept = lax.slice_in_dim(amax_history, 0, amax_history.shape[-1] - 1, axis=-1)
        return valid, _formats.select(valid, scale_used, zero), _formats.select(valid, amax, zero), kept

    def quantize_operand(self, x, contracting_axes, dtype, *, state=None, key=None, merge=no_merge):
        return self.quantize_operands([Operand(x, contracting_axes, dtype, state, key, merge)])[0]

    def plan(self, states, dtypes=None):
        # Each history's (max, min), from which the state alone decides each operand's
        # delayed scale; with `dtypes`, the plan holds those scales and their reciprocals.
        # With `calibrate_first_call` it also holds each operand's flag "calibrates" (an
        # empty or corrupt history), and the delayed scale is only one side of the
        # `select` in `quantize_operands`, so no scale is planned.
        #
        # The operands' histories are reduced together and their scalars stacked and
        # computed on together (the same float32 operations, entry by entry): one
        # reduction over the histories and one scalar kernel for a call's scales on
        # XLA:GPU, instead of two kernels per operand.
        states = _required_states(states)
        if dtypes is not None and len(dtypes) != len(states):
            raise ValueError(f"`dtypes` must give one format per state ({len(states)}), got {len(dtypes)}.")
        plans: list[Any] = [None] * len(states)
        for idx in _groups(states):
            # The group's units, scales, the bounds of its histories and (for
            # "most_recent") their newest entries, each stacked along the last axis
            # (`_read_stacked`, `_read_apart`).
            group = [states[i] for i in idx]
            newest = self.amax_compute_algo != "max"
            if all(len(state) == 1 for state in group):
                datas = [as_f32(jnp.asarray(state[0])) for state in group]
                cpu, default = _read_branches(newest)
                units, scales, longest, lowest, past = _formats.platform_dependent(*datas, cpu=cpu, default=default)
            else:
                units, scales, longest, lowest, past = _read_apart(*group, newest=newest)
            inv_units = unit_inverse(units)
            # (`lowest` is read for its sign only, which a positive unit keeps; where the
            # unit is not positive, `longest` is rejected already: see `_through_unit`.)
            scales, longest = _through_unit(inv_units, scales, longest)
            flags = _calibrates(longest, lowest, scales) if self.calibrate_first_call else None
            scales = _kept_scale(scales)
            past = longest if past is None else lax.mul(past, inv_units)
            used = inv = None
            if dtypes is not None and flags is None:
                # A corrupt history gives no amax: `_checked`'s `ok`. The plan then holds
                # the scales and their reciprocals only (each value planned is carried
                # to the casts and the backward pass).
                used = self._checked(
                    past,
                    scales,
                    tuple(_formats.fp8_max(dtypes[i]) for i in idx),
                    kept=True,
                    ok=lax.ge(lowest, np.float32(0)),
                )
                inv = _formats.reciprocal(used)
                past = scales = None
            elif flags is None:
                # (With the calibration, a corrupt history calibrates and `past` is not read.)
                past = _formats.select(lax.ge(lowest, np.float32(0)), past, lax.full_like(past, 0))
            flags, inv_units, scales, past, used, inv = _formats.computed_once(
                (flags, inv_units, scales, past, used, inv), fence=False
            )
            columns = [_columns(a, len(idx)) for a in (flags, inv_units, scales, past, used, inv)]
            for k, i in enumerate(idx):
                plans[i] = _Plan(*(c[k] for c in columns))
        return plans

    def planned_scale(self, plan):
        # With `calibrate_first_call` the scale may come from the tensor's own amax.
        if not isinstance(plan, _Plan) or plan.calibrates is not None:
            return None
        return plan.used

    def quantize_operands(self, operands):
        # Delayed scaling: the values are quantized with the scale the history gives,
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
        operands = as_operands(operands)
        states = _required_states([op.state for op in operands])
        if any(op.plan is None for op in operands):
            plans = self.plan(states, [op.dtype for op in operands])
            plans = _formats.fenced(plans)  # see below (the pipeline does this itself)
            operands = [op._replace(plan=p) for op, p in zip(operands, plans)]
        scales, seen_amaxes, fresh = [], [], []
        for i, (op, state) in enumerate(zip(operands, states)):  # (`_replace` keeps the order)
            p = op.plan
            fp8_max = _formats.fp8_max(op.dtype)
            # One observation for the whole call: under `vmap` and `shard_map`, the max
            # over the examples and shards the state does not vary over.
            seen = op.merge(_formats.amax(op.x))
            if p.used is not None:
                used, inv = p.used, p.inv  # planned from the state alone
            else:
                past = p.past
                if p.calibrates is not None:
                    # A history no fp8ax update writes (a negative, NaN or inf entry: the
                    # state went through an optimizer) calibrates too, so training stays
                    # right; fp8ax raises on it wherever it sees the state's values
                    # (`fp8ax.check_state`). (A corrupt scale is no fallback for a tensor
                    # that observes nothing: `_checked` gives 1 then.) One `_checked` of
                    # the selected amax is the `select` of the two scales.
                    past = _formats.select(p.calibrates, seen, past)
                used = self._checked(past, p.scale, fp8_max, kept=True)
                inv = None
            if inv is None:
                fresh.append(i)
            scales.append((used, _formats.reciprocal(used) if inv is None else inv))
            seen_amaxes.append(seen)
        # The scales not planned from the state alone (a calibrating `select`, which reads
        # the amax) are computed once for the call's operands, apart from everything else
        # that reads the amax. Without the fence XLA:GPU merges the scalar arithmetic of
        # the scale with that of the next state (one multi-output fusion of the two
        # `select`s), and the FP8 cast waits on the reduction of its own input; it also
        # splits the scalar checks into several small kernels (the H100 compile of
        # bench/state_cost.py's MLP: 48 kernels against 39; inside a scanned stack one
        # fewer per layer). XLA:CPU would copy them into every fusion that reads the
        # scale (`computed_once`).
        if fresh:
            once = _formats.computed_once([scales[i] for i in fresh])
            for i, pair in zip(fresh, once):
                scales[i] = pair
        results = []
        for op, state, (used, inv), seen in zip(operands, states, scales, seen_amaxes):
            p = op.plan
            values = _formats.quantize(op.x, used, op.dtype, inv=inv)
            # The history the state stands for (`through_unit` without its `select`: a
            # unit of 0 gives an empty history, as a fresh state has).
            stored = stored_history(state)
            history = lax.mul(stored, lax.broadcast_in_dim(p.inv_unit, stored.shape, tuple(range(p.inv_unit.ndim))))
            valid, new_scale, recorded, kept = self._next(used, history, seen)
            recorded = lax.expand_dims(recorded, (recorded.ndim,))
            # The unit: 1 where the call observed something (its new scale, the positive
            # scale it used, is > 0), else 0; the `(scale, amax_history)` form has none.
            unit = None if len(state) == 2 else lax.convert_element_type(valid, np.float32)
            new_state: tuple
            if len(state) == 1:
                new_state = (pack_state(unit, new_scale, recorded, kept),)
            else:
                new_state = (new_scale, lax.concatenate([recorded, kept], recorded.ndim - 1))
                new_state = new_state if unit is None else (*new_state, unit)
            results.append((QuantizedArray(values, used), new_state))
        return results
