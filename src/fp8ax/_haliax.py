"""fp8ax's one door to Haliax.

`import fp8ax` does not import Haliax (nor AQT and Flax, which Haliax imports): a user
whose model is Equinox only does not pay for them (about 0.7 s). A model with Haliax
layers comes from a program that imported Haliax already, so fp8ax asks `sys.modules`
whether Haliax is there (`loaded`) before it looks for a Haliax layer, and only code that
holds a Haliax object in hand imports it (`hax`, `hnn`, `haxq`). Modules other than this
one and the model layer reach Haliax through these functions.

The first time Haliax is seen, fp8ax's `OverwriteWithGradient` is registered as a virtual
subclass of Haliax's, so training code written against Haliax's helpers (Levanter's
trainer, `haliax.quantization.partition_for_grad_overwrite` and `apply_updates`) treats
fp8ax's modules as its own, as a real subclass did while Haliax was imported with fp8ax.

It also checks that the installed Haliax can run a named-axis matmul on the installed JAX.
Haliax 1.4.dev453's `hax.dot`, which every `hax.nn.Linear` calls, uses
`jax.core.is_constant_dim`, which jax 0.11 removed. A Haliax model then fails deep inside
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


@functools.cache
def _register() -> None:
    import haliax.quantization as haxq

    # Equinox's module metaclass refuses `register` (it has no use for virtual subclasses
    # of its own); ABCMeta's still records one, and only `isinstance` and `issubclass`
    # consult it, which is all Haliax's helpers ask.
    for cls in _OVERWRITE_CLASSES:
        abc.ABCMeta.register(haxq.OverwriteWithGradient, cls)


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
    """Whether `x` is a `haliax.quantization.OverwriteWithGradient`: Haliax's own FP8 and int8
    ops, and fp8ax's modules once registered."""
    q = _module("haliax.quantization")
    return q is not None and isinstance(x, q.OverwriteWithGradient)


def current_axis_mapping():
    """Haliax's axis mapping in effect (`hax.axis_mapping(...)`), None without one or without Haliax."""
    return hax().partitioning.current_thread_local_mapping() if loaded() else None


class HaliaxVersionError(RuntimeError):
    """The installed Haliax cannot run named-axis matmuls on the installed JAX."""


def _installed(package: str) -> str:
    try:
        return _version(package)
    except PackageNotFoundError:  # pragma: no cover (an import of the package worked)
        return "unknown"


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
    jax_version, haliax_version = jax.__version__, _installed("haliax")
    raise HaliaxVersionError(
        f"{entry}: haliax {haliax_version} cannot run a named-axis matmul on jax {jax_version}, so no "
        f"`hax.nn.Linear` can run, converted to FP8 or not (a tiny `hax.dot` raised {problem}). Haliax "
        "1.4.dev453 calls `jax.core.is_constant_dim`, which jax 0.11 removed. Install jax 0.10 "
        '(`pip install "jax>=0.10,<0.11"`, or fp8ax with its `haliax` extra: `pip install -e ".[haliax]"`), '
        f"or a Haliax release that supports jax {jax_version}. Equinox models (`eqx.nn.Linear`) and "
        "`fp8ax.Fp8DotGeneral` called directly work on this JAX."
    )
