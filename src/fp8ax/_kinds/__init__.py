"""The built-in layer kinds, one module each, registered when fp8ax is imported:

- `equinox_linear`: `equinox.nn.Linear` (-> `Fp8Linear`, served as `ServingLinear`);
- `haliax_linear`: `haliax.nn.Linear`, inside `Stacked` and `BlockSeq` too (its
  `dot_general` replaced; served as `ServingHaliaxLinear`);
- `haliax_moe`: `haliax.nn.MoELinear` (-> `Fp8MoELinear`, served as `ServingMoELinear`).

A kind says everything fp8ax needs of its layers (see `fp8ax.LayerKind`), so it sits above
both the model layers and serving. A kind registered later is asked first: these come
last, and a user's kind may claim a subclass of their layers.
"""

from .._model import register_layer_kind
from .equinox_linear import EquinoxLinearKind as EquinoxLinearKind
from .haliax_linear import HaliaxLinearKind as HaliaxLinearKind
from .haliax_moe import HaliaxMoEKind as HaliaxMoEKind

for _kind in (HaliaxMoEKind(), HaliaxLinearKind(), EquinoxLinearKind()):
    register_layer_kind(_kind)
