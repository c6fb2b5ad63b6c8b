# `haliax.nn.Linear` as a layer kind.

from __future__ import annotations

import dataclasses

from .. import _haliax
from .._model import (
    Fp8DotGeneral,
    LayerKind,
    axis_names,
    axis_size,
    haliax_batch_axes,
    haliax_batch_shape,
    stacked_axes_first,
)
from .._serving import ServingHaliaxLinear


class HaliaxLinearKind(LayerKind):
    """`haliax.nn.Linear`: its `dot_general` becomes an [`fp8ax.Fp8DotGeneral`][] whose
    state carries the layer's stacked axes by name (inside `haliax.nn.Stacked` and
    `BlockSeq`: one state per stacked layer); served as an
    [`fp8ax.ServingHaliaxLinear`][]. A layer with a `dot_general` of its own (Haliax's FP8
    or int8 ops) is kept; `strip` gives Haliax's FP8 back as plain."""

    name = "hax.nn.Linear"

    def is_plain(self, x):
        return _haliax.is_linear(x) and isinstance(x.dot_general, _haliax.haxq().DefaultDotGeneralOp)

    def is_converted(self, x):
        return _haliax.is_linear(x) and not isinstance(x.dot_general, _haliax.haxq().DefaultDotGeneralOp)

    def is_serving(self, x):
        return isinstance(x, ServingHaliaxLinear)

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

    def to_serving(self, layer, freeze):
        haxq = _haliax.haxq()
        if isinstance(layer.dot_general, haxq.Fp8DotGeneralOp | haxq.Int8DotGeneralOp):
            raise ValueError(
                f"Layer `{freeze.path}` uses Haliax's own {type(layer.dot_general).__name__}, which "
                "`fp8ax.to_serving` cannot convert. Convert the model with `fp8ax.fp8_linear_layers` instead of "
                "`haliax.quantization.quantize_linear_layers`."
            )
        op = self.op(layer)
        if op is None:
            return layer  # a `dot_general` of its own: served as it is
        _haliax.require_haliax_matmul("fp8ax.to_serving")
        n_batch = len(stacked_axes_first(layer, ("In", "Out"), freeze.path))
        names = [ax.name for ax in layer.weight.axes]
        # The training call multiplies the weight by the reparametrisation's scale first.
        w = (layer.weight * layer.reparam.active_scale).array
        in_names = axis_names(layer.In)
        contracting = tuple(i for i, n in enumerate(names[n_batch:]) if n in in_names)
        stacked = f"the stacked axes {layer.weight.axes[:n_batch]}"
        weight, serving_op = freeze.dense(op, w, contracting, n_batch, stacked)
        axes = layer.weight.axes
        if serving_op.packed_length is not None:  # FP4: two values per byte along the last axis
            axes = axes[:-1] + (axes[-1].resize(weight.shape[-1]),)
        return ServingHaliaxLinear(_haliax.hax().NamedArray(weight, axes), layer.bias, serving_op, layer.In, layer.Out)
