# The residuals the custom VJPs keep for the backward pass, in a form rematerialisation
# cannot change.
#
# When `jax.checkpoint` runs with a policy that saves residuals (`everything_saveable`,
# `save_anything_except_these_names`, `offload_dot_with_no_batch_dims`, Haliax's
# `Stacked(gradient_checkpointing="save_all")`, ...), JAX's partial evaluation of the
# remat inserts `lax.reduce_precision(r, exponent_bits=finfo.nexp,
# mantissa_bits=finfo.nmant)` after the producer of every saved floating-point residual
# `r` (jax/_src/ad_checkpoint.py, `_insert_reduce_precision`, jax 0.10 to 0.12). XLA's
# reduce-precision rounds to an IEEE-style format of those widths, with infinities, NaNs
# and no subnormals, which is the identity for float16, bfloat16, float32 and float64 but
# not for the formats FP8 training stores: for `float8_e4m3fn` (largest value 448) every
# value of 256 or more becomes NaN, and the subnormals of the E4M3 and E2M1 formats become
# zero (docs/faq.md has the JAX-only repro; tests/test_remat.py checks every dtype).
#
# So every low-precision floating-point leaf of the residuals (quantised values, E4M3 or
# E8M0 block scales) crosses the remat boundary as its bit pattern: an unsigned integer of
# the same width, which `_insert_reduce_precision` skips (it rounds inexact dtypes only).
# A bitcast of equal width moves no data; XLA removes the pair where no remat separates
# them.

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Floating-point dtypes narrower than 16 bits, carried as the unsigned integer of their
# width: every one the rounding above changes (all but E5M2, which is carried as bits all
# the same; tests/test_remat.py checks the list against JAX's `reduce_precision`).
_BITS = {8: jnp.uint8, 4: jnp.uint4}


def bits_dtype(dtype):
    """The unsigned integer dtype a residual of `dtype` is carried as, or None if it is
    carried as it is."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return _BITS.get(jnp.finfo(dtype).bits)


class _Bits(eqx.Module):
    """A low-precision floating-point array carried as its bit pattern."""

    bits: jax.Array
    dtype: np.dtype = eqx.field(static=True)


def protect(residuals):
    """`residuals` with each low-precision floating-point array replaced by its bits."""

    def one(x):
        if not isinstance(x, jax.Array | np.ndarray):
            return x
        to = bits_dtype(x.dtype)
        return x if to is None else _Bits(lax.bitcast_convert_type(x, to), np.dtype(x.dtype))

    return jax.tree.map(one, residuals)


def restore(residuals):
    """The inverse of `protect`."""

    def one(x):
        return lax.bitcast_convert_type(x.bits, x.dtype) if isinstance(x, _Bits) else x

    return jax.tree.map(one, residuals, is_leaf=lambda x: isinstance(x, _Bits))
