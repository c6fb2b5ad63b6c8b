# Stateless recipes: the scale of a tensor comes from the tensor itself, at every call.
#
# A stateless recipe quantizes one operand of a GEMM given the axes the GEMM contracts
# (`AbstractStatelessRecipe.quantize_role`). The scale never varies along those axes for
# "tensor" and "row" granularity, so the GEMM runs on the low-precision values and the
# scales multiply its result (what an FP8/int8 kernel does). MX block scales vary along
# the contracting axis; those GEMMs are emulated on the dequantized values (exact in
# float32: every element times a power of two), with float32 accumulation.
#
# The backward pass quantizes again for each backward GEMM, along that GEMM's own
# contracting axes: the output gradient along the kernel's output features for the input
# gradient, along the batch for the kernel gradient (rowwise and MX scales differ per
# GEMM), as TransformerEngine and torchao do.

import abc
from typing import Literal

import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .. import _formats
from .._quantized import QuantizedArray
from .._rounding import stochastic_round
from .base import AbstractScalingRecipe, as_operands

Granularity = Literal["tensor", "row"]


class AbstractStatelessRecipe(AbstractScalingRecipe):
    """A recipe whose scales come from the tensor being quantized, at every call.

    Modules that use one carry no FP8 state. Concrete recipes are final.
    """

    @abc.abstractmethod
    def quantize_role(self, x: Array, contracting_axes: tuple[int, ...], role: str, key=None) -> QuantizedArray:
        """Quantizes `x` as operand `role` (`"lhs"`, `"rhs"` or `"grad"`) of a GEMM that
        contracts `contracting_axes`, to the role's format (`dtype_for(role)`); `key` is
        the stochastic rounding key of a role with a `rounding_seed` (else None).

        The one method a stateless recipe implements. The pipeline tells it the role, so
        a recipe whose tiles or element type differ by role (2D weight blocks, MX's
        gradient elements) reads it here rather than working it out from a format."""

    def quantize_operands(self, operands):
        out = []
        for op in as_operands(operands):
            if op.state is not None:
                raise ValueError(f"`state` must be None: {type(self).__name__} keeps no state.")
            if op.role not in ("lhs", "rhs", "grad"):
                raise ValueError(
                    f"`Operand.role` must be 'lhs', 'rhs' or 'grad' for {type(self).__name__}, which quantizes by "
                    f"role; got {op.role!r}."
                )
            out.append((self.quantize_role(op.x, op.contracting_axes, op.role, op.key), None))
        return out


def check_granularity(value):
    if value not in ("tensor", "row"):
        raise ValueError(f"`granularity` must be 'tensor' or 'row', got {value!r}.")
    return value


def check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}.")
    return value


def amax_scale(amax, bound: float, power_of_two: bool):
    """Dequantization scale `amax / bound`, at least the smallest normal float32 (a
    smaller quotient would be flushed to zero: for an amax below `bound * 2**-126`, about
    5.3e-36 for E4M3, the scale is `2**-126` and the values stay below `bound`); 1 where
    the amax is not positive and finite (an all-zero tensor, or one holding a NaN or
    inf)."""
    scale = _formats.scale_from_amax(amax, np.float32(1.0 / bound))
    if power_of_two:
        # Round up to a power of two: the largest value still fits, and the scale itself
        # is exact in any format.
        scale = _pow2_at_least(scale)
    ok = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
    return jnp.where(ok, scale, jnp.float32(1.0))


def _pow2_at_least(x):
    """The smallest power of two >= `x`, for positive normal float32 `x`, built from its
    bits: `x` itself if its mantissa is 0, else the next exponent with a zero mantissa.
    (`exp2(ceil(log2(x)))` is not exact: XLA's `log2` and `exp2` are approximations, and
    gave scales like `2**-48 * 0.99999988`.)"""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    mantissa = lax.bitwise_and(bits, np.uint32(0x7FFFFF))
    # Setting every mantissa bit and adding one carries into the exponent: (e + 1) << 23.
    up = lax.add(lax.bitwise_or(bits, np.uint32(0x7FFFFF)), np.uint32(1))
    return lax.bitcast_convert_type(jnp.where(mantissa == 0, bits, up), jnp.float32)


def check_rounding(value):
    if value not in ("nearest", "stochastic"):
        raise ValueError(f"`grad_rounding` must be 'nearest' or 'stochastic', got {value!r}.")
    return value


def check_seed(value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`seed` must be an int, got {value!r}.")
    return int(value)


def scaled_cast(x, scale, dtype, key):
    """`x / scale` rounded to `dtype`: to nearest even, or stochastically with `key`."""
    if key is None:
        return _formats.quantize(x, scale, dtype)
    return stochastic_round(_formats.scale_and_clip(x, scale, dtype), dtype, key)
