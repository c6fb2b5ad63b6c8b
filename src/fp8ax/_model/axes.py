# The named-axis helpers the Haliax layer kinds share: an axis spec's size and names, and
# the stacked axes of a layer's weight (one FP8 state per stacked layer).

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import haliax.nn as hnn

from .. import _haliax


def axis_size(spec) -> int:
    if _haliax.is_axis(spec):
        return spec.size
    return math.prod(a.size for a in spec)


def axis_names(spec) -> set[str]:
    if _haliax.is_axis(spec):
        return {spec.name}
    return {a.name for a in spec}


def haliax_batch_axes(layer, own: tuple[str, ...] = ("In", "Out")) -> tuple[tuple[str, int], ...]:
    """The axes of a Haliax layer's weight that are none of its `own` axis fields (`In`
    and `Out`, and a mixture of experts' `Experts`): the `Block` axes added by
    `haliax.nn.Stacked` (or an ensemble axis), one FP8 state per stacked layer, as
    `(name, size)` pairs."""
    names = set().union(*(axis_names(getattr(layer, a)) for a in own))
    return tuple((ax.name, ax.size) for ax in layer.weight.axes if ax.name not in names)


def haliax_batch_shape(layer: hnn.Linear, own: tuple[str, ...] = ("In", "Out")) -> tuple[int, ...]:
    """`haliax_batch_axes`' sizes."""
    return tuple(size for _, size in haliax_batch_axes(layer, own))


def stacked_axes_first(layer, own: tuple[str, ...], path: str) -> tuple:
    """The stacked axes of a Haliax layer's weight (as in `haliax_batch_axes`, the `Axis`
    objects), checked to come first, as `haliax.nn.Stacked` puts them: what
    `fp8ax.to_serving` needs to freeze one weight per stacked layer. `path` names the
    layer in the error."""
    names = set().union(*(axis_names(getattr(layer, a)) for a in own))
    axes = tuple(layer.weight.axes)
    batch = tuple(ax for ax in axes if ax.name not in names)
    if axes[: len(batch)] != batch:
        raise ValueError(
            f"Layer `{path}`: the stacked axes of its weight {layer.weight.axes} must come first (as "
            "`haliax.nn.Stacked` puts them) for `fp8ax.to_serving`."
        )
    return batch
