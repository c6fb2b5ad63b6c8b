import functools
import weakref
from typing import Any, ClassVar, Self

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _haliax
from ._boundaries import check_eager_shard_map
from ._formats import select
from ._maxgrad import as_f32, is_max, to_f32, to_max, watch_use


class AbstractState:
    """Base class of a stateful recipe's per-operand state: a fixed set of named float32
    arrays.

    A stateful recipe (see [`fp8ax.AbstractStatefulRecipe`][]) returns one of these from
    `init_state`: an [`fp8ax.Fp8DotGeneral`][] holds one for its three operands, with a
    role axis of size 3 as the last of its stacked dimensions (`batch_shape`). fp8ax never reads the arrays' meaning: the
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
    # every flatten must make a fresh view (see `_enter`). Both are read through
    # properties: a state rebuilt from its one kept child stores neither until they are
    # read (`_rebuild`). `_kids`: the children the next flatten returns, None until made;
    # that one child alone, not in a tuple, for such a state.
    __slots__ = ("_vals", "_lvs", "_axes", "_label", "_kids")

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
            lambda s: (tuple(zip(keys, s._children())), s._label),
            cls._rebuild,
            lambda s: (s._children(), s._label),
        )

    def __init__(self, *values: Any):
        if not self.fields:
            raise TypeError("`fp8ax.AbstractState` is a base class: subclass it with `fields` and `entry_ndims`.")
        if len(values) != len(self.fields):
            raise TypeError(
                f"`{type(self).__name__}` takes {len(self.fields)} arrays {self.fields}, got {len(values)}."
            )
        self._set(values, None)

    def _set(self, values, label: "LayerName | None", axes: Any = None) -> None:
        entered = [_enter(v, label) for v in values]
        self._assign(tuple([v for v, _ in entered]), tuple([leaf for _, leaf in entered]), axes, label, None)

    def _assign(self, values: Any, leaves: Any, axes: Any, label: "LayerName | None", kids: Any) -> None:
        # Through the slots' setters (what `object.__setattr__` would find): every unflatten
        # of a model runs this for each state, two or three times per call of a jitted step.
        _VALUES(self, values)
        _LEAVES(self, leaves)
        _AXES(self, axes)
        _LABEL(self, label)
        _KIDS(self, kids)

    @property
    def _values(self) -> tuple:
        values = self._vals
        return self._values_from_kid() if values is _FROM_KIDS else values

    @property
    def _leaves(self) -> tuple:
        leaves = self._lvs
        return self._values_from_kid() if leaves is _FROM_KIDS else leaves

    def _values_from_kid(self) -> tuple:
        """The values (and leaves) of a state rebuilt from its one kept child, read from it
        and stored when first needed."""
        values = (self._kids.array,)
        _VALUES(self, values)
        _LEAVES(self, values)
        return values

    def _leaf(self, i):
        leaf = self._leaves[i]
        return _view(self._values[i], self._label) if leaf is None else leaf

    # Named axes. The state of a Haliax layer flattens to `haliax.NamedArray`s: its
    # stacked-layer dimensions carry the layer's own axis names (`layer` inside
    # `haliax.nn.Stacked`), and each field's own dimensions are named `fp8ax_<field>`.
    # Haliax's tools and the code written with them then treat the state as they treat
    # the weights: `hax.tree_util.tree_map(lambda a: a["layer", i], stacked)` slices it
    # (Levanter's generation), a batch reshape that looks for the batch axis leaves it
    # alone (Levanter's gradient accumulation), `hax.shard` and axis mappings see names.
    #
    # `_axes` is None for an unnamed state (Equinox models), else one entry per field:
    # its `(name, size)` pairs, or None for a field whose child is not a NamedArray (a
    # filter such as `eqx.partition(..., is_leaf=is_named_array)` put None in its place).
    # The names live in the children only: the node's static data stays None, so a state
    # and its filtered or sliced copies have the same tree structure, as Haliax's own
    # layers do (`haliax.nn.Stacked`'s scan combines a sliced copy with a filtered one).

    def _axes_of(self) -> Any:
        """`_axes`; read from the kept children for a state rebuilt from them (`_rebuild`),
        once, when first needed."""
        if self._axes is _FROM_KIDS:
            object.__setattr__(self, "_axes", tuple(_haliax.axis_pairs(kid) for kid in self._children()))
        return self._axes

    def _children(self) -> tuple:
        kids = self._kids
        if kids is not None:
            return kids if type(kids) is tuple else (kids,)
        leaves = tuple(self._leaf(i) for i in range(len(self.fields)))
        kids = leaves
        axes = self._axes_of()
        if axes is not None:
            kids = tuple(v if ax is None else _haliax.named(v, _fit(ax, v)) for v, ax in zip(leaves, axes))
        if all(leaf is not None for leaf in self._leaves):
            # Concrete values (no view to make afresh): the same children every flatten,
            # as a training loop flattens the model at every call of its jitted step.
            object.__setattr__(self, "_kids", kids)
        return kids

    @classmethod
    def _rebuild(cls, label, children) -> Self:
        # The node's static data is the layer's name (a `LayerName`, see `_labelled`), or None.
        if len(children) == 1 and type(children[0]) is _haliax.MADE_STATE_NAMED_CLASS:
            # Every built-in state: one child, kept as the branch below keeps several,
            # without the calls (a training loop rebuilds each state two or three times
            # per step; bench/README.md, run N). The child is kept alone, and the values
            # are read from it when needed (`_values`): each object a rebuild keeps alive
            # is one more for Python's collector to walk (bench/README.md, run O).
            kid = children[0]
            if _kept_value(kid.array):
                state = object.__new__(cls)
                state._assign(_FROM_KIDS, _FROM_KIDS, _FROM_KIDS, label, kid)
                return state
        kept = _kept_children(children, len(cls.fields))
        if kept is not None:
            # What a training loop's model holds, step after step: the children this
            # class flattens to, with concrete float32 arrays. They are kept as they
            # are, as the values and as the children of the next flatten.
            # (Their axes are read from them when needed: `_axes_of`.)
            state = object.__new__(cls)
            state._assign(kept, kept, _FROM_KIDS, label, tuple(children))
            return state
        named_array = _haliax.named_array_class()
        if named_array is None:
            return cls._make(children, None, label)
        values, axes, named = [], [], False
        for child in children:
            if isinstance(child, named_array):
                pairs = _haliax.axis_pairs(child)
                child = child.array
                axes.append(_fit(pairs, child))
                named = True
            else:
                axes.append(None)
            values.append(child)
        return cls._make(values, tuple(axes), label) if named else cls._make(children, None, label)

    @classmethod
    def _make(cls, values, axes, label) -> Self:
        # Every field is given (a pytree's children, or an op's new state): a subclass's
        # `__init__`, which may take other arguments, has nothing to add.
        if len(values) != len(cls.fields):
            raise TypeError(f"`{cls.__name__}` holds {len(cls.fields)} arrays {cls.fields}, got {len(values)}.")
        state = object.__new__(cls)
        state._set(values, label, axes)
        return state

    def _labelled(self, label: str) -> Self:
        """This state, named `label` (its layer's path, set by the conversion):
        differentiating a step that never calls the layer warns with it."""
        return type(self)._make(self._values, self._axes_of(), LayerName(label))

    @property
    def _name(self) -> str | None:
        """The name of the state's layer (see `_labelled`), or None."""
        return None if self._label is None else self._label.name

    def _named(self, batch_axes: tuple[tuple[str, int], ...]) -> Self:
        """This state with named axes: `batch_axes` (`(name, size)` pairs) for its stacked
        dimensions, `fp8ax_<field>` for each field's own."""
        axes = []
        for name, value, extra in zip(self.fields, self._values, self.entry_ndims):
            own = np.shape(value)[len(np.shape(value)) - extra :] if extra else ()
            suffix = [f"fp8ax_{name}" if extra == 1 else f"fp8ax_{name}_{j}" for j in range(extra)]
            axes.append(tuple(batch_axes) + tuple(zip(suffix, own)))
        return self._with_values(self._values, tuple(axes))

    def _with_values(self, values, axes: Any = ...) -> Self:
        """A state of this type holding `values`, with this state's axis names and label."""
        return type(self)._make(values, self._axes_of() if axes is ... else axes, self._label)

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

    def __reduce__(self):
        # Pickling (Ray, `copy.deepcopy`): the values as float32, the axis names and the
        # label; the immutable state is rebuilt through `_make`, not attribute by attribute.
        values = tuple(as_f32(v) for v in self._values)
        return type(self)._make, (values, self._axes_of(), self._label)

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
        if any(isinstance(v, _TRACER) for v in (*self._values, *new._values)):
            # Inside a traced step, one `jit` per state (traced once per state type and
            # shapes): the step's own trace records one equation for it instead of a dozen
            # (the values' reads, `written`, the broadcast and the `select`). A `jit`
            # trace keeps every equation it records until it ends, and on a deep model
            # those made Python's collector run a full collection during the step's first
            # trace (bench/README.md, run J).
            # (It returns the values in the max-accumulating form, as they enter a state:
            # no conversion is recorded in the step's trace either.)
            return self._with_values(_overwritten_jit(type(self), self._values, new._values))
        return self._with_values(_overwritten(type(self), self._values, new._values))


def _overwritten(cls: type[AbstractState], old: tuple, new: tuple) -> list:
    """The values of `AbstractState._overwritten_by`: `new`'s where its state (a `cls`) is
    written, `old`'s elsewhere, as float32."""
    used = cls._make(new, None, None).written()
    out = []
    for old_v, new_v in zip(old, new):
        new_v, old_v = as_f32(new_v), as_f32(old_v)
        # (`lax` rather than `jnp`: `apply_updates` traces this for every state.)
        mask = lax.broadcast_in_dim(used, np.shape(new_v), tuple(range(np.ndim(used))))
        out.append(select(mask, new_v, old_v))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _overwritten_jit(cls: type[AbstractState], old: tuple, new: tuple) -> list:
    return [to_max(v) for v in _overwritten(cls, old, new)]


class LayerName:
    """The name of a state's layer, its pytree node's static data: equal to every other
    `LayerName`, so it does not enter a pytree's structure.

    Layers alike (the same settings and shapes) then flatten to the same tree structure,
    and a `jit` traced for one is reused from JAX's cache for the others: Haliax's
    `hax.dot` runs each layer inside an `eqx.filter_jit` of its own, and a name that
    compared as itself traced and lowered that `jit` once per layer (on a 48-layer stack,
    a fifth of the step's trace). The name serves the warning about an unused layer
    (`_maxgrad.watch_use`), which does not need the layer's own trace of that `jit`. Two
    models that differ only in their layers' names have the same structure, as two models
    of the same architecture do."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)

    def __eq__(self, other) -> bool:
        return type(other) is LayerName

    def __hash__(self) -> int:
        return hash(LayerName)

    def __setattr__(self, name, value):
        raise AttributeError("LayerName is immutable.")

    def __reduce__(self):
        return LayerName, (self.name,)

    def __repr__(self) -> str:
        return repr(self.name)


# The slots' setters (what `object.__setattr__` finds for each), for `_rebuild`.
_VALUES, _LEAVES, _AXES, _LABEL, _KIDS = (
    getattr(AbstractState, name).__set__ for name in ("_vals", "_lvs", "_axes", "_label", "_kids")
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
# The table is kept by the trace the float32 tracer belongs to (`_sources`), keyed by
# `id`, and goes with that trace. A table of the whole process leaked every trace: its
# entries hold the max-form value, whose trace holds the float32 tracer, so the weak
# reference to the tracer never died (bench/state_cost.py's 16-block stack kept some
# 29,000 objects per trace of its step, and Python's collector made full passes over
# them). A view costs one cheap primitive per state value and flatten; views that only
# feed a rebuild are dead code, which JAX's and XLA's dead-code elimination drop.
_SOURCE_OF: dict[int, tuple[weakref.ref, Any]] = {}  # for a trace that keeps no table (see `_sources`)


def _sources(tracer) -> dict[int, tuple[weakref.ref, Any]]:
    """The table of `tracer`'s trace: id(float32 tracer) -> (weak reference to it, its
    max-form value), kept where it dies with the trace: in the trace's attributes (JVP,
    linearize, batching traces), else in those of the frame a `jit`-style trace records
    into (its table of constants, the one object of the frame that takes attributes),
    else its tag's. A trace that has none of these uses the process's table."""
    trace = getattr(tracer, "_trace", None)
    holder = getattr(trace, "__dict__", None)
    if holder is None:
        frame = getattr(trace, "frame", None)
        holder = getattr(getattr(frame, "constid_to_tracer", None), "__dict__", None)
        if holder is None:
            holder = getattr(getattr(trace, "tag", None), "__dict__", None)
            if holder is None:
                return _SOURCE_OF
    table = holder.get("_fp8ax_sources")
    if table is None:
        table = holder["_fp8ax_sources"] = {}
    return table


def _remember(leaf, value) -> None:
    table = _sources(leaf)
    if table is _SOURCE_OF:
        key = id(leaf)  # (the callback may run at exit, after module globals are cleared)
        table[key] = (weakref.ref(leaf, lambda _: table.pop(key, None)), value)
    else:
        # (A dead tracer's entry stays until its trace goes; its id, reused, fails the
        # identity check in `_enter`.)
        table[id(leaf)] = (weakref.ref(leaf), value)


def _kept_children(children, count: int) -> tuple | None:
    """The values of a state whose `count` children are all what `_children` builds from
    concrete float32 values or placeholders (`_haliax.named`'s class, holding a float32
    array that is no tracer, or None: what `_enter` passes through unchanged); None
    otherwise."""
    kind = _haliax.MADE_STATE_NAMED_CLASS  # (None before any state was named: no Haliax import)
    if kind is None or len(children) != count:
        return None
    values = tuple([child.array for child in children if type(child) is kind])
    return values if len(values) == count and all(map(_kept_value, values)) else None


def _kept_value(value) -> bool:
    # A concrete float32 array, or None: a filter's placeholder, as in the static half of
    # `eqx.partition`, which `eqx.filter_jit` flattens and rebuilds on every call.
    dtype = getattr(value, "dtype", None)
    return value is None or ((dtype is _F32 or dtype == _F32) and not isinstance(value, _TRACER))


_TRACER = jax.core.Tracer


# `_axes` of a state rebuilt from its kept children (and `_values` and `_leaves` of one
# rebuilt from its one kept child): read from them when first needed.
_FROM_KIDS = object()


# The tracers `jax.grad` (`jax.vjp`, `jax.linearize`) makes of the inputs it
# differentiates: a state rebuilt from one of them is watched for use (`watch_use`).
# Inside `lax.cond`, `lax.scan` and `jax.checkpoint` bodies the rebuild sees the body's own
# tracers instead, so a layer used in one branch only is not reported by the other.
_DIFFERENTIATED = ("JVPTracer", "LinearizeTracer")


def _differentiated(x) -> bool:
    return type(x).__name__ in _DIFFERENTIATED


def _enter(x, label: "LayerName | None" = None):
    """`(value, leaf)`: the value to compute with, and the float32 leaf to flatten it to
    (None: a fresh view at every flatten)."""
    # Every unflatten of a model goes through here, once per state value: Equinox's
    # `filter_jit` unflattens the model three times per call (bench/state_cost.py's
    # `host_us`), so the common cases are tested first, by dtype identity.
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return x, x  # None, or a filter's placeholder
    if dtype == _BF16 and isinstance(x, jax.Array | np.ndarray):
        # A cast of the whole model to bfloat16 (Levanter's and jmp's mixed precision
        # cast every floating leaf): the state computes in float32 again. bfloat16 has
        # float32's exponent range, so every scale and amax survives the round trip, to
        # 8 significant bits; the new state goes back through the cast's transpose,
        # rounded to bfloat16 the same way (docs/state.md, "Mixed precision").
        x = lax.convert_element_type(x, np.float32)
        dtype = _F32
    if dtype == _F32:
        if not isinstance(x, jax.core.Tracer):
            return x, x
        entry = _sources(x).get(id(x))
        if entry is not None and entry[0]() is x:
            return entry[1], None  # a view of a max-form value, or a tracer converted before
        check_eager_shard_map()
        value = to_max(watch_use(x, label.name) if label is not None and _differentiated(x) else x)
        _remember(x, value)
        return value, None
    if is_max(x):
        return x, None
    return x, x


_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)


def _view(x, label: "LayerName | None" = None):
    """A fresh float32 view of a max-form value (a traced state being flattened), named
    after the state's layer where the value is differentiated (see `to_f32`)."""
    if not is_max(x):
        return x
    check_eager_shard_map()
    view = to_f32(x, label.name if label is not None and _differentiated(x) else None)
    if isinstance(view, jax.core.Tracer):
        _remember(view, x)
    return view


def _fit(axes: tuple, value: Any) -> tuple:
    """`axes` ((name, size) pairs) for `value`: sizes from its shape where it has one;
    where a transformation took leading (stacked) dimensions away (`vmap`, `scan`, an
    index), the trailing names."""
    shape = getattr(value, "shape", None)
    if shape is None:
        return tuple(axes)
    return _fit_shape(tuple(axes), tuple(shape))


@functools.lru_cache(maxsize=4096)
def _fit_shape(axes: tuple, shape: tuple) -> tuple:
    names = [n for n, _ in axes]
    if len(shape) < len(names):
        names = names[len(names) - len(shape) :]
    elif len(shape) > len(names):
        names = [f"fp8ax_dim_{j}" for j in range(len(shape) - len(names))] + names
    return tuple(zip(names, shape))


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
    "it went through an optimizer as if it were a gradient and was added to by "
    "`eqx.apply_updates`. The gradient of an FP8 layer's state is its new value, which "
    "must replace the old one: split it off with "
    "`overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)`, give the optimizer "
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

    def accumulate(self, other):
        """Merges this module's state "gradient" with another microbatch's, as
        [`fp8ax.accumulate_gradients`][] does (state by `max`). Newer marin-haliax
        (`CustomGradientAccumulation`, 0.2.227) calls it from
        `haliax.quantization.accumulate_gradients`, first on an all-zero `self`, which is
        the identity of `max`."""
        return jtu.tree_map(max_merge, self, other)


def max_merge(a, g):
    """Merges two uses' (or microbatches') new state elementwise with `max`."""
    if eqx.is_array(a):
        return jnp.maximum(a, g)
    return a


def is_owg(x: Any) -> bool:
    # fp8ax's modules, and Haliax's own FP8 and int8 ops.
    return isinstance(x, OverwriteWithGradient) or _haliax.is_overwrite_with_gradient(x)
