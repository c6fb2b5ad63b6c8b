# `haliax.nn.MoELinear` as a layer kind.

from __future__ import annotations

import equinox as eqx

from .. import _haliax
from .._model import Fp8MoELinear, Fp8RaggedDot, LayerKind, axis_size, haliax_batch_shape, stacked_axes_first
from .._serving import ServingMoELinear

_OWN = ("Experts", "In", "Out")


class HaliaxMoEKind(LayerKind):
    """`haliax.nn.MoELinear`, converted to an [`fp8ax.Fp8MoELinear`][] whose grouped GEMM
    is an [`fp8ax.Fp8RaggedDot`][] (one weight state per expert with
    `Fp8Config.per_expert_weights`); served as an [`fp8ax.ServingMoELinear`][]."""

    name = "hax.nn.MoELinear"

    def is_plain(self, x):
        return _haliax.is_moe_linear(x)

    def is_converted(self, x):
        return isinstance(x, Fp8MoELinear)

    def is_serving(self, x):
        return isinstance(x, ServingMoELinear)

    def features(self, layer):
        return axis_size(layer.In), axis_size(layer.Out)

    def stacked_shape(self, layer):
        return haliax_batch_shape(layer, _OWN)

    def convert(self, layer, config):
        names = tuple(getattr(layer, a).name for a in _OWN if _haliax.is_axis(getattr(layer, a)))
        return Fp8MoELinear.from_moe_linear(layer, lambda bs, g: config.make_ragged_dot(bs, g, names))

    def op(self, layer):
        return layer.ragged

    def with_op(self, layer, op):
        return eqx.tree_at(lambda m: m.ragged, layer, op, is_leaf=lambda x: isinstance(x, Fp8RaggedDot))

    def strip(self, layer):
        return layer.to_moe_linear()

    def to_serving(self, layer, freeze):
        own = [layer.Experts, layer.In, layer.Out]
        batch = stacked_axes_first(layer, _OWN, freeze.path)
        w = layer.weight.rearrange((*batch, *own)).array
        stacked = f"the stacked axes {tuple(batch)} and experts {layer.Experts}"
        values, ragged = freeze.grouped(layer.ragged, w, len(batch), stacked)
        axes = tuple(batch) + tuple(own)
        if ragged.packed_length is not None:
            axes = axes[:-1] + (axes[-1].resize(values.shape[-1]),)
        return ServingMoELinear(
            _haliax.hax().NamedArray(values, axes),
            layer.bias,
            ragged,
            layer.Experts,
            layer.In,
            layer.Out,
            layer.use_gmm,
        )

    def report_name(self, layer):
        return "fp8ax.Fp8MoELinear" if isinstance(layer, Fp8MoELinear) else self.name
