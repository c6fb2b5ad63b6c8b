"""Serving: FP8 layers with their weights quantized once and stored in low precision.

- `codec`: how quantized values are stored so that checkpoints can save them;
- `ops`: the serving GEMMs (`ServingDotGeneral`, `ServingRaggedDot`), the training
  forward's own GEMM on the stored weight;
- `layers`: the serving layers (`ServingLinear`, `ServingHaliaxLinear`,
  `ServingMoELinear`);
- `convert`: `to_serving`, `serving_template`, and `ServingFreezer`, what a layer kind's
  `to_serving` freezes its weight with.
"""

from .convert import ServingFreezer as ServingFreezer, serving_template as serving_template, to_serving as to_serving
from .layers import (
    ServingHaliaxLinear as ServingHaliaxLinear,
    ServingLinear as ServingLinear,
    ServingMoELinear as ServingMoELinear,
    is_serving_layer as is_serving_layer,
)
from .ops import ServingDotGeneral as ServingDotGeneral, ServingRaggedDot as ServingRaggedDot
