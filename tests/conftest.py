import functools
import os
import warnings
import zlib
from importlib.metadata import version

import jax
import pytest

# On a GPU, JAX preallocates 75% of the GPU's memory in each process that uses it, and the
# suite runs up to 4 xdist workers (addopts): the second would run out of memory. Allocate
# on demand unless the caller chose otherwise. (Read when JAX creates its GPU client, at
# the first array, after this; nothing changes on the CPU.) The GPU selection itself runs
# in one process: `python -m pytest -q -m gpu -n 0` (tests/test_gpu_invariants.py).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Strict promotion forces every cast in fp8ax to be explicit (as Equinox's tests do).
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


class _GetKey:
    """`getkey()` returns a fresh PRNG key on each call."""

    def __init__(self, seed: int):
        self._key = jax.random.key(seed)

    def __call__(self):
        self._key, sub = jax.random.split(self._key)
        return sub


@pytest.fixture
def getkey(request):
    # Seeded by the test's id: every run of a test sees the same data, so a failure
    # reproduces, and different tests still see different data.
    return _GetKey(zlib.crc32(request.node.nodeid.encode()))


# --- `needs_hax_dot`: tests that need a working named-axis `hax.dot` ---
#
# Haliax 1.4.dev453's `hax.dot` (and so every `hax.nn.Linear`) calls
# `jax.core.is_constant_dim`, which jax 0.11 removed. Tests marked `needs_hax_dot` are
# skipped when a tiny `hax.dot` fails here, whatever the versions: they run again as soon
# as Haliax works with the installed JAX. CI's run on the oldest supported JAX sets
# FP8AX_REQUIRE_HAX_DOT=1, which turns the skip into a failure, so that run is complete.


@functools.cache
def hax_dot_failure() -> str | None:
    """None if a named-axis `hax.dot` works (eagerly and under `jit`), else what it raised."""
    import haliax as hax
    import jax.numpy as jnp

    A, B = hax.Axis("a", 2), hax.Axis("b", 3)
    x = hax.named(jnp.arange(6.0).reshape(2, 3), (A, B))
    w = hax.named(jnp.ones(3), (B,))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation warning is not a broken hax.dot
            for out in (hax.dot(x, w, axis=B), jax.jit(lambda x, w: hax.dot(x, w, axis=B))(x, w)):
                assert out.axes == (A,) and out.array.tolist() == [3.0, 12.0], out
    except Exception as e:  # noqa: BLE001 (any failure means the tests cannot run)
        return f"{type(e).__name__}: {e}"
    return None


@pytest.hookimpl(tryfirst=True)  # before fixtures, which may build Haliax models
def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_hax_dot") is None or (why := hax_dot_failure()) is None:
        return
    msg = f"named-axis hax.dot fails with haliax {version('haliax')} on jax {jax.__version__}: {why}"
    if os.environ.get("FP8AX_REQUIRE_HAX_DOT") == "1":
        pytest.fail(f"FP8AX_REQUIRE_HAX_DOT=1, but {msg}", pytrace=False)
    pytest.skip(msg)
