"""FP8 training for Equinox and Haliax models."""

from importlib.metadata import version as _version

from ._accumulate import accumulate_gradients as accumulate_gradients
from ._accumulate import microbatched as microbatched
from ._accumulation import EmulatedAccumulation as EmulatedAccumulation
from ._blockwise import BlockwiseScaling as BlockwiseScaling
from ._calibrate import calibrate as calibrate
from ._cast import cast_floating as cast_floating
from ._checkpoint import check_checkpoint_metadata as check_checkpoint_metadata
from ._checkpoint import tree_deserialise_leaves as tree_deserialise_leaves

# configuration
from ._config import Fp8Config as Fp8Config
from ._current import (
    AbstractStatelessRecipe as AbstractStatelessRecipe,
)
from ._current import (
    CurrentScaling as CurrentScaling,
)
from ._current import (
    Int8Scaling as Int8Scaling,
)
from ._current import (
    MXScaling as MXScaling,
)
from ._current import (
    quantize as quantize,
)
from ._distributed import pmean_gradients as pmean_gradients

# modules and state
from ._dot_general import Fp8DotGeneral as Fp8DotGeneral
from ._inspect import GemmReport as GemmReport
from ._inspect import gemm_report as gemm_report
from ._nvfp4 import NVFP4Scaling as NVFP4Scaling
from ._quantized import QuantizedArray as QuantizedArray
from ._ragged import Fp8MoELinear as Fp8MoELinear
from ._ragged import Fp8RaggedDot as Fp8RaggedDot
from ._recipes import AbstractScalingRecipe as AbstractScalingRecipe
from ._recipes import DelayedScaling as DelayedScaling
from ._recipes import Operand as Operand
from ._report import ConversionReport as ConversionReport
from ._report import conversion_report as conversion_report
from ._serving import (
    ServingDotGeneral as ServingDotGeneral,
)
from ._serving import (
    ServingHaliaxLinear as ServingHaliaxLinear,
)
from ._serving import (
    ServingLinear as ServingLinear,
)

# serving
from ._serving import ServingMoELinear as ServingMoELinear
from ._serving import ServingRaggedDot as ServingRaggedDot
from ._serving import (
    serving_template as serving_template,
)
from ._serving import (
    to_serving as to_serving,
)
from ._settings import GemmSettings as GemmSettings
from ._state import AbstractState as AbstractState
from ._state import OverwriteWithGradient as OverwriteWithGradient
from ._state import ScalingState as ScalingState
from ._stats import plot_amax_history as plot_amax_history
from ._stats import scaling_stats as scaling_stats
from ._transform import Fp8Linear as Fp8Linear

# top level UX
from ._transform import fp8_linear_layers as fp8_linear_layers
from ._transform import strip_fp8 as strip_fp8
from ._update import (
    apply_updates as apply_updates,
)
from ._update import (
    check_state as check_state,
)
from ._update import (
    partition_for_grad_overwrite as partition_for_grad_overwrite,
)
from ._update import (
    skip_fp8_state as skip_fp8_state,
)

__version__ = _version("fp8ax")
