# Stateless recipes: the scale of a tensor comes from the tensor itself, at every call.
#
# A stateless recipe quantises one operand of a GEMM given the axes the GEMM contracts
# (`AbstractStatelessRecipe.quantize`). The scale never varies along those axes for
# "tensor" and "row" granularity, so the GEMM runs on the low-precision values and the
# scales multiply its result (what an FP8/int8 kernel does). MX block scales vary along
# the contracting axis; those GEMMs are emulated on the dequantised values (exact in
# float32: every element times a power of two), with float32 accumulation.
#
# The backward pass quantises again for each backward GEMM, along that GEMM's own
# contracting axes: the output gradient along the kernel's output features for the input
# gradient, along the batch for the kernel gradient (rowwise and MX scales differ per
# GEMM), as TransformerEngine and torchao do.

import abc
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from . import _formats
from ._int8 import int8_quantize
from ._mx import MX_ELEMENT_TYPES, mx_dequantize, mx_quantize
from ._quantized import QuantizedArray, ScaleLayout
from ._recipes import AbstractScalingRecipe, _as_operands, _no_merge
from ._rounding import stochastic_round

Granularity = Literal["tensor", "row"]


class AbstractStatelessRecipe(AbstractScalingRecipe):
    """A recipe whose scales come from the tensor being quantised, at every call.

    Modules that use one carry no FP8 state. Concrete recipes are final.
    """

    @abc.abstractmethod
    def quantize(self, x: Array, contracting_axes: tuple[int, ...], dtype, key=None) -> QuantizedArray:
        """Quantises `x`, an operand of a GEMM that contracts `contracting_axes`, to `dtype`."""

    def quantize_role(self, x: Array, contracting_axes: tuple[int, ...], role: str, key=None) -> QuantizedArray:
        """Quantises `x` as operand `role` (`"lhs"`, `"rhs"` or `"grad"`) of a GEMM that
        contracts `contracting_axes`: what the GEMM pipeline calls. The default is
        `quantize` in the role's format (`dtype_for(role)`); a recipe whose layout
        depends on the role (2D weight blocks) overrides this."""
        return self.quantize(x, contracting_axes, self.dtype_for(role), key)

    def quantize_operand(self, x, contracting_axes, dtype, *, state=None, key=None, merge=_no_merge):
        del merge
        if state is not None:
            raise ValueError(f"`state` must be None: {type(self).__name__} keeps no state.")
        return self.quantize(x, contracting_axes, dtype, key), None

    def quantize_operands(self, operands):
        out = []
        for op in _as_operands(operands):
            if op.state is not None:
                raise ValueError(f"`state` must be None: {type(self).__name__} keeps no state.")
            if op.role is None:  # a caller that names the format, not the role
                out.append((self.quantize(op.x, op.contracting_axes, op.dtype, op.key), None))
            else:
                out.append((self.quantize_role(op.x, op.contracting_axes, op.role, op.key), None))
        return out


def _check_granularity(value):
    if value not in ("tensor", "row"):
        raise ValueError(f"`granularity` must be 'tensor' or 'row', got {value!r}.")
    return value


def _check_bool(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}.")
    return value


def _amax_scale(amax, bound: float, power_of_two: bool):
    """Dequantisation scale `amax / bound`, at least the smallest normal float32 (a
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


class CurrentScaling(AbstractStatelessRecipe):
    """Current (just-in-time) scaling: each call scales a tensor by its own amax.

    `scale = amax / fp8_max` (optionally rounded up to a power of two, exactly), computed
    from the tensor being quantised, so nothing is kept between steps and nothing can be
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
        self.granularity = _check_granularity(granularity)
        self.power_of_two = _check_bool(power_of_two, "power_of_two")
        self.fwd_dtype, self.grad_dtype = _formats.dtypes_from_formats(formats, fwd_dtype, grad_dtype)
        self.grad_rounding = _check_rounding(grad_rounding)
        self.seed = _check_seed(seed)

    @property
    def scale_layout(self) -> ScaleLayout:
        return self.granularity

    def stochastic(self, role: str) -> bool:
        return role == "grad" and self.grad_rounding == "stochastic"

    def quantize(self, x, contracting_axes, dtype, key=None) -> QuantizedArray:
        x = jnp.asarray(x)
        axes = tuple(range(x.ndim)) if self.granularity == "tensor" else tuple(contracting_axes)
        # The project's amax: not finite where a NaN or inf is reduced, whatever the size
        # (XLA:CPU's max of a large array skips NaNs), so such a tensor gets scale 1.
        amax = _formats.amax(x, axes, keepdims=True) if x.size else jnp.ones((1,) * x.ndim, jnp.float32)
        scale = _amax_scale(amax, _formats.fp8_max(dtype), self.power_of_two)
        if self.granularity == "tensor":
            scale = jnp.reshape(scale, ())
        values = _cast(x, scale, dtype, key)
        return QuantizedArray(values, scale)


def _check_rounding(value):
    if value not in ("nearest", "stochastic"):
        raise ValueError(f"`grad_rounding` must be 'nearest' or 'stochastic', got {value!r}.")
    return value


def _check_seed(value):
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"`seed` must be an int, got {value!r}.")
    return int(value)


def _cast(x, scale, dtype, key):
    """`x / scale` rounded to `dtype`: to nearest even, or stochastically with `key`."""
    if key is None:
        return _formats.quantize(x, scale, dtype)
    return stochastic_round(_formats.scale_and_clip(x, scale, dtype), dtype, key)


def content_key(seed: int, x) -> jax.Array:
    """A PRNG key that changes with the tensor's contents: `seed` folded with a 32-bit
    hash of `x`'s bits. Reproducible given `seed` and `x`; a different tensor (the next
    step's gradient) gets a different key."""
    bits = lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    h = jnp.sum(jnp.ravel(bits) * weights, dtype=jnp.uint32)
    return jax.random.fold_in(jax.random.key(seed), h)


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

    GEMMs with block scales are emulated: the blocks are dequantised (exact in float32)
    and multiplied with float32 accumulation, which is what an MX kernel computes for the
    same quantised inputs.
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

    def quantize(self, x, contracting_axes, dtype, key=None) -> QuantizedArray:
        del key  # stochastic rounding is not offered for MX formats
        x = jnp.asarray(x)
        element = self.fwd_element if np.dtype(dtype) == self.fwd_dtype else self.grad_element
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
        self.grad_rounding = _check_rounding(grad_rounding)
        self.seed = _check_seed(seed)

    @property
    def fwd_dtype(self) -> np.dtype:
        return np.dtype(np.int8)

    @property
    def grad_dtype(self) -> np.dtype:
        return np.dtype(np.int8)

    @property
    def scale_layout(self) -> ScaleLayout:
        return "row"

    def stochastic(self, role: str) -> bool:
        return role == "grad" and self.grad_rounding == "stochastic"

    def quantize(self, x, contracting_axes, dtype, key=None) -> QuantizedArray:
        del dtype
        x = jnp.asarray(x)
        if key is None:
            values, scale = int8_quantize(x, tuple(contracting_axes))
            return QuantizedArray(values, scale)
        _, scale = int8_quantize(x, tuple(contracting_axes))
        scaled = jnp.clip(x.astype(jnp.float32) * _formats.reciprocal(scale), -127.0, 127.0)
        return QuantizedArray(stochastic_round(scaled, jnp.int8, key), scale)


def quantize(
    x,
    recipe: AbstractStatelessRecipe,
    axis: int | tuple[int, ...] = -1,
    *,
    grad: bool = False,
    key=None,
    role: str | None = None,
) -> QuantizedArray:
    """Quantises an array with a recipe, outside any GEMM (for inspection and serving).

    **Arguments:**

    - `x`: a floating-point array.
    - `recipe`: [`fp8ax.CurrentScaling`][], [`fp8ax.MXScaling`][] or
      [`fp8ax.Int8Scaling`][].
    - `axis`: the axis (or axes) a GEMM would contract: row-wise and int8 scales are
      shared over it, MX blocks run along it. Ignored by tensor-wise scaling.
    - `grad`: quantise with the recipe's gradient format instead of the forward one.
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
            "one tensor: quantise with `CurrentScaling()` for the same per-tensor scale of a given tensor."
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
        raise ValueError(f"`grad=True` quantises an output gradient, but `role` is {role!r}.")
    stochastic = recipe.stochastic(role)
    if stochastic and key is None:
        raise ValueError("`key` is required: the recipe rounds gradients stochastically.")
    return recipe.quantize_role(x, axes, role, key if stochastic else None)
