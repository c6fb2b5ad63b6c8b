import equinox.internal as eqxi
import jax
import pytest

# Strict promotion forces every cast in fp8ax to be explicit (as Equinox's tests do).
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    return eqxi.GetKey()
