# `haliax.nn.Linear` as a layer kind: its `dot_general` is replaced (inside
# `haliax.nn.Stacked` and `BlockSeq` too: one state per stacked layer, on named axes); and
# the named-axis helpers the Haliax kinds share.

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import haliax.nn as hnn

from .. import _haliax
from .dot_general import Fp8DotGeneral
from .layer_kind import LayerKind


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


def haliax_batch_shape(layer: hnn.Linear) -> tuple[int, ...]:
    """`haliax_batch_axes`' sizes."""
    return tuple(size for _, size in haliax_batch_axes(layer))


class HaliaxLinearKind(LayerKind):
    """`haliax.nn.Linear`: its `dot_general` becomes an [`fp8ax.Fp8DotGeneral`][] whose
    state carries the layer's stacked axes by name. A layer with a `dot_general` of its
    own (Haliax's FP8 or int8 ops) is kept; `strip` gives Haliax's FP8 back as plain."""

    name = "hax.nn.Linear"

    def is_plain(self, x):
        return _haliax.is_linear(x) and isinstance(x.dot_general, _haliax.haxq().DefaultDotGeneralOp)

    def is_converted(self, x):
        return _haliax.is_linear(x) and not isinstance(x.dot_general, _haliax.haxq().DefaultDotGeneralOp)

    def features(self, layer):
        return axis_size(layer.In), axis_size(layer.Out)

    def stacked_shape(self, layer):
        return haliax_batch_shape(layer)

    def convert(self, layer, config):
        _haliax.require_haliax_matmul("fp8ax.fp8_linear_layers")
        own = axis_names(layer.In) | axis_names(layer.Out)
        rhs_axes = tuple(ax.name for ax in layer.weight.axes if ax.name in own)
        op = config.make_dot_general(haliax_batch_shape(layer), rhs_axes)
        return dataclasses.replace(layer, dot_general=op._with_named_state(haliax_batch_axes(layer)))

    def op(self, layer):
        return layer.dot_general if isinstance(layer.dot_general, Fp8DotGeneral) else None

    def with_op(self, layer, op):
        return dataclasses.replace(layer, dot_general=op)

    def strip(self, layer):
        if isinstance(layer.dot_general, Fp8DotGeneral | _haliax.haxq().Fp8DotGeneralOp):
            return dataclasses.replace(layer, dot_general=_haliax.haxq().DotGeneralOp.default())
        return layer

    def kept_reason(self, layer):
        if self.op(layer) is None:
            return f"has its own dot_general ({type(layer.dot_general).__name__}); left as it is"
        return super().kept_reason(layer)
