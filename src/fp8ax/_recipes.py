from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._formats import as_fp8_dtype
from ._state import ScalingState


def _fwd_dtype(value):
    return as_fp8_dtype(value, "fwd_dtype")


def _grad_dtype(value):
    return as_fp8_dtype(value, "grad_dtype")


class AbstractScalingRecipe(eqx.Module):
    """How a low-precision dot general chooses its scales: the one interface of every
    fp8ax recipe.

    A recipe is configuration only (all of its fields are static). It names the formats
    of the forward operands and of the output gradient (`fwd_dtype`, `grad_dtype`), and
    keeps state only if it needs it:

    - *stateful* recipes ([`fp8ax.DelayedScaling`][]) implement `init_state`,
      `scale_for_call` and `next_state`: the scale comes from a state that training
      writes back through the gradient (see [`fp8ax.apply_updates`][]);
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
        return True

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> ScalingState:
        """Fresh state for one operand (`batch_shape` for stacked layers). Stateful recipes."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state.")

    def scale_for_call(
        self,
        scale: Float[Array, ""],
        amax_history: Float[Array, " history"],
        amax: Float[Array, ""],
        fp8_max: float,
    ) -> Float[Array, ""]:
        """The dequantisation scale one call uses, from the state before the call and the
        call's own amax. Stateful recipes."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state.")

    def next_state(
        self,
        scale_used: Float[Array, ""],
        amax_history: Float[Array, " history"],
        amax: Float[Array, ""],
    ) -> tuple[Float[Array, ""], Float[Array, " history"]]:
        """The state after one call. It must be monotone non-decreasing in `amax` for a
        fixed old state: several uses of a layer are merged with an elementwise max.
        Stateful recipes."""
        raise NotImplementedError(f"{type(self).__name__} keeps no state.")


class DelayedScaling(AbstractScalingRecipe):
    """Per-tensor delayed scaling, with the semantics of TransformerEngine's `DelayedScaling`.

    The scale a call uses comes from the amax history as it stood before the call:

        amax  = max(history)        ("max")   or   history[0]   ("most_recent")
        scale = amax / fp8_max * 2**margin

    where `fp8_max` is the largest finite value of the operand's format (448 for E4M3,
    57344 for E5M2). A zero or non-finite amax keeps the previous scale. The call's own
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
          `2**margin`.
        - `amax_compute_algo`: `"max"` (the maximum over the history) or `"most_recent"`
          (the newest entry).
        - `calibrate_first_call`: while the history is still empty (the first step), take
          the amax of the tensor being quantised instead of keeping the initial scale
          of one. Without it the first step clips values above the format maximum (448
          for E4M3) and flushes small gradients to zero. `False` gives Haliax's and
          Flax's first step exactly; later scales can differ from theirs in the last bit
          (they compute the same quotient in another order).
        - `formats`: `"hybrid"` (default: E4M3 forward, E5M2 gradients) or `"e4m3"`
          (E4M3 everywhere). (Keyword only argument.)
        - `fwd_dtype`: FP8 format of the forward operands, overriding `formats` (E4M3,
          `jnp.float8_e4m3fn`, by default). (Keyword only argument.)
        - `grad_dtype`: FP8 format of the output gradient, overriding `formats`
          (`jnp.float8_e5m2` for `"hybrid"`). (Keyword only argument.)
        """
        self.history_length = history_length
        self.margin = margin
        self.amax_compute_algo = amax_compute_algo
        self.calibrate_first_call = calibrate_first_call
        from ._current import _dtypes_from_formats

        self.fwd_dtype, self.grad_dtype = _dtypes_from_formats(formats, fwd_dtype, grad_dtype)

    def __check_init__(self):
        if isinstance(self.history_length, bool) or not isinstance(self.history_length, int | np.integer):
            raise TypeError(f"`history_length` must be an int >= 1, got {self.history_length!r}.")
        if self.history_length < 1:
            raise ValueError(f"`history_length` must be >= 1, got {self.history_length}.")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int | np.integer):
            raise TypeError(f"`margin` must be an int >= 0, got {self.margin!r}.")
        if self.margin < 0:
            raise ValueError(f"`margin` must be >= 0, got {self.margin}.")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"`amax_compute_algo` must be 'max' or 'most_recent', got {self.amax_compute_algo!r}."
            )
        if not isinstance(self.calibrate_first_call, bool):
            raise TypeError(f"`calibrate_first_call` must be a bool, got {self.calibrate_first_call!r}.")

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> ScalingState:
        return ScalingState.init(self.history_length, batch_shape)

    def scale_for_call(self, scale, amax_history, amax, fp8_max):
        # History entries are >= 0, and all 0 until something is recorded.
        longest = jnp.max(amax_history, axis=-1)
        past = longest if self.amax_compute_algo == "max" else amax_history[..., 0]
        if self.calibrate_first_call:
            past = jnp.where(longest == 0, amax, past)
        # One multiply by a float32 constant, `2**margin / fp8_max` rounded once. Flax's
        # `1 / ((fp8_max / amax) / 2**margin)` is the same number mathematically, but XLA
        # simplifies it differently in different programs (inside `lax.scan` or not),
        # which would make the state depend by an ulp on how a layer was called.
        new = past * jnp.float32(2.0**self.margin / fp8_max)
        # Covers a zero, NaN or inf amax, and a product that under/overflows.
        ok = jnp.isfinite(new) & (new > 0)
        return jnp.where(ok, new, scale)

    def next_state(self, scale_used, amax_history, amax):
        # A call that observed nothing usable (an all-zero or non-finite tensor) reports
        # scale 0: "no observation". If no use of the layer observed anything,
        # `apply_updates` keeps the old state untouched; otherwise the max-merge ignores it.
        valid = jnp.isfinite(amax) & (amax > 0)
        recorded = jnp.where(valid, amax, jnp.float32(0.0))
        history = jnp.concatenate([recorded[..., None], amax_history[..., :-1]], axis=-1)
        return jnp.where(valid, scale_used, jnp.float32(0.0)), history
