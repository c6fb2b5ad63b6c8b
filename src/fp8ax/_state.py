import weakref
from typing import Any

import haliax.quantization as _haxq
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._formats import select
from ._maxgrad import as_f32, is_max, to_f32, to_max


@jtu.register_pytree_with_keys_class
class ScalingState:
    """Delayed-scaling state of one operand: a scale and an amax history.

    - `scale`: float32, shape `()` (or `(*batch,)` for stacked layers). The
      *dequantisation* scale: a tensor `x` is quantised as `x / scale` and recovered as
      `q * scale` (the Flax/Haliax convention; TransformerEngine's `scale_inv`).
    - `amax_history`: float32, shape `(history_length,)` (or `(*batch, history_length)`),
      the newest amax at index 0. An entry of 0 means "nothing recorded".

    Both are ordinary float32 pytree leaves: `eqx.filter_grad` differentiates them,
    `eqx.tree_serialise_leaves` saves them, and their "gradient" is the new state (see
    [`fp8ax.apply_updates`][]).

    !!! Note

        Inside a traced function (`jax.grad`, `jax.jit`, ...) this node holds its values
        in a float32 dtype whose cotangents accumulate with `max` instead of `+`. That is
        how a layer used several times in one step (tied weights, `lax.scan`, `vmap`)
        gets the state of one merged observation instead of a sum. The attributes and the
        leaves are always float32. See the "How the FP8 state works" page of the docs.
    """

    # `_scale`/`_amax_history`: the values, in the max-accumulating form while traced;
    # `_views`: their float32 views (the pytree leaves), made once per value.
    __slots__ = ("_scale", "_amax_history", "_views")

    def __init__(self, scale: Any, amax_history: Any):
        (s, s_view), (h, h_view) = _enter(scale), _enter(amax_history)
        object.__setattr__(self, "_scale", s)
        object.__setattr__(self, "_amax_history", h)
        object.__setattr__(self, "_views", [s_view, h_view])

    @classmethod
    def init(cls, history_length: int, batch_shape: tuple[int, ...] = ()) -> "ScalingState":
        """Fresh state: scale 1, empty (all-zero) history."""
        if isinstance(history_length, bool) or not isinstance(history_length, int | np.integer) or history_length < 1:
            raise ValueError(f"`history_length` must be an int >= 1, got {history_length!r}.")
        return cls(
            jnp.ones(batch_shape, jnp.float32),
            jnp.zeros((*batch_shape, history_length), jnp.float32),
        )

    @property
    def scale(self):
        return self._view(0, self._scale)

    @property
    def amax_history(self):
        return self._view(1, self._amax_history)

    def _view(self, i, value):
        view = self._views[i]
        if view is None:
            view = self._views[i] = _leave(value)
        return view

    def __setattr__(self, name, value):
        raise AttributeError("ScalingState is immutable; build a new one instead.")

    def __repr__(self) -> str:
        return f"ScalingState(scale={_short(self._scale)}, amax_history={_short(self._amax_history)})"

    def tree_flatten_with_keys(self):
        return (
            (jtu.GetAttrKey("scale"), self.scale),
            (jtu.GetAttrKey("amax_history"), self.amax_history),
        ), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)

    def _raw(self):
        """The stored values, possibly in the max-accumulating dtype (for fp8ax's ops)."""
        return self._scale, self._amax_history

    def _overwritten_by(self, new: "ScalingState") -> "ScalingState":
        """This state, replaced by `new` wherever `new` holds a real state.

        A layer that a step did not use receives a zero cotangent. A real new scale is
        always > 0, so `new.scale > 0` tells the two apart, per stacked layer.
        """
        old_scale, old_hist = as_f32(self._scale), as_f32(self._amax_history)
        new_scale, new_hist = as_f32(new._scale), as_f32(new._amax_history)
        used = new_scale > 0
        return ScalingState(
            select(used, new_scale, old_scale),
            select(used[..., None], new_hist, old_hist),
        )


# Inside a traced function each flatten of the model reads the state as float32 leaves,
# and each rebuild from traced leaves converts them to the max-accumulating form. Every
# use must fan out from one max-form value (a second conversion of the same leaf would
# sum again), and converting on every flatten costs trace and compile time. So a
# float32 leaf that has been converted remembers the max-form value it became
# (`_SOURCE_OF`), and rebuilding from it gives that value back; a state keeps its leaves
# (`_views`) so flattening it again returns the same ones. A step then traces one
# conversion per state value however often the model is flattened. The table is keyed
# by `id` and its entries go when the leaf is garbage collected.
_SOURCE_OF: dict[int, tuple[weakref.ref, Any]] = {}  # id(float32 leaf) -> (leaf, max value)


def _remember(view, value) -> None:
    key, table = id(view), _SOURCE_OF  # the callback may run at exit, after module globals are cleared
    table[key] = (weakref.ref(view, lambda _: table.pop(key, None)), value)


def _enter(x):
    """`(value, view)`: the value to compute with and its float32 leaf (None: make one
    when asked)."""
    # float32 tracers (the model being rebuilt inside jax.grad / jit / vmap) switch to the
    # max-accumulating representation here, once, before any use can fan them out.
    if isinstance(x, jax.core.Tracer) and x.dtype == np.float32:
        entry = _SOURCE_OF.get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[1], x
        value = to_max(x)
        _remember(x, value)
        return value, x
    if is_max(x):
        return x, None
    return x, x


def _leave(x):
    if not is_max(x):
        return x
    view = to_f32(x)
    if isinstance(view, jax.core.Tracer):
        _remember(view, x)
    return view


def _short(x) -> str:
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        return repr(x)
    if is_max(x):
        dtype = "f32"
    elif dtype == np.float32:
        dtype = "f32"
    return f"{dtype}{list(shape)}"


class OverwriteWithGradient(_haxq.OverwriteWithGradient):
    """Marker base class: the "gradient" of this module's leaves is their new value.

    Subclasses `haliax.quantization.OverwriteWithGradient`, so training code written
    against Haliax's helpers (Levanter's trainer, for one) recognises fp8ax modules too,
    and fp8ax's helpers recognise Haliax's.
    """


def _is_owg(x: Any) -> bool:
    # Haliax's base class: covers fp8ax modules and Haliax's own FP8 ops.
    return isinstance(x, _haxq.OverwriteWithGradient)
