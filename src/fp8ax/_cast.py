from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._serving import ServingDotGeneral
from ._state import AbstractState

T = TypeVar("T")


def cast_floating(model: T, dtype) -> T:
    """Casts every floating-point array in `model` to `dtype`, except FP8 scaling state
    and the scales of serving layers ([`fp8ax.to_serving`][]).

    The usual one-liner, `jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model)`,
    would also cast the scales and amax histories, which must stay float32 (an amax
    rounded to bf16 has 8 bits of precision). [`fp8ax.Fp8DotGeneral`][] refuses to run on
    such state; this function leaves it alone.

    **Arguments:**

    - `model`: any PyTree.
    - `dtype`: a floating dtype, e.g. `jnp.bfloat16`.

    **Returns:**

    A copy of `model` with its floating-point arrays cast, FP8 state and serving scales
    untouched.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype}.")

    def cast(x):
        if isinstance(x, AbstractState | ServingDotGeneral):
            return x
        if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jtu.tree_map(cast, model, is_leaf=lambda x: isinstance(x, AbstractState | ServingDotGeneral))
