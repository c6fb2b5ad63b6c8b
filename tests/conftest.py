import zlib

import jax
import pytest

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
