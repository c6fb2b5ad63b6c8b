"""Reports on a model or a program, for users: nothing here changes what is computed.

- `conversions`: `conversion_report`, what `fp8_linear_layers` converts, skips and
  cannot convert;
- `gemms`: `gemm_report`, which matmuls of a lowered and compiled program really run in
  FP8;
- `stats`: `scaling_stats`, the scaling state and the tensors' saturation and underflow
  as a flat dict for logging; `plot`: `plot_amax_history`.
"""

from .conversions import ConversionReport as ConversionReport, conversion_report as conversion_report
from .gemms import GemmReport as GemmReport, gemm_report as gemm_report
from .plot import plot_amax_history as plot_amax_history
from .stats import scaling_stats as scaling_stats
