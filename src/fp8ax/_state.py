import weakref
from typing import Any

import haliax.quantization as _haxq
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._boundaries import check_eager_shard_map
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
    # `_leaves`: their float32 leaves where they are safe to hand out again (concrete
    # values), None where every flatten must make a fresh view (see `_enter`).
    __slots__ = ("_scale", "_amax_history", "_leaves")

    def __init__(self, scale: Any, amax_history: Any):
        (s, s_leaf), (h, h_leaf) = _enter(scale), _enter(amax_history)
        object.__setattr__(self, "_scale", s)
        object.__setattr__(self, "_amax_history", h)
        object.__setattr__(self, "_leaves", (s_leaf, h_leaf))

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
        return self._leaf(0, self._scale)

    @property
    def amax_history(self):
        return self._leaf(1, self._amax_history)

    def _leaf(self, i, value):
        leaf = self._leaves[i]
        return _view(value) if leaf is None else leaf

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


# The invariant that makes reuse merge by max (docs/how-it-works.md, "Why the merge holds
# behind every boundary"): inside a trace, every use of a state value fans out from one
# max-form value, and every float32 value that carries the state has exactly one
# consumer. JAX sums the cotangents of a value with several consumers; only for a
# max-form value is that "sum" a max.
#
# - Rebuilding a state from a float32 tracer (what `jax.grad`, `jax.jit`,
#   `jax.checkpoint`, `lax.cond`, `jax.shard_map`, `hax.dot`'s `eqx.filter_jit` ... do
#   with their traced arguments) converts it once: the tracer's one consumer is that
#   conversion. A second rebuild from the same tracer gets the same max-form value back
#   (`_SOURCE_OF`), so the tracer never gets a second conversion.
# - Flattening a traced state makes a fresh float32 view of the max-form value, every
#   time. A view's one consumer is whatever the flatten was for: one boundary (each
#   nested `jit` or `checkpoint` gets a view of its own, and their cotangents meet at the
#   max-form value, by max), or a rebuild, which `_SOURCE_OF` maps straight back to the
#   max-form value (the view is then dead code). Handing out the same float32 leaf twice
#   (a cached view, or the tracer the state was rebuilt from) is what broke the merge
#   behind boundaries: two consumers of one float32 value, summed.
#
# The table is keyed by `id` and its entries go when the float32 tracer is garbage
# collected. A view costs one cheap primitive per state value and flatten; views that
# only feed a rebuild are dead code, which JAX's and XLA's dead-code elimination drop.
_SOURCE_OF: dict[int, tuple[weakref.ref, Any]] = {}  # id(float32 tracer) -> (tracer, max-form value)


def _remember(leaf, value) -> None:
    key, table = id(leaf), _SOURCE_OF  # the callback may run at exit, after module globals are cleared
    table[key] = (weakref.ref(leaf, lambda _: table.pop(key, None)), value)


def _enter(x):
    """`(value, leaf)`: the value to compute with, and the float32 leaf to flatten it to
    (None: a fresh view at every flatten)."""
    if isinstance(x, jax.core.Tracer) and x.dtype == np.float32:
        entry = _SOURCE_OF.get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[1], None  # a view of a max-form value, or a tracer converted before
        check_eager_shard_map()
        value = to_max(x)
        _remember(x, value)
        return value, None
    if is_max(x):
        return x, None
    return x, x


def _view(x):
    """A fresh float32 view of a max-form value (a traced state being flattened)."""
    if not is_max(x):
        return x
    check_eager_shard_map()
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
