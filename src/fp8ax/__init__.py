"""FP8 training for Equinox and Haliax models."""

from importlib.metadata import version as _version

# configuration
from ._config import Fp8Config as Fp8Config
from ._settings import GemmSettings as GemmSettings
from ._recipes import AbstractScalingRecipe as AbstractScalingRecipe, DelayedScaling as DelayedScaling, Operand as Operand
from ._current import (
    AbstractStatelessRecipe as AbstractStatelessRecipe,
    CurrentScaling as CurrentScaling,
    Int8Scaling as Int8Scaling,
    MXScaling as MXScaling,
    quantize as quantize,
)
from ._quantized import QuantizedArray as QuantizedArray

# top level UX
from ._transform import fp8_linear_layers as fp8_linear_layers, strip_fp8 as strip_fp8
from ._state import OverwriteWithGradient as OverwriteWithGradient
from ._update import (
    apply_updates as apply_updates,
    partition_for_grad_overwrite as partition_for_grad_overwrite,
)
from ._accumulate import accumulate_gradients as accumulate_gradients, microbatched as microbatched
from ._distributed import pmean_gradients as pmean_gradients
from ._cast import cast_floating as cast_floating
from ._calibrate import calibrate as calibrate
from ._inspect import GemmReport as GemmReport, gemm_report as gemm_report
from ._report import ConversionReport as ConversionReport, conversion_report as conversion_report
from ._stats import plot_amax_history as plot_amax_history, scaling_stats as scaling_stats

# serving
from ._serving import (
    ServingDotGeneral as ServingDotGeneral,
    ServingHaliaxLinear as ServingHaliaxLinear,
    ServingLinear as ServingLinear,
    serving_template as serving_template,
    to_serving as to_serving,
)
from ._checkpoint import tree_deserialise_leaves as tree_deserialise_leaves

# modules and state
from ._dot_general import Fp8DotGeneral as Fp8DotGeneral
from ._transform import Fp8Linear as Fp8Linear
from ._state import ScalingState as ScalingState

__version__ = _version("fp8ax")
