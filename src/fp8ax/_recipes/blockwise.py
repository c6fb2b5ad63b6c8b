# DeepSeek-V3's fine-grained FP8: current scaling per tile of 128 elements of the
# contraction (activations and output gradients) and per 128x128 block (weights), E4M3
# everywhere, GEMMs that promote each 128-element chunk of the contraction to float32.
#
# Everything specific to the recipe is here: the tile of each role. The GEMM pipeline
# derives from the quantized values' tiles that the scales vary along the contraction
# and runs one GEMM per chunk (`_gemm.scaled.block_scaled_dot`); serving stores the
# quantized weight with its tile; stats read the tiles through `QuantizedArray`.

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .. import _formats
from .._quantized import QuantizedArray, ScaleLayout, expand_tiles
from .._tiles import run_tiles, tiled_amax
from .stateless import AbstractStatelessRecipe, amax_scale, check_bool


class BlockwiseScaling(AbstractStatelessRecipe):
    """DeepSeek-V3's fine-grained FP8 (current scaling by tiles), the recipe TE's JAX
    side does not support.

    - Activations and output gradients: one scale per `1 x tile` elements, `tile`
      consecutive elements of the contraction for each row. A backward GEMM that
      contracts another axis re-quantizes along its own (`tile x 1` in the
      activation's layout).
    - Weights (`rhs`): one scale per `tile x tile` block, so the forward GEMM and the
      input gradient's GEMM use the same quantized weight.
    - `scale = amax / 448` per tile (at least `2**-126`; 1 for an all-zero tile or one
      holding a NaN or inf), optionally rounded up to a power of two, in float32; E4M3
      values everywhere.
    - GEMMs: one per `tile`-long chunk of the contraction, accumulated in float32 and
      multiplied by its two tiles' scales, the chunks summed in float32 (DeepSeek-V3
      promotes Tensor Core partial sums to float32 every 128 elements). On a CPU this is
      exact emulation of that computation.

    Contractions over several axes tile `tile` consecutive elements of the flattened
    contraction where the axes allow it. A GEMM whose two operands' tiles do not line
    up (a contraction laid out in another axis order) falls back to dequantizing.
    """

    tile: int = eqx.field(static=True)
    power_of_two: bool = eqx.field(static=True)
    fwd_dtype: np.dtype = eqx.field(static=True)
    grad_dtype: np.dtype = eqx.field(static=True)

    def __init__(self, tile: int = 128, power_of_two: bool = False, formats="e4m3", *, fwd_dtype=None, grad_dtype=None):
        """**Arguments:**

        - `tile`: elements per scale along the contraction, and the side of a weight's
          square block (default 128, DeepSeek-V3's).
        - `power_of_two`: round every scale up to a power of two (exactly).
        - `formats`: `"e4m3"` (default: E4M3 everywhere, as DeepSeek-V3) or `"hybrid"`
          (E5M2 gradients).
        - `fwd_dtype`, `grad_dtype`: override the formats with any FP8 dtype. (Keyword
          only arguments.)
        """
        if isinstance(tile, bool) or not isinstance(tile, int | np.integer) or tile < 1:
            raise ValueError(f"`tile` must be an int >= 1, got {tile!r}.")
        self.tile = int(tile)
        self.power_of_two = check_bool(power_of_two, "power_of_two")
        self.fwd_dtype, self.grad_dtype = _formats.dtypes_from_formats(formats, fwd_dtype, grad_dtype)

    @property
    def scale_layout(self) -> ScaleLayout:
        return "block"

    def contraction_independent(self, role: str) -> bool:
        return role == "rhs"  # square blocks: the same for either contraction

    def tile_for(self, shape: tuple[int, ...], contracting_axes, role: str) -> tuple[int, ...]:
        """The tile of an operand of `shape` quantized as `role` for a GEMM that contracts
        `contracting_axes`."""
        extents = run_tiles(shape, contracting_axes, self.tile)
        if role == "rhs":
            free = [d for d in range(len(shape)) if d not in extents]
            extents.update(run_tiles(shape, free, self.tile))
        return tuple(extents.get(d, 1) for d in range(len(shape)))

    def quantize_role(self, x, contracting_axes, role, key=None) -> QuantizedArray:
        del key  # round to nearest, as DeepSeek-V3
        dtype = self.dtype_for(role)
        x = jnp.asarray(x)
        tile = self.tile_for(x.shape, tuple(contracting_axes), role)
        scale = amax_scale(tiled_amax(x, tile), _formats.fp8_max(dtype), self.power_of_two)
        values = _formats.quantize(x, expand_tiles(scale, tile, x.shape), dtype)
        return QuantizedArray(values, scale, tile)
