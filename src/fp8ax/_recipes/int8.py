# Symmetric int8 with dynamic per-row and per-column scales (AQT's recipe).

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .. import _formats
from .._int8 import int8_quantize
from .._quantized import QuantizedArray, ScaleLayout
from .._rounding import stochastic_round
from .stateless import AbstractStatelessRecipe, check_rounding, check_seed


class Int8Scaling(AbstractStatelessRecipe):
    """Symmetric int8 with dynamic per-row / per-column scales and int32 accumulation
    (AQT's recipe).

    Each operand gets one scale per slice over its non-contracting dimensions: per input
    row for the activations, per output column for the kernel, `scale = amax / 127`, and
    values `round(x / scale)` clipped to [-127, 127]. The GEMM runs on the int8 values
    with an int32 result (`preferred_element_type=jnp.int32`), then multiplies by the
    outer product of the scales.
    """

    grad_rounding: Literal["nearest", "stochastic"] = eqx.field(static=True)
    seed: int = eqx.field(static=True)

    def __init__(self, *, grad_rounding: Literal["nearest", "stochastic"] = "nearest", seed: int = 0):
        """**Arguments:**

        - `grad_rounding`: `"nearest"` (default) or `"stochastic"` rounding of the
          output gradient. (Keyword only argument.)
        - `seed`: seed of the stochastic rounding. (Keyword only argument.)
        """
        self.grad_rounding = check_rounding(grad_rounding)
        self.seed = check_seed(seed)

    @property
    def fwd_dtype(self) -> np.dtype:
        return np.dtype(np.int8)

    @property
    def grad_dtype(self) -> np.dtype:
        return np.dtype(np.int8)

    @property
    def scale_layout(self) -> ScaleLayout:
        return "row"

    def rounding_seed(self, role: str) -> int | None:
        return self.seed if role == "grad" and self.grad_rounding == "stochastic" else None

    def quantize_role(self, x, contracting_axes, role, key=None) -> QuantizedArray:
        del role  # int8 for every role
        x = jnp.asarray(x)
        if key is None:
            values, scale = int8_quantize(x, tuple(contracting_axes))
            return QuantizedArray(values, scale)
        _, scale = int8_quantize(x, tuple(contracting_axes))
        scaled = jnp.clip(x.astype(jnp.float32) * _formats.reciprocal(scale), -127.0, 127.0)
        return QuantizedArray(stochastic_round(scaled, jnp.int8, key), scale)
