"""fp8ax's one door to Haliax.

`import fp8ax` does not import Haliax (nor AQT and Flax, which Haliax imports): a user
whose model is Equinox only does not pay for them (about 0.7 s). A model with Haliax
layers comes from a program that imported Haliax already, so fp8ax asks `sys.modules`
whether Haliax is there (`loaded`) before it looks for a Haliax layer, and only code that
holds a Haliax object in hand imports it (`hax`, `hnn`, `haxq`). Modules other than this
one and the model layer reach Haliax through these functions.

The first time Haliax is seen, fp8ax's `OverwriteWithGradient` is registered as a virtual
subclass of Haliax's (`overwrite_base`: `OverwriteWithGradient`, which newer marin-haliax
releases call `CustomGradientAccumulation`), so training code written against Haliax's
helpers (Levanter's trainer, `haliax.quantization.partition_for_grad_overwrite` and
`apply_updates`) treats fp8ax's modules as its own, as a real subclass did while Haliax was
imported with fp8ax.

Haliax is no dependency of fp8ax. Two distributions install the package `haliax`: the
maintained `marin-haliax` (fp8ax's `haliax` extra, and what marin-levanter pins) and the
old `haliax` (1.4.dev453, no longer released); fp8ax works with either.

It also checks that the installed Haliax can run a named-axis matmul on the installed JAX.
The `hax.dot` of Haliax 1.4.dev453 and of marin-haliax 0.2.20, which every `hax.nn.Linear`
calls, uses `jax.core.is_constant_dim`, which jax 0.11 removed (newer marin-haliax releases
run on jax 0.12). A Haliax model then fails deep inside
Haliax with an `AttributeError` that names neither package's version. fp8ax's Haliax entry
points (converting, serving a `hax.nn.Linear`) call `require_haliax_matmul` first, which
tries one tiny `hax.dot` (once per process) and turns a failure into one error that says
what to install.
"""

import abc
import functools
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version as _version
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard

import jax
import jax.numpy as jnp
from jax.core import Tracer

if TYPE_CHECKING:
    import haliax.nn

# fp8ax's `OverwriteWithGradient` (`_state` adds it at import; the door sits below it).
_OVERWRITE_CLASSES: list[type] = []


def overwrite_with_gradient_class(cls: type) -> type:
    """Registers `cls` with Haliax's `OverwriteWithGradient` once Haliax is seen."""
    _OVERWRITE_CLASSES.append(cls)
    return cls


def loaded() -> bool:
    """Whether the program imported Haliax (then, and only then, a Haliax layer can exist)."""
    if "haliax" not in sys.modules:
        return False
    _register()
    return True


def overwrite_base(q: ModuleType) -> type:
    """Haliax's base class for state that a gradient overwrites, in `haliax.quantization`
    `q`: `OverwriteWithGradient` in haliax 1.4.dev453 and marin-haliax 0.2.20,
    `CustomGradientAccumulation` in newer marin-haliax (0.2.227)."""
    base = getattr(q, "OverwriteWithGradient", None)
    return base if base is not None else q.CustomGradientAccumulation


@functools.cache
def _register() -> None:
    import haliax.quantization as haxq

    # Equinox's module metaclass refuses `register` (it has no use for virtual subclasses
    # of its own); ABCMeta's still records one, and only `isinstance` and `issubclass`
    # consult it, which is all Haliax's helpers ask.
    for cls in _OVERWRITE_CLASSES:
        abc.ABCMeta.register(overwrite_base(haxq), cls)


def hax() -> ModuleType:
    """`haliax`, imported (call only with a Haliax object in hand, or to build one)."""
    import haliax

    _register()
    return haliax


def hnn() -> ModuleType:
    """`haliax.nn`."""
    return hax().nn


def haxq() -> ModuleType:
    """`haliax.quantization`."""
    hax()
    import haliax.quantization

    return haliax.quantization


def _module(name: str) -> Any:
    """The imported module `name` (`haliax` or one of its submodules, all imported with
    it) if the program imported Haliax, else None; no import statement runs (these
    checks run on every node of a model walk)."""
    return sys.modules.get(name) if loaded() else None


def is_named(x: Any) -> bool:
    """Whether `x` is a `haliax.NamedArray`."""
    hx = _module("haliax")
    return hx is not None and isinstance(x, hx.NamedArray)


def is_axis(x: Any) -> bool:
    """Whether `x` is a `haliax.Axis`."""
    hx = _module("haliax")
    return hx is not None and isinstance(x, hx.Axis)


def is_linear(x: Any) -> bool:
    """Whether `x` is a `haliax.nn.Linear`."""
    nn = _module("haliax.nn")
    return nn is not None and isinstance(x, nn.Linear)


def is_moe_linear(x: Any) -> "TypeGuard[haliax.nn.MoELinear]":
    """Whether `x` is a `haliax.nn.MoELinear`."""
    nn = _module("haliax.nn")
    return nn is not None and isinstance(x, nn.MoELinear)


def is_overwrite_with_gradient(x: Any) -> bool:
    """Whether `x` is an instance of Haliax's `overwrite_base`: Haliax's own FP8 and int8
    ops, and fp8ax's modules once registered."""
    q = _module("haliax.quantization")
    return q is not None and isinstance(x, overwrite_base(q))


def current_axis_mapping():
    """Haliax's axis mapping in effect (`hax.axis_mapping(...)`), None without one or without Haliax."""
    return hax().partitioning.current_thread_local_mapping() if loaded() else None


def shard_by_axis_mapping(x: jax.Array, axis_names: tuple[str, ...]) -> jax.Array:
    """`x`, whose dimensions are the Haliax axes `axis_names`, constrained to the layout the
    current axis mapping gives those names, as `hax.shard` lays out a `NamedArray`; `x`
    itself without an axis mapping.

    One case is not left to `hax.shard`. marin-haliax (0.2.20 to 0.2.227 at least) emits
    `jax.sharding.reshard` instead of a sharding constraint when the partition spec names
    no mesh axis, whatever the mesh's axis types: every named mesh axis is then
    "explicit", vacuously. On a mesh with `Auto` axes `reshard` to a replicated layout
    constrains nothing, so the constraint is lost (an FSDP weight, replicated for the
    GEMM, is then gathered wherever XLA likes). Haliax 1.4.dev453 constrains. For a traced
    `x` on a mesh that is not all `Explicit`, the replicated layout is asked for here with
    `jax.lax.with_sharding_constraint`, with either Haliax.
    """
    mapping = current_axis_mapping()
    if mapping is None:
        return x
    hx = hax()
    axes = tuple(hx.Axis(name, size) for name, size in zip(axis_names, x.shape, strict=True))
    spec = hx.partitioning.pspec_for_axis(axes, mapping)
    mesh = jax.sharding.get_abstract_mesh()
    names_no_mesh_axis = all(entry is None for entry in spec)
    all_explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if isinstance(x, Tracer) and names_no_mesh_axis and not mesh.empty and not all_explicit:
        return jax.lax.with_sharding_constraint(x, spec)
    return hx.shard(hx.NamedArray(x, axes)).array


class HaliaxVersionError(RuntimeError):
    """The installed Haliax cannot run named-axis matmuls on the installed JAX."""


def installed_haliax() -> str:
    """The distribution that installed the package `haliax`, with its version:
    "marin-haliax 0.2.20.dev202606180959" or "haliax 1.4.dev453" ("unknown" if neither)."""
    for distribution in ("marin-haliax", "haliax"):
        try:
            return f"{distribution} {_version(distribution)}"
        except PackageNotFoundError:
            continue
    return "unknown"  # pragma: no cover (an import of the package worked)


@functools.cache
def hax_dot_problem() -> str | None:
    """None if a tiny named-axis `hax.dot` works, else the exception it raised, as text.

    Only the Python-level failure matters (the missing JAX function is looked up while
    `hax.dot` is traced), so the probe runs once, eagerly, on two small arrays.
    """
    hx = hax()
    A, B = hx.Axis("a", 2), hx.Axis("b", 3)
    x = hx.named(jnp.ones((2, 3), jnp.float32), (A, B))
    w = hx.named(jnp.ones((3,), jnp.float32), (B,))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation warning is not a broken hax.dot
            hx.dot(x, w, axis=B)
    except Exception as e:  # noqa: BLE001 (any failure means no hax.nn.Linear can run)
        return f"{type(e).__name__}: {e}"
    return None


def require_haliax_matmul(entry: str) -> None:
    """Raises [`HaliaxVersionError`] naming the versions to install if `hax.dot` is broken.

    `entry` names the fp8ax call that needs Haliax, for the first words of the message.
    """
    problem = hax_dot_problem()
    if problem is None:
        return
    jax_version = jax.__version__
    raise HaliaxVersionError(
        f"{entry}: haliax ({installed_haliax()}) cannot run a named-axis matmul on jax {jax_version}, so "
        f"no `hax.nn.Linear` can run, converted to FP8 or not (a tiny `hax.dot` raised {problem}). "
        "Haliax 1.4.dev453 and marin-haliax 0.2.20 call `jax.core.is_constant_dim`, which jax 0.11 "
        'removed. Install jax 0.10 (`pip install "jax>=0.10,<0.11"`), or the newest marin-haliax, which '
        'runs on jax 0.12 (Python 3.12 or later: `pip install -U "fp8ax[haliax]"`; with the old `haliax` '
        "distribution installed, `pip uninstall haliax` first, as both install the package `haliax`). "
        "Equinox models (`eqx.nn.Linear`) and `fp8ax.Fp8DotGeneral` called directly work on this JAX."
    )


def named_array_class() -> type | None:
    """`haliax.NamedArray` if the program imported Haliax, else None."""
    hx = _module("haliax")
    return None if hx is None else hx.NamedArray


@functools.cache
def _named_layout() -> tuple[type, str]:
    # marin-haliax's NamedArray holds `(array, axis_names)`, haliax 1.4's `(array, axes)`.
    import dataclasses

    cls = hax().NamedArray
    return cls, [f.name for f in dataclasses.fields(cls)][1]


@functools.lru_cache(maxsize=4096)
def _axes_value(kind: str, axes: tuple[tuple[str, int], ...]) -> tuple:
    if kind == "axis_names":
        return tuple(name for name, _ in axes)
    hx = hax()
    return tuple(hx.Axis(name, size) for name, size in axes)


@functools.cache
def state_named_class() -> type:
    # A subclass of `haliax.NamedArray` (so every Haliax tool treats it as one) with its
    # own pytree registration, whose unflatten sets the two fields instead of calling
    # `NamedArray.__init__`. A state's children are rebuilt on every unflatten of the model
    # (two or three per call of a jitted step: the outputs, Equinox's `combine`), and
    # `__init__`'s checks (axis-spec parsing, `typing` instance checks) cost about 30 us
    # each, more than the rest of the state's host work together. The node keeps
    # Haliax's aux data (the names, or the `Axis` objects) and its unkeyed child, so tree
    # paths (checkpoints) read as they do for a `NamedArray`. A Haliax op on it returns a
    # plain `NamedArray`, which the state's unflatten accepts as well.
    base, kind = _named_layout()
    new, set_field = object.__new__, object.__setattr__

    def rebuild(aux: Any, children: Any) -> Any:
        # (Through `object.__setattr__`, which keeps the two fields in the instance's
        # inline values: writing `__dict__` is faster, 0.17 us against 0.22, but makes a
        # dictionary, one more object per child for Python's collector to walk;
        # bench/README.md, run O.)
        out = new(cls)
        set_field(out, "array", children[0])
        set_field(out, kind, aux)
        return out

    doc = "A `haliax.NamedArray` child of an fp8ax state (built without Haliax's checks)."
    cls = type(base)("StateNamedArray", (base,), {"__module__": __name__, "__doc__": doc})
    jax.tree_util.register_pytree_node(cls, lambda x: ((x.array,), getattr(x, kind)), rebuild)
    global MADE_STATE_NAMED_CLASS
    MADE_STATE_NAMED_CLASS = cls
    return cls


# `state_named_class()` once made (a state has been named), else None: a check that
# imports nothing, read by every rebuild of a state (`_state`).
MADE_STATE_NAMED_CLASS: type | None = None


if not TYPE_CHECKING:  # (so that the type checker still flags a misspelt attribute)

    def __getattr__(name: str) -> Any:
        # `StateNamedArray` is made when Haliax is first used; pickle finds it by this
        # name, in a process that has not made it yet too.
        if name == "StateNamedArray":
            return state_named_class()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def named(value: Any, axes: tuple[tuple[str, int], ...]) -> Any:
    """`value` as a `haliax.NamedArray` with `axes` (name, size) pairs. `value` may be any
    pytree leaf a transformation puts there (None, a `ShapeDtypeStruct`, a sharding).

    Built the way Haliax's own unflatten builds one, without its checks (`axes` fit
    `value` by construction): a model's state is flattened on every call of a jitted
    step, and `NamedArray.__init__` costs some 40 times more. Its class is a subclass of
    `NamedArray` that unflattens without the checks too (`state_named_class`)."""
    _, kind = _named_layout()
    out = object.__new__(state_named_class())
    object.__setattr__(out, "array", value)
    object.__setattr__(out, kind, _axes_value(kind, axes))
    return out


def axis_pairs(x: Any) -> tuple[tuple[str, int], ...]:
    """The `(name, size)` pairs of a `haliax.NamedArray`'s axes. marin-haliax keeps the
    names only (`axis_names`; sizes from the array, 1 where it has no shape, such as
    None); haliax 1.4 keeps `Axis` objects (`axes`)."""
    names = getattr(x, "axis_names", None)
    if names is None:
        return tuple((ax.name, ax.size) for ax in x.axes)
    shape = getattr(x.array, "shape", None)
    sizes = tuple(shape) if shape is not None and len(shape) == len(names) else (1,) * len(names)
    return tuple(zip(names, sizes))
