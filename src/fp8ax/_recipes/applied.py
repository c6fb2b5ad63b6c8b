# `fp8ax.quantize`: a recipe applied to one array, outside any GEMM.


import jax
import jax.numpy as jnp
import numpy as np

from .._quantized import QuantizedArray
from .stateless import AbstractStatelessRecipe


def quantize(
    x,
    recipe: AbstractStatelessRecipe,
    axis: int | tuple[int, ...] = -1,
    *,
    grad: bool = False,
    key=None,
    role: str | None = None,
) -> QuantizedArray:
    """Quantizes an array with a recipe, outside any GEMM (for inspection and serving).

    **Arguments:**

    - `x`: a floating-point array.
    - `recipe`: [`fp8ax.CurrentScaling`][], [`fp8ax.MXScaling`][] or
      [`fp8ax.Int8Scaling`][].
    - `axis`: the axis (or axes) a GEMM would contract: row-wise and int8 scales are
      shared over it, MX blocks run along it. Ignored by tensor-wise scaling.
    - `grad`: quantize with the recipe's gradient format instead of the forward one.
      (Keyword only argument.)
    - `key`: a PRNG key for stochastic rounding (recipes with `grad_rounding="stochastic"`,
      with `grad=True`). (Keyword only argument.)
    - `role`: the operand `x` stands for in a GEMM: `"lhs"` (the activation, default),
      `"rhs"` (the weight) or `"grad"` (the output gradient, the same as `grad=True`).
      Recipes whose layout depends on it ([`fp8ax.BlockwiseScaling`][]'s 2D weight
      blocks) need it. (Keyword only argument.)

    **Returns:**

    A [`fp8ax.QuantizedArray`][]: `values`, `scale`, and `.dequantize(dtype)`.
    """
    if not isinstance(recipe, AbstractStatelessRecipe):
        raise TypeError(
            "`recipe` must be a stateless recipe (`fp8ax.CurrentScaling`, `fp8ax.MXScaling`, `fp8ax.Int8Scaling`), "
            f"got {type(recipe).__name__}. `DelayedScaling` takes its scale from the history of a layer, not from "
            "one tensor: quantize with `CurrentScaling()` for the same per-tensor scale of a given tensor."
        )
    if not isinstance(x, jax.Array | np.ndarray) or not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"`x` must be a floating-point array, got {getattr(x, 'dtype', type(x).__name__)}.")
    x = jnp.asarray(x)
    axes = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    bad = [a for a in axes if not -x.ndim <= a < x.ndim]
    if bad or not axes:
        raise ValueError(f"`axis` must name axes of `x` (shape {x.shape}), got {axis!r}.")
    axes = tuple(sorted(a % x.ndim for a in axes))
    if role is None:
        role = "grad" if grad else "lhs"
    elif role not in ("lhs", "rhs", "grad"):
        raise ValueError(f"`role` must be 'lhs', 'rhs' or 'grad', got {role!r}.")
    elif grad and role != "grad":
        raise ValueError(f"`grad=True` quantizes an output gradient, but `role` is {role!r}.")
    stochastic = recipe.stochastic(role)
    if stochastic and key is None:
        raise ValueError("`key` is required: the recipe rounds gradients stochastically.")
    return recipe.quantize_role(x, axes, role, key if stochastic else None)
