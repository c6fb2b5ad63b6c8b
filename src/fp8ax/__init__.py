"""FP8 training for Equinox and Haliax models."""

from importlib.metadata import version as _version

from ._accumulate import accumulate_gradients as accumulate_gradients, microbatched as microbatched
from ._accumulation import EmulatedAccumulation as EmulatedAccumulation
from ._blockwise import BlockwiseScaling as BlockwiseScaling
from ._calibrate import calibrate as calibrate
from ._cast import cast_floating as cast_floating
from ._checkpoint import (
    check_checkpoint_metadata as check_checkpoint_metadata,
    tree_deserialise_leaves as tree_deserialise_leaves,
)

# configuration
from ._config import Fp8Config as Fp8Config
from ._current import (
    AbstractStatelessRecipe as AbstractStatelessRecipe,
    CurrentScaling as CurrentScaling,
    Int8Scaling as Int8Scaling,
    MXScaling as MXScaling,
    quantize as quantize,
)
from ._distributed import pmean_gradients as pmean_gradients

# modules and state
from ._dot_general import Fp8DotGeneral as Fp8DotGeneral
from ._inspect import GemmReport as GemmReport, gemm_report as gemm_report
from ._nvfp4 import NVFP4Scaling as NVFP4Scaling
from ._quantized import QuantizedArray as QuantizedArray
from ._ragged import Fp8MoELinear as Fp8MoELinear, Fp8RaggedDot as Fp8RaggedDot
from ._recipes import (
    AbstractScalingRecipe as AbstractScalingRecipe,
    DelayedScaling as DelayedScaling,
    Operand as Operand,
)
from ._report import ConversionReport as ConversionReport, conversion_report as conversion_report

# serving
from ._serving import (
    ServingDotGeneral as ServingDotGeneral,
    ServingHaliaxLinear as ServingHaliaxLinear,
    ServingLinear as ServingLinear,
    ServingMoELinear as ServingMoELinear,
    ServingRaggedDot as ServingRaggedDot,
    serving_template as serving_template,
    to_serving as to_serving,
)
from ._settings import GemmSettings as GemmSettings
from ._state import (
    AbstractState as AbstractState,
    OverwriteWithGradient as OverwriteWithGradient,
    ScalingState as ScalingState,
)
from ._stats import plot_amax_history as plot_amax_history, scaling_stats as scaling_stats

# top level UX
from ._transform import Fp8Linear as Fp8Linear, fp8_linear_layers as fp8_linear_layers, strip_fp8 as strip_fp8
from ._update import (
    apply_updates as apply_updates,
    check_state as check_state,
    partition_for_grad_overwrite as partition_for_grad_overwrite,
    skip_fp8_state as skip_fp8_state,
)

__version__ = _version("fp8ax")
