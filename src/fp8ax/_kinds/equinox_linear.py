# `equinox.nn.Linear` as a layer kind.

import equinox as eqx

from .._model import Fp8DotGeneral, Fp8Linear, LayerKind
from .._serving import ServingLinear


class EquinoxLinearKind(LayerKind):
    """`equinox.nn.Linear` (also inside `equinox.nn.MLP`, and ensembles built with
    `eqx.filter_vmap`: one state per member), converted to an [`fp8ax.Fp8Linear`][] and
    served as an [`fp8ax.ServingLinear`][]."""

    name = "eqx.nn.Linear"

    def is_plain(self, x):
        return isinstance(x, eqx.nn.Linear)

    def is_converted(self, x):
        return isinstance(x, Fp8Linear)

    def is_serving(self, x):
        return isinstance(x, ServingLinear)

    def features(self, layer):
        fin = 1 if layer.in_features == "scalar" else layer.in_features
        fout = 1 if layer.out_features == "scalar" else layer.out_features
        return fin, fout

    def convert(self, layer, config):
        return Fp8Linear.from_linear(layer, config)

    def op(self, layer):
        return layer.dot_general

    def with_op(self, layer, op):
        # (`is_leaf`: a traced op's leaves are fresh views, which `tree_at` must not look into.)
        return eqx.tree_at(lambda m: m.dot_general, layer, op, is_leaf=lambda x: isinstance(x, Fp8DotGeneral))

    def strip(self, layer):
        return layer.to_linear()

    def to_serving(self, layer, freeze):
        # The training call contracts the input with the weight's axis 1 (`(out, in)`).
        weight, op = freeze.dense(layer.dot_general, layer.weight, (1,), layer.weight.ndim - 2)
        return ServingLinear(weight, layer.bias, op, layer.in_features, layer.out_features, layer.use_bias)

    def report_name(self, layer):
        return "fp8ax.Fp8Linear" if isinstance(layer, Fp8Linear) else self.name
