# NVIDIA's NVFP4 training recipe: E2M1 values, an E4M3 scale per 16 elements of the
# contraction and one float32 scale per tensor (two-level scaling); 16x16 weight blocks,
# a random Hadamard transform of the weight gradient's inputs, stochastic rounding of the
# output gradient. Each trick can be turned off.
#
# Everything specific to the recipe is here: the tiles, the two-level scales, rounding to
# E2M1 stochastically, and the rotation it asks the pipeline to apply to both operands
# of the weight-gradient GEMM (`weight_gradient_rotation`).

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array

from .. import _formats
from .._hadamard import hadamard_16
from .._quantized import QuantizedArray, ScaleLayout, expand_tiles
from .._rounding import stochastic_round_e2m1
from .._tiles import run_tiles, tiled_amax
from .stateless import AbstractStatelessRecipe, amax_scale, check_bool, check_seed

E2M1 = np.dtype(jnp.float4_e2m1fn)
E4M3 = np.dtype(jnp.float8_e4m3fn)
BLOCK = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0


class NVFP4Scaling(AbstractStatelessRecipe):
    """NVIDIA's NVFP4 training recipe (TransformerEngine ships it; no other JAX library
    does).

    - Values: E2M1 (FP4), on every operand.
    - Scales, two levels: one float32 per tensor, `amax / (448 * 6)`, and one E4M3 per
      16 consecutive elements of the contraction, `e4m3(block_amax / (6 * tensor_scale))`,
      so that a block's largest value lands on E2M1's largest, 6, and the E4M3 scales use
      their whole range. Values are `x / (block_scale * tensor_scale)`, clipped to +-6.
      A block whose E4M3 scale underflows to zero is stored as zeros; a block holding a
      NaN or inf gets a NaN scale (E2M1 has no NaN), so it dequantizes to NaN.
    - Weights (`two_d_weights=True`): one scale per 16x16 block, so the forward GEMM and
      the input gradient's GEMM use the same quantized weight.
    - Weight gradient (`hadamard=True`): both of its operands (the activation and the
      output gradient) are multiplied along the contraction (the tokens), 16 elements at
      a time, by the same random orthogonal matrix `H diag(s) / 4` before they are
      quantized, which spreads outliers over their block without changing the GEMM in
      exact arithmetic. `s` comes from `seed`. Skipped when the contraction is not a
      multiple of 16 long.
    - Output gradient (`stochastic_gradients=True`): rounded stochastically to E2M1
      (unbiased); the forward operands round to nearest even.

    GEMMs dequantize the blocks (FP4 times E4M3 is exact in float32 and bfloat16),
    multiply with float32 accumulation and then by the two per-tensor scales.
    """

    two_d_weights: bool = eqx.field(static=True)
    hadamard: bool = eqx.field(static=True)
    stochastic_gradients: bool = eqx.field(static=True)
    seed: int = eqx.field(static=True)

    def __init__(
        self,
        *,
        two_d_weights: bool = True,
        hadamard: bool = True,
        stochastic_gradients: bool = True,
        seed: int = 0,
    ):
        """**Arguments:** (all keyword only)

        - `two_d_weights`: 16x16 scale blocks for the weight (`rhs`) instead of 1x16.
        - `hadamard`: the random Hadamard transform of the weight gradient's operands.
        - `stochastic_gradients`: stochastic rounding of the output gradient.
        - `seed`: seed of the Hadamard signs and of the stochastic rounding.
        """
        self.two_d_weights = check_bool(two_d_weights, "two_d_weights")
        self.hadamard = check_bool(hadamard, "hadamard")
        self.stochastic_gradients = check_bool(stochastic_gradients, "stochastic_gradients")
        self.seed = check_seed(seed)

    @property
    def fwd_dtype(self) -> np.dtype:
        return E2M1

    @property
    def grad_dtype(self) -> np.dtype:
        return E2M1

    @property
    def scale_layout(self) -> ScaleLayout:
        return "block"

    def contraction_independent(self, role: str) -> bool:
        return role == "rhs" and self.two_d_weights

    def rounding_seed(self, role: str) -> int | None:
        return self.seed if role == "grad" and self.stochastic_gradients else None

    def weight_gradient_rotation(self) -> Array | None:
        return hadamard_16(jax.random.fold_in(jax.random.key(self.seed), 0x48AD)) if self.hadamard else None

    def tile_for(self, shape: tuple[int, ...], contracting_axes, role: str) -> tuple[int, ...]:
        """The tile of an operand of `shape` quantized as `role` for a GEMM that contracts
        `contracting_axes`: 16 consecutive elements of the contraction, and 16 along the
        free axes too for a 2D-blocked weight."""
        extents = run_tiles(shape, contracting_axes, BLOCK)
        if role == "rhs" and self.two_d_weights:
            free = [d for d in range(len(shape)) if d not in extents]
            extents.update(run_tiles(shape, free, BLOCK))
        return tuple(extents.get(d, 1) for d in range(len(shape)))

    def quantize_role(self, x, contracting_axes, role, key=None) -> QuantizedArray:
        x = jnp.asarray(x)
        if x.ndim == 0:
            x1 = self.quantize_role(x[None], (0,), role, key)
            return QuantizedArray(x1.values[0], x1.scale[0], outer_scale=x1.outer_scale)
        tile = self.tile_for(x.shape, tuple(contracting_axes), role)
        # The per-tensor scale: at least the smallest normal float32, 1 for an all-zero
        # tensor or one holding a NaN or inf (as every fp8ax scale).
        outer = amax_scale(_formats.amax(x), E4M3_MAX * E2M1_MAX, False)
        ratio = lax.div(tiled_amax(x, tile), lax.mul(jnp.float32(E2M1_MAX), outer))
        # A block holding a NaN or inf gets a NaN scale (E2M1 has no NaN), so that it
        # dequantizes to NaN and the GEMM's result shows it.
        ratio = jnp.where(jnp.isfinite(ratio), jnp.minimum(ratio, jnp.float32(E4M3_MAX)), jnp.float32(jnp.nan))
        block = ratio.astype(E4M3)
        scale = lax.mul(block.astype(jnp.float32), outer)  # the decode scale of each block
        # `x * (1 / scale)`, clipped to +-6 (`_formats`' cast); 0 for a block whose scale is 0.
        inverse = expand_tiles(
            jnp.where(scale > 0, _formats.reciprocal(jnp.where(scale > 0, scale, 1)), jnp.float32(0)), tile, x.shape
        )
        if key is None:
            values = _formats.quantize(x, None, E2M1, inv=inverse)
        else:
            values = stochastic_round_e2m1(_formats.scale_and_clip(x, None, E2M1, inv=inverse), key)
        return QuantizedArray(values, block, tile, outer_scale=outer)
