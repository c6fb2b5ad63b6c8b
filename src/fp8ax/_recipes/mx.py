# OCP Microscaling (MX v1.0): a power-of-two scale per block of the contraction.

from typing import Literal

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._mx import MX_ELEMENT_TYPES, mx_dequantize, mx_quantize
from .._quantized import QuantizedArray, ScaleLayout
from .stateless import AbstractStatelessRecipe


class MXScaling(AbstractStatelessRecipe):
    """OCP Microscaling (MX v1.0): blocks of `block_size` consecutive elements along the
    contracting dimension share one power-of-two scale, stored as E8M0.

    Shared exponent (the default, `scale_rule="ceil"`, the rule NVIDIA's MXFP8 training
    study, TransformerEngine, torchao and JAX's `scaled_dot_general` use): the smallest
    power of two that brings the block's amax within the element type's largest value,
    `ceil(log2(amax / element_max))`, clamped to E8M0's range; elements are the block
    divided by `2**exponent`, rounded to nearest even in the element type, and never
    saturate. `scale_rule="floor"` is the OCP spec's rule, `floor(log2(amax)) - emax`,
    which can push a block's largest values past the element type's range (they are
    saturated). A contracting dimension that is not a multiple of the block size is
    zero-padded for scaling only. The default formats are E4M3 for the forward operands
    and the gradients (MXFP8 as trained in practice); the OCP-style recipe is
    `MXScaling(grad_element="e5m2", scale_rule="floor")`.

    GEMMs with block scales are emulated: the blocks are dequantized (exact in float32)
    and multiplied with float32 accumulation, which is what an MX kernel computes for the
    same quantized inputs.
    """

    block_size: int = eqx.field(static=True)
    fwd_element: str = eqx.field(static=True)
    grad_element: str = eqx.field(static=True)
    scale_rule: Literal["floor", "ceil"] = eqx.field(static=True)

    def __init__(
        self,
        block_size: int = 32,
        fwd_element: str = "e4m3",
        grad_element: str = "e4m3",
        scale_rule: Literal["floor", "ceil"] = "ceil",
    ):
        """**Arguments:**

        - `block_size`: elements per shared scale (default 32, the OCP value).
        - `fwd_element`: element type of the forward operands: `"e4m3"` (default),
          `"e5m2"`, `"e2m3"`, `"e3m2"` (FP6), `"e2m1"` (FP4) or `"int8"` (MXINT8).
        - `grad_element`: element type of the output gradient (default `"e4m3"`).
        - `scale_rule`: `"ceil"` (the default: round the scale up, no saturation) or
          `"floor"` (the OCP spec's).
        """
        if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) or block_size < 1:
            raise ValueError(f"`block_size` must be an int >= 1, got {block_size!r}.")
        for name, value in (("fwd_element", fwd_element), ("grad_element", grad_element)):
            if value not in MX_ELEMENT_TYPES:
                raise ValueError(f"`{name}` must be one of {sorted(MX_ELEMENT_TYPES)}, got {value!r}.")
        if scale_rule not in ("floor", "ceil"):
            raise ValueError(f"`scale_rule` must be 'floor' or 'ceil', got {scale_rule!r}.")
        self.block_size = int(block_size)
        self.fwd_element = fwd_element
        self.grad_element = grad_element
        self.scale_rule = scale_rule

    @property
    def fwd_dtype(self) -> np.dtype:
        return np.dtype(MX_ELEMENT_TYPES[self.fwd_element])

    @property
    def grad_dtype(self) -> np.dtype:
        return np.dtype(MX_ELEMENT_TYPES[self.grad_element])

    @property
    def scale_layout(self) -> ScaleLayout:
        return "block"

    def quantize_role(self, x, contracting_axes, role, key=None) -> QuantizedArray:
        del key  # stochastic rounding is not offered for MX formats
        x = jnp.asarray(x)
        element = self.grad_element if role == "grad" else self.fwd_element
        if x.ndim == 0:
            # A 0-d operand (the output gradient of a full contraction, such as a vector
            # dot product): one block of one element, whose power-of-two scale is then
            # a tensor-wise float32 scale (MXINT8's implicit 2**-6 folded in).
            values, scales = mx_quantize(x[None], 0, element, self.block_size, self.scale_rule)
            scale = mx_dequantize(jnp.ones((1,), values.dtype), scales, 0, self.block_size, jnp.float32)
            return QuantizedArray(values[0], scale[0])
        # Blocks run along the (last) contracting axis.
        axis = max(contracting_axes) % x.ndim if contracting_axes else x.ndim - 1
        values, scales = mx_quantize(x, axis, element, self.block_size, self.scale_rule)
        return QuantizedArray(values, scales, block_axis=axis, block_size=self.block_size)
