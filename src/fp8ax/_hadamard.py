"""The random Hadamard transform NVFP4 applies to both operands of the weight-gradient GEMM."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

BLOCK = 16


def hadamard_16(key) -> Array:
    """The 16x16 random Hadamard transform `H diag(s) / 4`: Sylvester's Hadamard matrix
    with its columns' signs flipped by the random vector `s` (from `key`), scaled to be
    orthogonal."""
    h = np.array([[1.0]])
    while h.shape[0] < BLOCK:
        h = np.block([[h, h], [h, -h]])
    signs = jax.random.rademacher(key, (BLOCK,), jnp.float32)
    return jnp.asarray(h, jnp.float32) * signs[None, :] / 4
