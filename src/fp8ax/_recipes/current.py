# Current (just-in-time) scaling: each call scales a tensor by its own amax.

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .. import _formats
from .._quantized import QuantizedArray, ScaleLayout
from .stateless import (
    AbstractStatelessRecipe,
    Granularity,
    amax_scale,
    check_bool,
    check_granularity,
    check_rounding,
    check_seed,
    scaled_cast,
)


class CurrentScaling(AbstractStatelessRecipe):
    """Current (just-in-time) scaling: each call scales a tensor by its own amax.

    `scale = amax / fp8_max` (optionally rounded up to a power of two, exactly), computed
    from the tensor being quantized, so nothing is kept between steps and nothing can be
    stale. The scale is at least `2**-126`, the smallest normal float32 (a smaller one
    would be flushed to zero), and 1 for a tensor (or row) that is all zero or holds a
    NaN or an inf.
    Granularity `"tensor"`: one scale per tensor. `"row"`: one scale per row of the
    non-contracting dimensions (per input row for the activations, per output column for
    the kernel, torchao's rowwise), the GEMM's result is rescaled by the outer product of
    the two scale vectors.
    """

    granularity: Granularity = eqx.field(static=True)
    power_of_two: bool = eqx.field(static=True)
    fwd_dtype: np.dtype = eqx.field(static=True)
    grad_dtype: np.dtype = eqx.field(static=True)
    grad_rounding: Literal["nearest", "stochastic"] = eqx.field(static=True)
    seed: int = eqx.field(static=True)

    def __init__(
        self,
        granularity: Granularity = "tensor",
        power_of_two: bool = False,
        formats: Literal["hybrid", "e4m3"] = "hybrid",
        *,
        fwd_dtype=None,
        grad_dtype=None,
        grad_rounding: Literal["nearest", "stochastic"] = "nearest",
        seed: int = 0,
    ):
        """**Arguments:**

        - `granularity`: `"tensor"` (default) or `"row"`.
        - `power_of_two`: round every scale up to a power of two.
        - `formats`: `"hybrid"` (default: E4M3 forward, E5M2 gradients) or `"e4m3"`
          (E4M3 everywhere).
        - `fwd_dtype`, `grad_dtype`: override the formats with any FP8 dtype
          (`jnp.float8_e4m3fnuz`, ...). (Keyword only arguments.)
        - `grad_rounding`: `"nearest"` (default, round to nearest even) or
          `"stochastic"` for the output gradient. (Keyword only argument.)
        - `seed`: seed of the stochastic rounding. (Keyword only argument.)
        """
        self.granularity = check_granularity(granularity)
        self.power_of_two = check_bool(power_of_two, "power_of_two")
        self.fwd_dtype, self.grad_dtype = _formats.dtypes_from_formats(formats, fwd_dtype, grad_dtype)
        self.grad_rounding = check_rounding(grad_rounding)
        self.seed = check_seed(seed)

    @property
    def scale_layout(self) -> ScaleLayout:
        return self.granularity

    def rounding_seed(self, role: str) -> int | None:
        return self.seed if role == "grad" and self.grad_rounding == "stochastic" else None

    def quantize_role(self, x, contracting_axes, role, key=None) -> QuantizedArray:
        dtype = self.dtype_for(role)
        x = jnp.asarray(x)
        axes = tuple(range(x.ndim)) if self.granularity == "tensor" else tuple(contracting_axes)
        # The project's amax: not finite where a NaN or inf is reduced, whatever the size
        # (XLA:CPU's max of a large array skips NaNs), so such a tensor gets scale 1.
        amax = _formats.amax(x, axes, keepdims=True) if x.size else jnp.ones((1,) * x.ndim, jnp.float32)
        scale = amax_scale(amax, _formats.fp8_max(dtype), self.power_of_two)
        if self.granularity == "tensor":
            scale = jnp.reshape(scale, ())
        values = scaled_cast(x, scale, dtype, key)
        return QuantizedArray(values, scale)
