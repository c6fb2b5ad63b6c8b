# Loading an `eqx.tree_serialise_leaves` checkpoint with a check of its kind first.
#
# A checkpoint is a plain sequence of .npy records, one per array leaf, without names.
# Loaded into a template of another kind (plain / FP8 training / serving), Equinox fails
# at the first leaf whose shape or dtype differs, with a message that names a leaf deep
# in a layer and says nothing about FP8; records left over at the end are ignored. Here
# the records' shapes and dtypes are read first and compared with the template's; at the
# first difference the layer is found, both kinds are told apart by the records of that
# layer, and the error says what to call.

import dataclasses
import pathlib
from typing import BinaryIO, TypeVar, cast

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from . import _haliax
from ._model import Fp8DotGeneral, fp8_op, is_linear, path_str
from ._scaling_state import ScalingState
from ._serving import is_serving_layer
from ._state import AbstractState

T = TypeVar("T")


def _is_layer(x) -> bool:
    return is_linear(x) or is_serving_layer(x)


def _records(f: BinaryIO) -> list[tuple[tuple[int, ...], str]]:
    """`(shape, descr)` of every .npy record in `f` from its current position."""
    out = []
    while True:
        start = f.tell()
        if not f.read(1):
            break
        f.seek(start)
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as e:
            raise ValueError(f"The file is not an `eqx.tree_serialise_leaves` checkpoint (record {len(out)}: {e}).")
        del fortran
        f.seek(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
        out.append((tuple(shape), _descr(dtype)))
    return out


def _descr(dtype: np.dtype) -> str:
    # numpy writes bfloat16 and the 8-bit floats as raw bytes ("|V2", "|V1").
    descr = cast(str, np.lib.format.dtype_to_descr(dtype))  # (a list only for a structured dtype: no array leaf's)
    return "V" + descr[2:] if descr[:2] in ("<V", "|V", ">V") else descr


def _writes_record(x) -> bool:
    # What `eqx.default_serialise_filter_spec` saves (and its deserialiser reads).
    return isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct) or eqx.is_array_like(x)


def _signature(x) -> tuple[tuple[int, ...], str | None]:
    if isinstance(x, bool | int | float | complex):
        return (), None  # a Python scalar: its dtype on disk depends on the x64 flag
    return tuple(np.shape(x)), _descr(np.dtype(x.dtype))


def _show(sig) -> str:
    shape, descr = sig
    names = {"V2": "bfloat16", "V1": "an 8-bit float"}
    dtype = names.get(descr) or (np.dtype(descr).name if descr else "a Python scalar")
    return f"{dtype}{list(shape)}"


def _kind_of_layer(layer) -> str:
    if is_serving_layer(layer):
        return "serving"
    op = fp8_op(layer)
    if op is not None:
        return "fp8" if op.state is not None else "fp8-stateless"
    return "plain"


def _state_ndims(layer) -> tuple:
    """`(entry_ndims,)` of the template layer's state type, or `()` if it has none."""
    op = fp8_op(layer)  # None for plain and serving layers
    if op is not None and op.state is not None:  # an "fp8" layer (`_kind_of_layer`)
        state = op.state if isinstance(op.state, AbstractState) else op.state[0]
        return (type(state).entry_ndims,)
    return ()


_DESCRIBE = {
    "plain": "a plain layer (high-precision weight, no FP8 state)",
    "fp8": "an FP8 training layer (high-precision weight and its recipe's scaling state)",
    "fp8-stateless": "an FP8 training layer with a stateless recipe (its arrays are a plain layer's)",
    "serving": "a serving layer (`fp8ax.to_serving`: low-precision weight and scales)",
}


def _kind_of_records(records, start: int, weight_shape, n_own: int, layouts=()) -> str | None:
    """The kind of the layer whose records begin at `start` in the checkpoint, judged
    from the records (`n_own`: the weight and bias leaves every kind has). A state is
    recognised by the per-layer dimensions of its arrays (`entry_ndims` of a recipe's
    state type): those in `layouts` (the template's), or delayed scaling's."""
    if start >= len(records):
        return None
    shape, descr = records[start]
    if shape != tuple(weight_shape):
        return None
    if descr in ("|u1", "|i1"):
        return "serving"
    for entry_ndims in (*layouts, ScalingState.entry_ndims):
        if _holds_states(records[start + n_own :], weight_shape, entry_ndims):
            return "fp8"
    return "plain"


def _holds_states(records, weight_shape, entry_ndims) -> bool:
    """Whether `records` begin with the float32 arrays of an FP8 layer's state, of a
    recipe whose state arrays have `entry_ndims` per-layer dimensions: one state with a
    role axis of size 3 before them (`Fp8DotGeneral`'s; for delayed scaling one array of
    batch + (3, H + 2)), or three states one after the other (`Fp8RaggedDot`'s, and every
    layer's before 2026-12-08: batch + (H + 2,), three times). The stacked dimensions of
    the weight come first; a state may have one more, the weight's next one: a grouped
    GEMM's state per expert (`Fp8Config.per_expert_weights`)."""
    k = len(entry_ndims)
    one = [
        (shape[: len(shape) - e - 1] + shape[len(shape) - e :], d) for (shape, d), e in zip(records[:k], entry_ndims)
    ]
    if len(one) == k and all(
        len(shape) > e and shape[len(shape) - e - 1] == 3 for (shape, _), e in zip(records[:k], entry_ndims)
    ):
        if _states_fit(one, weight_shape, entry_ndims):
            return True
    return _states_fit(records[: 3 * k], weight_shape, entry_ndims, 3 * k)


def _states_fit(after, weight_shape, entry_ndims, count: int | None = None) -> bool:
    """Whether `after` are `count` float32 arrays (default: one per field) of states with
    `entry_ndims` own dimensions and the weight's stacked dimensions in front."""
    k = len(entry_ndims)
    if len(after) < (count or k) or not all(d == "<f4" for _, d in after):
        return False
    n_batch = len(after[0][0]) - entry_ndims[0]
    if n_batch < 0:
        return False
    weight_shape = tuple(weight_shape)
    for i, (shape, _) in enumerate(after):
        lead = len(shape) - entry_ndims[i % k]
        if lead not in (n_batch, n_batch + 1) or lead > len(weight_shape) - 2 or shape[:lead] != weight_shape[:lead]:
            return False
    return True


def _advice(like_kind: str, ckpt_kind: str | None) -> str:
    like_kind = "plain" if like_kind == "fp8-stateless" else like_kind
    if ckpt_kind is None or ckpt_kind == like_kind:
        return (
            "The layer is of the same kind in both but its arrays differ: a different model, dtype (a model cast "
            "with `fp8ax.cast_floating`) or FP8 config (recipe, `history_length`, `targets`). Build `like` exactly "
            "as the saved model was built."
        )
    if like_kind == "fp8" and ckpt_kind == "plain":
        return (
            "Load it into the plain template and convert after: `fp8ax.fp8_linear_layers("
            "fp8ax.tree_deserialise_leaves(path, fp8ax.strip_fp8(like)), config)`."
        )
    if like_kind == "plain" and ckpt_kind == "fp8":
        return (
            "It was saved from a model converted by `fp8ax.fp8_linear_layers`: build the template the same way, "
            "`fp8ax.fp8_linear_layers(like, config)` with the config it was trained with (`fp8ax.strip_fp8` of the "
            "loaded model gives the plain model)."
        )
    if ckpt_kind == "serving":
        return (
            "Load it into `fp8ax.serving_template(fp8ax.fp8_linear_layers(plain_model, config))`, with the config "
            "the model was trained with. A serving checkpoint cannot become a training model again: the float "
            "weights were not kept."
        )
    return (
        "A serving model is made from its training model: load the checkpoint into that (the plain model, or "
        "`fp8ax.fp8_linear_layers(model, config)`) and convert it with `fp8ax.to_serving` (a plain model: "
        "`fp8ax.fp8_linear_layers`, `fp8ax.calibrate`, then `fp8ax.to_serving`)."
    )


def _own_records(layer) -> int:
    """How many records a layer's own arrays write before its op's: its fields that are
    arrays (a weight, a bias, a gain), of any layer kind; the op (FP8 or serving) and its
    state come after them."""
    n = 0
    for f in dataclasses.fields(layer) if dataclasses.is_dataclass(layer) else ():
        v = getattr(layer, f.name, None)
        v = getattr(v, "array", None) if _haliax.is_named(v) else v
        n += v is not None and not isinstance(v, bool | int | float) and _writes_record(v)
    return n


def _weight_shape(layer) -> tuple[int, ...]:
    w = layer.weight
    return tuple(w.array.shape) if _haliax.is_named(w) else tuple(np.shape(w))


def check_checkpoint(path_or_file, like) -> None:
    """Raises a `ValueError` if the checkpoint at `path_or_file` does not fit `like`
    (see [`fp8ax.tree_deserialise_leaves`][])."""
    records = _read(path_or_file, _records)
    leaves = [(p, x) for p, x in jtu.tree_flatten_with_path(like)[0] if _writes_record(x)]
    layers = []  # (path, layer, index of its first record-writing leaf, index after its last)
    for lp, lx in jtu.tree_flatten_with_path(like, is_leaf=_is_layer)[0]:
        if _is_layer(lx):
            own = [j for j, (p, _) in enumerate(leaves) if tuple(p[: len(lp)]) == tuple(lp)]
            if own:
                layers.append((lp, lx, own[0], own[-1] + 1))
    for i, (path, leaf) in enumerate(leaves):
        want = _signature(leaf)
        got = records[i] if i < len(records) else None
        if got is not None and got[0] == want[0] and (want[1] is None or got[1] == want[1]):
            continue
        found = "nothing (the checkpoint ends there)" if got is None else _show(got)
        where = f"leaf {i} (`{path_str(path)}`) of `like` is {_show(want)}, but the checkpoint holds {found}"
        # The layer the leaf is in, and the layer before it: its records all matched, but
        # the checkpoint may hold more of them (FP8 state) where `like`'s next leaf is.
        current = [entry for entry in layers if entry[2] <= i < entry[3]]
        before = [entry for entry in layers if entry[3] <= i][-1:]
        candidates = (before if not current or current[0][2] == i else []) + current
        if not candidates:
            raise ValueError(f"The checkpoint does not fit `like`: {where}. It was saved from another model.")
        for lp, lx, first, _ in candidates:
            like_kind = _kind_of_layer(lx)
            n_own = _own_records(lx)
            ckpt_kind = _kind_of_records(records, first, _weight_shape(lx), n_own, _state_ndims(lx))
            if ckpt_kind is not None and ckpt_kind != like_kind.replace("-stateless", ""):
                break
        else:
            lp, lx, first, _ = candidates[-1]
            like_kind, ckpt_kind = _kind_of_layer(lx), None
        told = f" The checkpoint holds {_DESCRIBE[ckpt_kind]} there." if ckpt_kind else ""
        raise ValueError(
            f"The checkpoint does not fit `like` at layer `{path_str(lp)}`: `like` has {_DESCRIBE[like_kind]} "
            f"there.{told} {_advice(like_kind, ckpt_kind)} (First difference: {where}.)"
        )
    if len(records) > len(leaves):
        raise ValueError(
            f"The checkpoint holds {len(records)} arrays but `like` has {len(leaves)}: all of `like` matched, "
            f"and {len(records) - len(leaves)} more follow (the next is {_show(records[len(leaves)])}). It was saved "
            "from a bigger tree, e.g. `(model, opt_state)`, or from a model with FP8 state after its last layer "
            "of `like`: load it into a `like` of the same structure."
        )


def _fits(records, like) -> bool:
    """Whether the records are, one for one, those `like` writes."""
    leaves = [x for x in jtu.tree_leaves(like) if _writes_record(x)]
    if len(records) != len(leaves):
        return False
    for got, leaf in zip(records, leaves):
        want = _signature(leaf)
        if got[0] != want[0] or (want[1] is not None and got[1] != want[1]):
            return False
    return True


def _read(path_or_file, fn):
    if isinstance(path_or_file, str | pathlib.Path):
        path = pathlib.Path(path_or_file)
        if path.suffix == "":
            path = path.with_suffix(".eqx")  # as `eqx.tree_serialise_leaves` names it
        with open(path, "rb") as f:
            return fn(f)
    start = path_or_file.tell()
    try:
        return fn(path_or_file)
    finally:
        path_or_file.seek(start)


def tree_deserialise_leaves(path_or_file: str | pathlib.Path | BinaryIO, like: T) -> T:
    """`eqx.tree_deserialise_leaves(path_or_file, like)`, after a check that the
    checkpoint is of the kind `like` is: plain, FP8 training ([`fp8ax.fp8_linear_layers`][])
    or serving ([`fp8ax.to_serving`][]).

    Equinox loads a checkpoint leaf by leaf: into a template of another kind it fails with
    a shape or dtype error about some leaf (an amax history, a weight), and it ignores
    records left over at the end. This reads the shapes and dtypes of all the records
    first. At the first one that differs from `like`, it names the layer, says which kind
    `like` and the checkpoint have there, and what to call: load a plain checkpoint into
    [`fp8ax.strip_fp8`][]`(like)` and convert after, build an FP8 template with
    [`fp8ax.fp8_linear_layers`][], a serving template with [`fp8ax.serving_template`][].

    **Arguments:**

    - `path_or_file`: as for `eqx.tree_deserialise_leaves` (a path without a suffix gets
      `.eqx`, as there).
    - `like`: the template, of the same structure as the saved tree.

    **Returns:**

    The loaded tree.

    Checkpoints of a training model saved by earlier versions of fp8ax are read too:
    before 2026-12-08 an FP8 layer with state saved its three states (lhs, rhs, grad) as
    three arrays, where it now holds one with a role axis (see [`fp8ax.Fp8DotGeneral`][]),
    and they are stacked into one; before 2026-11-26 it also saved one more record after
    them (the layer's program switch `calibrating`, a Python float that fp8ax no longer
    has), which is read and skipped.

    **Raises:**

    `ValueError` if the checkpoint does not fit `like` (also when it holds more arrays).
    """
    try:
        check_checkpoint(path_or_file, like)
    except ValueError as error:
        records = _read(path_or_file, _records)
        # The layouts of fp8ax's older checkpoints, newest first: the three states of an
        # FP8 layer saved as three leaves (before 2026-12-08), and also its float switch
        # after them (before 2026-11-26).
        three = _with_three_states(like)
        for legacy in (three, _with_switches(three)):
            if legacy is not like and _fits(records, legacy):
                break
        else:
            raise error from None
        loaded = eqx.tree_deserialise_leaves(path_or_file, legacy)
        return jtu.tree_map(_from_legacy, loaded, is_leaf=_is_legacy)
    return eqx.tree_deserialise_leaves(path_or_file, like)


def _from_legacy(x):
    if isinstance(x, _Switched):
        x = x[0]
    if isinstance(x, _ThreeStates):
        op = x.op
        return op.with_states(lhs=x[0], rhs=x[1], grad=x[2])
    return x


def _is_legacy(x) -> bool:
    return isinstance(x, _Switched | _ThreeStates)


class _ThreeStates(tuple):
    """An FP8 op with state as checkpoints before 2026-12-08 saved it: its three states
    `(lhs, rhs, grad)`, a leaf each, where it now holds one state with a role axis. `op`
    is the template's op, which the loaded states go back into."""

    op: Fp8DotGeneral

    def __new__(cls, states, op):
        self = super().__new__(cls, states)
        self.op = op
        return self


class _Template:
    """A template op as pytree metadata, compared by identity (an op's `==` compares
    arrays)."""

    __slots__ = ("op",)

    def __init__(self, op):
        self.op = op

    def __eq__(self, other) -> bool:
        return type(other) is _Template and other.op is self.op

    def __hash__(self) -> int:
        return id(self.op)


jtu.register_pytree_node(
    _ThreeStates, lambda t: (tuple(t), _Template(t.op)), lambda meta, c: _ThreeStates(tuple(c), meta.op)
)


def _with_three_states(like):
    """`like` with each FP8 op with state as a `_ThreeStates` (`like` itself if it has
    none): zero-filled states of the shapes one role's state has."""
    found = []

    def split(x):
        if isinstance(x, Fp8DotGeneral) and isinstance(x.state, AbstractState):  # (not a grouped op's three)
            found.append(x)
            state = x.state
            row = type(state)._make(
                tuple(np.zeros(_row_shape(v, e), np.float32) for v, e in zip(state._values, state.entry_ndims)),
                None,
                None,
            )
            return _ThreeStates((row, row, row), x)
        return x

    out = jtu.tree_map(split, like, is_leaf=lambda x: isinstance(x, Fp8DotGeneral))
    return out if found else like


def _row_shape(value, entry_ndims: int) -> tuple[int, ...]:
    shape = tuple(np.shape(value)) if not hasattr(value, "shape") else tuple(value.shape)
    return shape[: len(shape) - entry_ndims - 1] + shape[len(shape) - entry_ndims :]


class _Switched(tuple):
    """`(layer, switch)`: an FP8 layer as checkpoints before 2026-11-26 saved it, its
    float leaf `calibrating` after its state."""


jtu.register_pytree_node(_Switched, lambda t: (tuple(t), None), lambda _, c: _Switched(c))


def _is_switched(x) -> bool:
    return isinstance(x, _Switched)


def _with_switches(like):
    """`like` with each FP8 layer with state in the older form (`like` itself if it has none)."""
    found = []

    def wrap(x):
        if isinstance(x, _ThreeStates) or (isinstance(x, Fp8DotGeneral) and x.state is not None):
            found.append(x)
            return _Switched((x, 0.0))
        return x

    out = jtu.tree_map(wrap, like, is_leaf=lambda x: isinstance(x, Fp8DotGeneral | _ThreeStates))
    return out if found else like


# Checkpoints whose leaves are named by their path (Orbax): the same kinds and advice,
# matched by path instead of by position.


def _names(path) -> tuple[str, ...]:
    # A key path as strings: Orbax stores `GetAttrKey("weight")` as "weight" and the
    # child of a NamedArray as "0".
    return tuple(path_str((k,)) for k in path)


def _has_shape(x) -> bool:
    # An array, a `jax.ShapeDtypeStruct` or a checkpointer's description of an array
    # (Orbax's `ArrayMetadata`); not a NamedArray, whose array is its child.
    return not _haliax.is_named(x) and hasattr(x, "shape") and hasattr(x, "dtype")


def _kind_of_entries(entries: dict[tuple[str, ...], tuple[tuple[int, ...], str | None]], weight_shape) -> str | None:
    """The kind of a saved layer from its entries (paths relative to the layer)."""
    weights = [sig for rest, sig in entries.items() if rest[:1] == ("weight",)]
    if not weights or weights[0][0] != tuple(weight_shape):
        return None
    if weights[0][1] in ("|u1", "|i1"):
        return "serving"
    if any(rest[:1] not in (("weight",), ("bias",)) for rest in entries):
        return "fp8"
    return "plain"


def check_checkpoint_metadata(metadata, like) -> None:
    """Checks that a checkpoint described by `metadata` fits `like` before it is
    restored, with the errors of [`fp8ax.tree_deserialise_leaves`][]: for a checkpointer
    that names each array by its path in the saved tree, such as Orbax.

    Orbax restores a tree by path and, into a template of another kind (plain, FP8
    training or serving), fails with a structure mismatch that lists paths. This compares
    `metadata` with `like` path by path; at the first difference it names the layer, says
    which kind `like` and the checkpoint have there and what to call, as
    [`fp8ax.tree_deserialise_leaves`][] does.

    **Arguments:**

    - `metadata`: a pytree whose leaves have `.shape` and `.dtype`, with the structure of
      the saved tree: `orbax.checkpoint.StandardCheckpointer().metadata(path).item_metadata`,
      or `jax.eval_shape` of the saved tree.
    - `like`: the template to restore into (arrays, `jax.ShapeDtypeStruct`s, or `None`
      for leaves that were not saved, as `eqx.filter(model, eqx.is_array)` leaves them).
      Paths are compared as strings, so `metadata` may hold dicts where `like` holds
      modules.

    **Raises:**

    `ValueError` if the checkpoint does not fit `like`.

    !!! Example

        ```python
        ckptr = orbax.checkpoint.StandardCheckpointer()
        like = eqx.filter(serving_model, eqx.is_array)
        fp8ax.check_checkpoint_metadata(ckptr.metadata(path).item_metadata, like)
        served = ckptr.restore(path, like)
        ```
    """
    saved = {_names(p): _signature(x) for p, x in jtu.tree_flatten_with_path(metadata, is_leaf=_has_shape)[0]}
    leaves = [
        (_names(p), x)
        for p, x in jtu.tree_flatten_with_path(like, is_leaf=_has_shape)[0]
        if _writes_record(x) or _has_shape(x)
    ]
    layers = [(_names(lp), lx) for lp, lx in jtu.tree_flatten_with_path(like, is_leaf=_is_layer)[0] if _is_layer(lx)]

    def layer_error(names, detail):
        for lp, lx in layers:
            if names[: len(lp)] != lp:
                continue
            like_kind = _kind_of_layer(lx)
            entries = {n[len(lp) :]: sig for n, sig in saved.items() if n[: len(lp)] == lp}
            w = lx.weight
            shape = tuple((w.array if _haliax.is_named(w) else w).shape)
            ckpt_kind = _kind_of_entries(entries, shape)
            if ckpt_kind == like_kind.replace("-stateless", ""):
                ckpt_kind = None
            told = f" The checkpoint holds {_DESCRIBE[ckpt_kind]} there." if ckpt_kind else ""
            return ValueError(
                f"The checkpoint does not fit `like` at layer `{'.'.join(lp)}`: `like` has {_DESCRIBE[like_kind]} "
                f"there.{told} {_advice(like_kind, ckpt_kind)} (First difference: {detail}.)"
            )
        return ValueError(f"The checkpoint does not fit `like`: {detail}. It was saved from another model.")

    for names, leaf in leaves:
        want = _signature(leaf)
        got = saved.get(names)
        if got is not None and got[0] == want[0] and (want[1] is None or got[1] == want[1]):
            continue
        found = "nothing there" if got is None else _show(got)
        raise layer_error(names, f"`{'.'.join(names)}` of `like` is {_show(want)}, but the checkpoint holds {found}")
    extra = sorted(set(saved) - {names for names, _ in leaves})
    if extra:
        # The first layer of `like` (in its order) with arrays left over, else the first.
        first = next((n for lp, _ in layers for n in extra if n[: len(lp)] == lp), extra[0])
        extra.remove(first)
        extra.insert(0, first)
        raise layer_error(
            extra[0],
            f"the checkpoint holds {len(extra)} arrays that `like` has no place for, the first `{'.'.join(extra[0])}` "
            f"({_show(saved[extra[0]])})",
        )
