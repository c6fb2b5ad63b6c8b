# What the other modules ask of a layer, answered by its kind (the registered `LayerKind`s;
# the built-in ones are registered by `fp8ax._kinds` when fp8ax is imported).

from __future__ import annotations

from typing import Any

import jax.tree_util as jtu

from .axes import axis_names, axis_size, haliax_batch_axes, haliax_batch_shape
from .dot_general import Fp8DotGeneral
from .layer_kind import LayerKind, kind_of, layer_kinds, register_layer_kind, serving_kind_of

__all__ = [
    "LayerKind",
    "axis_names",
    "axis_size",
    "fp8_op",
    "haliax_batch_axes",
    "haliax_batch_shape",
    "is_fp8_layer",
    "is_linear",
    "kind_of",
    "layer_features",
    "layer_kinds",
    "path_str",
    "register_layer_kind",
    "serving_kind_of",
]


def is_linear(x: Any) -> bool:
    """A training-time linear layer fp8ax converts or has converted: one a registered
    `LayerKind` recognises, plain or converted."""
    return kind_of(x) is not None


def fp8_op(layer: Any) -> Fp8DotGeneral | None:
    """The FP8 op of a layer fp8ax converted (its `Fp8DotGeneral`, or an `Fp8MoELinear`'s
    `Fp8RaggedDot`), else None."""
    kind = kind_of(layer)
    if kind is None or not kind.is_converted(layer):
        return None
    op = kind.op(layer)
    return op if isinstance(op, Fp8DotGeneral) else None


def is_fp8_layer(layer: Any) -> bool:
    """A layer of a registered kind that is already in low precision (kept as it is)."""
    kind = kind_of(layer)
    return kind is not None and kind.is_converted(layer)


def layer_features(layer) -> tuple[int, int]:
    kind = kind_of(layer)
    if kind is None:
        raise TypeError(f"{type(layer).__name__} is no layer kind fp8ax knows.")
    return kind.features(layer)


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
