"""The GEMMs on quantized operands, and their custom VJPs. One job per module:

- `settings`: `GemmSettings` (mode, precisions, per-operand recipes, high-precision
  GEMMs) and the keyword arguments the ops take;
- `call`: the static part of one call (`Call`) and what its settings say of each
  operand (recipe, format, reuse, the gradient's rounding keys, its state arrays);
- `plans`: a stateful recipe's plans of a call's operands, and the GEMMs' output scales
  known from them;
- `operands`: quantizing a call's operands with their recipes, and the checks on what a
  recipe returns;
- `dims`: dimension numbers, the backward GEMMs' layout, the sharding of a result;
- `scaled`: a low-precision GEMM's result times its operands' scales (per tensor, per
  row, per block of the contraction);
- `kernels`: which GEMM runs (FP8/int8, block-scaled, per-chunk, emulated), shared by
  the dense, grouped and serving paths;
- `backward`: the backward pass both custom VJPs share (the gradient quantized once, the
  two backward GEMMs each path supplies, the `shard_map` reductions, the new states);
- `dense`: the custom VJP of a `dot_general` (`quantized_dot`);
- `grouped`: the custom VJP of a ragged dot (mixture-of-experts);
- `residuals`: what both custom VJPs keep for the backward pass, low-precision arrays as
  bits (a remat policy that saves residuals would round them);
- `passes`: both custom VJPs' passes, each traced once per signature (a `jax.jit`).

What the ops, serving and the reports use is exported here.
"""

from .call import ROLES as ROLES, Call as Call
from .dense import quantized_dot as quantized_dot
from .dims import (
    DimensionNumbers as DimensionNumbers,
    bwd_layout as bwd_layout,
    check_dimension_numbers as check_dimension_numbers,
    explicitly_sharded as explicitly_sharded,
)
from .grouped import (
    RaggedCall as RaggedCall,
    group_ids as group_ids,
    quantize_tokens as quantize_tokens,
    quantize_weights as quantize_weights,
    ragged_gemm as ragged_gemm,
    ragged_out_dtype as ragged_out_dtype,
    ragged_quantized_dot as ragged_quantized_dot,
)
from .kernels import run_gemm as run_gemm
from .operands import quantize as quantize
from .settings import (
    GEMM_KEYWORDS as GEMM_KEYWORDS,
    SETTINGS_FIELDS as SETTINGS_FIELDS,
    GemmKeywords as GemmKeywords,
    GemmSettings as GemmSettings,
    Mode as Mode,
    SettingsView as SettingsView,
    quantizing_recipe as quantizing_recipe,
    settings_from as settings_from,
    stateful_recipe as stateful_recipe,
)
