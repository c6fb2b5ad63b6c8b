"""The ops and the model layers: what a converted model is made of, and the transform.

- `dot_general`: `Fp8DotGeneral`, the FP8 drop-in for `jax.lax.dot_general`, with its
  state; `ragged_dot`: `Fp8RaggedDot`, the one for `jax.lax.ragged_dot`; `advice`: the
  one-time warning about GPU compile time, and `compiler_options`, what avoids it;
- `config`: `Fp8Config`, which builds the ops for each layer;
- `linear`: `Fp8Linear` (Equinox); `moe`: `Fp8MoELinear` (Haliax mixture of experts);
- `layer_kind`: `LayerKind`, what a kind of layer tells fp8ax, and the one list of kinds
  (the built-in kinds are in `fp8ax._kinds`, above serving); `kinds`: the other modules'
  questions about a layer, answered by its kind; `axes`: the named-axis helpers;
- `transform`: `fp8_linear_layers`, `strip_fp8`, and the decision per layer.

This is the one unit besides the `_haliax` door that imports Haliax, at run time.
"""

from .advice import advise_gpu_compile as advise_gpu_compile, compiler_options as compiler_options
from .axes import (
    axis_names as axis_names,
    haliax_batch_axes as haliax_batch_axes,
    stacked_axes_first as stacked_axes_first,
)
from .config import Fp8Config as Fp8Config
from .dot_general import (
    Fp8DotGeneral as Fp8DotGeneral,
    check_explicit_sharding as check_explicit_sharding,
    check_operand as check_operand,
    check_reduction_order as check_reduction_order,
    make_call as make_call,
    with_out_sharding as with_out_sharding,
)
from .kinds import (
    LayerKind as LayerKind,
    axis_size as axis_size,
    fp8_op as fp8_op,
    haliax_batch_shape as haliax_batch_shape,
    is_linear as is_linear,
    kind_of as kind_of,
    layer_features as layer_features,
    layer_kinds as layer_kinds,
    path_str as path_str,
    register_layer_kind as register_layer_kind,
    serving_kind_of as serving_kind_of,
)
from .linear import Fp8Linear as Fp8Linear, linear_call as linear_call
from .moe import Fp8MoELinear as Fp8MoELinear, moe_call as moe_call
from .ragged_dot import Fp8RaggedDot as Fp8RaggedDot
from .transform import (
    Decision as Decision,
    config_problem as config_problem,
    decide as decide,
    fp8_linear_layers as fp8_linear_layers,
    strip_fp8 as strip_fp8,
)
