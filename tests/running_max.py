"""A stateful recipe written against fp8ax's public interface only, as a user would write
one: the proof that a recipe owns its state type (issue 23).

`RunningMaxScaling` keeps one array per operand, the largest amax any call has seen (the
"max" calibrator of post-training quantization, kept during training): a call quantizes
with `amax / fp8_max` from that running max (its own amax while nothing is recorded),
and records `max(running, own amax)`. Calibration, checkpoints, serving, `scaling_stats`,
`plot_amax_history`, `apply_updates` and the GEMM pipeline all work with it through the
recipe's methods and its `AbstractState` subclass; nothing in fp8ax names it.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

import fp8ax

_TINY = np.float32(2.0**-126)


class RunningMax(fp8ax.AbstractState):
    """The largest amax seen (0: nothing yet), one float32 per layer."""

    fields = ("amax",)
    entry_ndims = (0,)
    __slots__ = ()

    def written(self):
        # A call's new state is at least its own amax; the zero cotangent of a layer a
        # step did not use is 0. (A layer that has seen only zeros stays at 0 either way.)
        return self.amax > 0


def _amax(x):
    """max |x| in float32, NaN if x holds one (a NaN records nothing)."""
    a = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(jnp.any(jnp.isnan(x)), jnp.float32(jnp.nan), a)


def _scale(amax, fp8_max):
    """Dequantization scale for `amax` (1 where it is zero or not finite)."""
    ok = jnp.isfinite(amax) & (amax > 0)
    return jnp.where(ok, jnp.maximum(amax * np.float32(1 / fp8_max), _TINY), jnp.float32(1))


class RunningMaxScaling(fp8ax.AbstractStatefulRecipe):
    fwd_dtype: np.dtype = eqx.field(static=True, default=np.dtype(jnp.float8_e4m3fn))
    grad_dtype: np.dtype = eqx.field(static=True, default=np.dtype(jnp.float8_e5m2))

    @property
    def scale_layout(self):
        return "tensor"

    def init_state(self, batch_shape=()):
        return RunningMax(jnp.zeros(batch_shape, jnp.float32))

    def quantize_operand(self, x, contracting_axes, dtype, *, state=None, key=None, merge=lambda v: v):
        del contracting_axes, key
        (running,) = state
        fp8_max = float(jnp.finfo(dtype).max)
        seen = merge(_amax(x))
        scale = _scale(jnp.where(running > 0, running, seen), fp8_max)
        scaled = jnp.clip(x.astype(jnp.float32) * (np.float32(1) / scale), -fp8_max, fp8_max)
        values = lax.convert_element_type(scaled, dtype)
        new = jnp.maximum(running, jnp.where(jnp.isfinite(seen), seen, jnp.float32(0)))
        return fp8ax.QuantizedArray(values, scale), (new,)

    def state_observed(self, state):
        return np.asarray(state[0]) > 0

    def serving_scale(self, state, dtype):
        return _scale(state[0], float(jnp.finfo(dtype).max))

    def state_stats(self, state):
        return {"running_amax": np.asarray(state[0])}

    def state_history(self, state):
        return np.asarray(state[0])[..., None]
