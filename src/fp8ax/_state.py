import weakref
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _haliax
from ._boundaries import check_eager_shard_map
from ._formats import select
from ._maxgrad import as_f32, is_max, to_f32, to_max


class AbstractState:
    """Base class of a stateful recipe's per-operand state: a fixed set of named float32
    arrays.

    A stateful recipe (see [`fp8ax.AbstractScalingRecipe`][]) returns one of these from
    `init_state` for each operand of a GEMM. fp8ax never reads the arrays' meaning: the
    GEMM pipeline hands the recipe its state as a tuple of arrays in `fields` order, and
    serving, `scaling_stats`, `plot_amax_history`, `calibrate` and `apply_updates` ask the
    recipe (or the state's `written`) about it. What a subclass declares:

    - `fields`: the names of its arrays, which become read-only attributes and the pytree
      keys, in order;
    - `entry_ndims`: for each field, how many trailing dimensions one layer's array has
      (the rest are stacked-layer dimensions, `batch_shape`);
    - `written(self)`: per stacked layer, whether this value is a state a call wrote, as
      opposed to the zero cotangent a layer a step did not use receives. `apply_updates`
      keeps the old state wherever it is False.

    Every array is a float32 pytree leaf: `eqx.filter_grad` differentiates it,
    `eqx.tree_serialise_leaves` saves it, and its "gradient" is its new value (see
    [`fp8ax.apply_updates`][]). A recipe's new state must be monotone non-decreasing in
    what a call observed, because several uses of a layer in one step are merged with an
    elementwise max.

    !!! Note

        Inside a traced function (`jax.grad`, `jax.jit`, ...) a state holds its values in a
        float32 dtype whose cotangents accumulate with `max` instead of `+`. That is how a
        layer used several times in one step (tied weights, `lax.scan`, `vmap`) gets the
        state of one merged observation instead of a sum. The attributes and the leaves are
        always float32. See the "How the FP8 state works" page of the docs.
    """

    fields: ClassVar[tuple[str, ...]] = ()
    entry_ndims: ClassVar[tuple[int, ...]] = ()

    # `_values`: the arrays, in the max-accumulating form while traced; `_leaves`: their
    # float32 leaves where they are safe to hand out again (concrete values), None where
    # every flatten must make a fresh view (see `_enter`).
    __slots__ = ("_values", "_leaves")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(cls.fields, tuple) or not all(isinstance(f, str) and f.isidentifier() for f in cls.fields):
            raise TypeError(f"`{cls.__name__}.fields` must be a tuple of identifiers, got {cls.fields!r}.")
        if not isinstance(cls.entry_ndims, tuple) or len(cls.entry_ndims) != len(cls.fields):
            raise TypeError(
                f"`{cls.__name__}.entry_ndims` must give one int per field ({len(cls.fields)}), got {cls.entry_ndims!r}."
            )
        for i, name in enumerate(cls.fields):
            if name not in cls.__dict__:
                setattr(cls, name, property(lambda self, i=i: self._leaf(i), doc=f"The `{name}` array (float32)."))
        keys = tuple(jtu.GetAttrKey(name) for name in cls.fields)
        jtu.register_pytree_with_keys(
            cls,
            lambda s: (tuple(zip(keys, (s._leaf(i) for i in range(len(keys))))), None),
            lambda aux, children: cls(*children),
            lambda s: (tuple(s._leaf(i) for i in range(len(keys))), None),
        )

    def __init__(self, *values: Any):
        if not self.fields:
            raise TypeError("`fp8ax.AbstractState` is a base class: subclass it with `fields` and `entry_ndims`.")
        if len(values) != len(self.fields):
            raise TypeError(
                f"`{type(self).__name__}` takes {len(self.fields)} arrays {self.fields}, got {len(values)}."
            )
        entered = [_enter(v) for v in values]
        object.__setattr__(self, "_values", tuple(v for v, _ in entered))
        object.__setattr__(self, "_leaves", tuple(leaf for _, leaf in entered))

    def _leaf(self, i):
        leaf = self._leaves[i]
        return _view(self._values[i]) if leaf is None else leaf

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The stacked-layer dimensions (`()` for one layer)."""
        shape = tuple(np.shape(self._values[0]))
        return shape[: len(shape) - self.entry_ndims[0]]

    def written(self) -> Any:
        """Per stacked layer (a bool array of `batch_shape`): whether this value is a state
        a call wrote, rather than the zero cotangent of a layer a step did not use."""
        raise NotImplementedError(f"`{type(self).__name__}` must define `written`.")

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable; build a new one instead.")

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={_short(v)}" for name, v in zip(self.fields, self._values))
        return f"{type(self).__name__}({inner})"

    def _raw(self) -> tuple:
        """The stored values, possibly in the max-accumulating dtype (for fp8ax's ops)."""
        return self._values

    def _overwritten_by(self, new: "AbstractState") -> "AbstractState":
        """This state, replaced by `new` wherever `new` holds a written state (per stacked
        layer; see `written`)."""
        if type(new) is not type(self):
            raise TypeError(f"Cannot overwrite a {type(self).__name__} with a {type(new).__name__}.")
        used = new.written()
        out = []
        for old_v, new_v, extra in zip(self._values, new._values, self.entry_ndims):
            mask = jnp.reshape(used, (*jnp.shape(used), *(1,) * extra))
            out.append(select(mask, as_f32(new_v), as_f32(old_v)))
        return type(self)(*out)


class ScalingState(AbstractState):
    """Delayed-scaling state of one operand: a scale and an amax history.

    - `scale`: float32, shape `()` (or `(*batch,)` for stacked layers). The
      *dequantisation* scale: a tensor `x` is quantised as `x / scale` and recovered as
      `q * scale` (the Flax/Haliax convention; TransformerEngine's `scale_inv`).
    - `amax_history`: float32, shape `(history_length,)` (or `(*batch, history_length)`),
      the newest amax at index 0. An entry of 0 means "nothing recorded".

    The state [`fp8ax.DelayedScaling`][] owns (an [`fp8ax.AbstractState`][]). Both arrays
    are ordinary float32 pytree leaves: `eqx.filter_grad` differentiates them,
    `eqx.tree_serialise_leaves` saves them, and their "gradient" is the new state (see
    [`fp8ax.apply_updates`][]). Inside a trace they accumulate cotangents by max (see
    [`fp8ax.AbstractState`][]).
    """

    fields = ("scale", "amax_history")
    entry_ndims = (0, 1)
    __slots__ = ()

    def __init__(self, scale: Any, amax_history: Any):
        super().__init__(scale, amax_history)

    @classmethod
    def init(cls, history_length: int, batch_shape: tuple[int, ...] = ()) -> "ScalingState":
        """Fresh state: scale 1, empty (all-zero) history."""
        if isinstance(history_length, bool) or not isinstance(history_length, int | np.integer) or history_length < 1:
            raise ValueError(f"`history_length` must be an int >= 1, got {history_length!r}.")
        return cls(
            jnp.ones(batch_shape, jnp.float32),
            jnp.zeros((*batch_shape, history_length), jnp.float32),
        )

    def written(self):
        # A call that observed nothing reports scale 0, and so does the zero cotangent of
        # an unused layer; a real new scale is always > 0.
        return as_f32(self._values[0]) > 0


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


# Raised wherever a state's values are read and found negative or non-finite.
CORRUPT_STATE = (
    "fp8ax: an FP8 scaling state (scale, amax history) holds negative or non-finite values: "
    "it went through an optimiser as if it were a gradient and was added to by "
    "`eqx.apply_updates`. The gradient of an FP8 layer's state is its new value, which "
    "must replace the old one: split it off with "
    "`overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)`, give the optimiser "
    "`grads`, and apply both with `model = fp8ax.apply_updates(model, updates, overwrite)`."
)


@_haliax.overwrite_with_gradient_class
class OverwriteWithGradient(eqx.Module):
    """Marker base class: the "gradient" of this module's leaves is their new value.

    Once the program has imported Haliax, this is also a (virtual) subclass of
    `haliax.quantization.OverwriteWithGradient`, so training code written against
    Haliax's helpers (Levanter's trainer, for one) recognises fp8ax modules too, and
    fp8ax's helpers recognise Haliax's.
    """

    def __check_init__(self):
        _haliax.loaded()  # a module built after `import haliax` is one Haliax's helpers know


def is_owg(x: Any) -> bool:
    # fp8ax's modules, and Haliax's own FP8 and int8 ops.
    return isinstance(x, OverwriteWithGradient) or _haliax.is_overwrite_with_gradient(x)
