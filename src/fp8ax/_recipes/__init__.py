"""Scaling recipes: how one operand of a GEMM is quantized, and the state that needs.

- `base`: the recipe interface the GEMM pipeline calls (`AbstractScalingRecipe`,
  `Operand`), and the base of recipes that keep state (`AbstractStatefulRecipe`: the
  state's members); `stateless`: the base of recipes that keep no state, with the checks
  and scale rules they share.
- One module per recipe: `delayed`, `current`, `mx`, `int8`, `blockwise`, `nvfp4`. A
  recipe imports the base and the numerics modules, never another recipe, and only the
  package's public `__init__` and the default setting (`DelayedScaling`, in the GEMM
  settings) import a concrete recipe: adding one touches its module, one line of the
  public `__init__`, its test registry entry, its tests and its docs section.
- `applied`: the public `fp8ax.quantize`, a recipe applied outside any GEMM.

The interface the rest of fp8ax uses is exported here.
"""

from .applied import quantize as quantize
from .base import (
    AbstractScalingRecipe as AbstractScalingRecipe,
    AbstractStatefulRecipe as AbstractStatefulRecipe,
    NewState as NewState,
    Operand as Operand,
)
from .stateless import AbstractStatelessRecipe as AbstractStatelessRecipe
