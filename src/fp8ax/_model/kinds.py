# The kinds of layer fp8ax knows, in one place: which layers are linear (and so
# convertible), which are FP8 already, and their features and stacked shapes.

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax.tree_util as jtu

if TYPE_CHECKING:
    import haliax.nn as hnn

from .. import _haliax
from .dot_general import Fp8DotGeneral
from .linear import Fp8Linear
from .moe import Fp8MoELinear


def is_linear(x: Any) -> bool:
    """A training-time linear layer fp8ax converts or has converted: `equinox.nn.Linear`,
    `haliax.nn.Linear`, `haliax.nn.MoELinear`, `Fp8Linear`, `Fp8MoELinear`."""
    return isinstance(x, eqx.nn.Linear | Fp8Linear | Fp8MoELinear) or _haliax.is_linear(x) or _haliax.is_moe_linear(x)


def fp8_op(layer: Any) -> Fp8DotGeneral | None:
    """The FP8 op of a layer fp8ax converted (its `Fp8DotGeneral`, or an `Fp8MoELinear`'s
    `Fp8RaggedDot`), else None."""
    if isinstance(layer, Fp8Linear):
        return layer.dot_general
    if isinstance(layer, Fp8MoELinear):
        return layer.ragged
    if _haliax.is_linear(layer) and isinstance(layer.dot_general, Fp8DotGeneral):
        return layer.dot_general
    return None


def is_fp8_layer(layer: Any) -> bool:
    if isinstance(layer, Fp8Linear | Fp8MoELinear):
        return True
    if not _haliax.is_linear(layer):
        return False
    return not isinstance(layer.dot_general, _haliax.haxq().DefaultDotGeneralOp)


def axis_size(spec) -> int:
    if _haliax.is_axis(spec):
        return spec.size
    return math.prod(a.size for a in spec)


def axis_names(spec) -> set[str]:
    if _haliax.is_axis(spec):
        return {spec.name}
    return {a.name for a in spec}


def layer_features(layer) -> tuple[int, int]:
    if _is_haliax_layer(layer):
        return axis_size(layer.In), axis_size(layer.Out)
    fin = 1 if layer.in_features == "scalar" else layer.in_features
    fout = 1 if layer.out_features == "scalar" else layer.out_features
    return fin, fout


def _is_haliax_layer(layer) -> bool:
    return isinstance(layer, Fp8MoELinear) or _haliax.is_linear(layer) or _haliax.is_moe_linear(layer)


def haliax_batch_shape(layer: hnn.Linear | hnn.MoELinear | Fp8MoELinear) -> tuple[int, ...]:
    # Axes of the weight that are neither In nor Out (nor a mixture of experts' Experts):
    # the Block axes added by `haliax.nn.Stacked` (or an ensemble axis): one FP8 state per
    # stacked layer.
    return tuple(size for _, size in haliax_batch_axes(layer))


def haliax_batch_axes(layer: hnn.Linear | hnn.MoELinear | Fp8MoELinear) -> tuple[tuple[str, int], ...]:
    """`haliax_batch_shape` with the axes' names: `(name, size)` pairs."""
    own = axis_names(layer.In) | axis_names(layer.Out)
    if isinstance(layer, Fp8MoELinear) or _haliax.is_moe_linear(layer):
        own |= axis_names(layer.Experts)
    return tuple((ax.name, ax.size) for ax in layer.weight.axes if ax.name not in own)


def path_str(path) -> str:
    """Dotted form of a JAX key path: `blocks.stacked.mlp.up_proj`, `layers.0`."""
    parts = []
    for k in path:
        if isinstance(k, jtu.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jtu.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jtu.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jtu.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)
