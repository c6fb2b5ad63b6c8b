"""Whether the installed Haliax can run a named-axis matmul on the installed JAX.

Haliax 1.4.dev453's `hax.dot`, which every `hax.nn.Linear` calls, uses
`jax.core.is_constant_dim`, which jax 0.11 removed. A Haliax model then fails deep inside
Haliax with an `AttributeError` that names neither package's version. fp8ax's Haliax entry
points (converting, serving a `hax.nn.Linear`) call `require_haliax_matmul` first, which
tries one tiny `hax.dot` (once per process) and turns a failure into one error that says
what to install.
"""

import functools
import warnings
from importlib.metadata import PackageNotFoundError, version as _version

import haliax as hax
import jax
import jax.numpy as jnp


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
    A, B = hax.Axis("a", 2), hax.Axis("b", 3)
    x = hax.named(jnp.ones((2, 3), jnp.float32), (A, B))
    w = hax.named(jnp.ones((3,), jnp.float32), (B,))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation warning is not a broken hax.dot
            hax.dot(x, w, axis=B)
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
