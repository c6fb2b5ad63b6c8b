"""FP8 training for Equinox and Haliax models."""

from importlib.metadata import version as _version

# top level UX
from ._model import fp8_linear_layers as fp8_linear_layers, strip_fp8 as strip_fp8
from ._update import (
    OptimizerStateWarning as OptimizerStateWarning,
    StateNotWrittenWarning as StateNotWrittenWarning,
    apply_updates as apply_updates,
    check_state as check_state,
    partition_for_grad_overwrite as partition_for_grad_overwrite,
    skip_fp8_state as skip_fp8_state,
)

# isort: split
# configuration
from ._gemm import GemmSettings as GemmSettings
from ._model import Fp8Config as Fp8Config

# isort: split
# recipes
from ._recipes import (
    AbstractScalingRecipe as AbstractScalingRecipe,
    AbstractStatefulRecipe as AbstractStatefulRecipe,
    AbstractStatelessRecipe as AbstractStatelessRecipe,
    Operand as Operand,
    quantize as quantize,
)
from ._recipes.blockwise import BlockwiseScaling as BlockwiseScaling
from ._recipes.current import CurrentScaling as CurrentScaling
from ._recipes.delayed import DelayedScaling as DelayedScaling
from ._recipes.int8 import Int8Scaling as Int8Scaling
from ._recipes.mx import MXScaling as MXScaling
from ._recipes.nvfp4 import NVFP4Scaling as NVFP4Scaling

# isort: split
# modules and state
from ._maxgrad import UnusedLayerWarning as UnusedLayerWarning
from ._model import (
    Fp8DotGeneral as Fp8DotGeneral,
    Fp8Linear as Fp8Linear,
    Fp8MoELinear as Fp8MoELinear,
    Fp8RaggedDot as Fp8RaggedDot,
    LayerKind as LayerKind,
    register_layer_kind as register_layer_kind,
)
from ._quantized import QuantizedArray as QuantizedArray
from ._scaling_state import ScalingState as ScalingState
from ._state import AbstractState as AbstractState, OverwriteWithGradient as OverwriteWithGradient
from ._tensor_core import EmulatedAccumulation as EmulatedAccumulation

# isort: split
# training helpers
from ._calibrate import calibrate as calibrate
from ._cast import cast_floating as cast_floating
from ._checkpoint import (
    check_checkpoint_metadata as check_checkpoint_metadata,
    tree_deserialise_leaves as tree_deserialise_leaves,
)
from ._distributed import pmean_gradients as pmean_gradients
from ._microbatch import accumulate_gradients as accumulate_gradients, microbatched as microbatched
from ._model import compiler_options as compiler_options

# isort: split
# reports
from ._inspect import (
    ConversionReport as ConversionReport,
    GemmReport as GemmReport,
    conversion_report as conversion_report,
    gemm_report as gemm_report,
    plot_amax_history as plot_amax_history,
    scaling_stats as scaling_stats,
)

# isort: split
# serving
from ._serving import (
    ServingDotGeneral as ServingDotGeneral,
    ServingFreezer as ServingFreezer,
    ServingHaliaxLinear as ServingHaliaxLinear,
    ServingLinear as ServingLinear,
    ServingMoELinear as ServingMoELinear,
    ServingRaggedDot as ServingRaggedDot,
    serving_template as serving_template,
    to_serving as to_serving,
)

# isort: split
# layer kinds: the built-in ones register themselves
from . import _kinds as _kinds  # noqa: F401

__version__ = _version("fp8ax")
