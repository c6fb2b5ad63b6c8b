import dataclasses
from typing import TypeVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._serving import ServingDotGeneral, ServingRaggedDot
from ._state import AbstractState

T = TypeVar("T")

# What keeps its dtypes: FP8 state, and the scales of the serving GEMMs (dense and grouped).
_KEPT = (AbstractState, ServingDotGeneral, ServingRaggedDot)


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
    untouched. A serving layer's stored low-precision values stay as they are; the
    weight they stand for counts as cast, so the layer computes in `dtype` as the cast
    training layer would.
    """
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`dtype` must be a floating dtype, got {dtype}.")

    def cast(x):
        if isinstance(x, ServingDotGeneral | ServingRaggedDot):
            # The stored values and scales stay; the weight the layer stands for is cast
            # (the GEMM's output dtype follows it, as the cast training layer's would).
            if jnp.issubdtype(x.weight_dtype, jnp.floating):
                return dataclasses.replace(x, weight_dtype=dtype)
            return x
        if isinstance(x, AbstractState):
            return x
        if eqx.is_inexact_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jtu.tree_map(cast, model, is_leaf=lambda x: isinstance(x, _KEPT))
