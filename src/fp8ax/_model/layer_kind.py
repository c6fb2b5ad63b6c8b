# What a kind of layer tells fp8ax (`LayerKind`), and the one list of kinds the transform,
# `strip_fp8`, the reports and the checkpoint helpers iterate.

from __future__ import annotations

from typing import Any

from .config import Fp8Config
from .dot_general import Fp8DotGeneral


class LayerKind:
    """A kind of linear-like layer that [`fp8ax.fp8_linear_layers`][] converts.

    fp8ax knows `equinox.nn.Linear`, `haliax.nn.Linear` (inside `haliax.nn.Stacked` and
    `haliax.nn.BlockSeq` too) and `haliax.nn.MoELinear`, each as a `LayerKind`; a layer of
    your own whose matmul can be an [`fp8ax.Fp8DotGeneral`][] becomes convertible by
    subclassing this and passing an instance to [`fp8ax.register_layer_kind`][]. The
    transform, [`fp8ax.strip_fp8`][], [`fp8ax.conversion_report`][],
    [`fp8ax.scaling_stats`][], [`fp8ax.calibrate`][] and the checkpoint helpers then treat
    it as they treat the built-in kinds.

    A subclass implements `is_plain`, `is_converted`, `features`, `convert`, `op`,
    `with_op` and `strip`; for [`fp8ax.to_serving`][], `is_serving` and `to_serving`;
    `name`, `stacked_shape`, `kept_reason` and `report_name` have defaults.
    fp8ax labels the op's state with the layer's path itself (for
    [`fp8ax.UnusedLayerWarning`][]), through `op` and `with_op`.

    A whole kind, registered, trained and served, is on the "Choosing layers" page of the
    docs ("Your own kind of layer").
    """

    # The kind's name in reports ([`fp8ax.conversion_report`][]'s `kind` column).
    name: str = ""

    def is_plain(self, x: Any) -> bool:
        """Whether `x` is a layer of this kind that fp8ax can convert (in high precision)."""
        raise NotImplementedError(f"{type(self).__name__} must implement `is_plain`.")

    def is_converted(self, x: Any) -> bool:
        """Whether `x` is a layer of this kind already in low precision: converted by fp8ax
        (`op(x)` is its [`fp8ax.Fp8DotGeneral`][]) or by other means (see `kept_reason`).
        Such a layer is kept as it is."""
        raise NotImplementedError(f"{type(self).__name__} must implement `is_converted`.")

    def features(self, layer: Any) -> tuple[int, int]:
        """`(input size, output size)` of one layer (for `Fp8Config.min_features` and the
        report): the contracted length and the output length of its matmul."""
        raise NotImplementedError(f"{type(self).__name__} must implement `features`.")

    def stacked_shape(self, layer: Any) -> tuple[int, ...]:
        """The dimensions of `layer`'s weight that stack several layers (each gets its own
        state), for the report. The default: the weight's dimensions before its last two."""
        return tuple(int(d) for d in layer.weight.shape[:-2])

    def convert(self, layer: Any, config: Fp8Config) -> Any:
        """`layer` with its matmul done by an op `config` builds
        (`config.make_dot_general(batch_shape)`, one state per stacked layer)."""
        raise NotImplementedError(f"{type(self).__name__} must implement `convert`.")

    def op(self, layer: Any) -> Fp8DotGeneral | None:
        """The [`fp8ax.Fp8DotGeneral`][] of a converted `layer` (None for a layer made low
        precision by other means)."""
        raise NotImplementedError(f"{type(self).__name__} must implement `op`.")

    def with_op(self, layer: Any, op: Any) -> Any:
        """A converted `layer` with `op` in place of its op: an [`fp8ax.Fp8DotGeneral`][]
        (its own, relabelled), or a callable with `dot_general`'s signature that wraps it
        ([`fp8ax.scaling_stats`][] observes the layer's operands through one)."""
        raise NotImplementedError(f"{type(self).__name__} must implement `with_op`.")

    def strip(self, layer: Any) -> Any:
        """The plain layer a converted `layer` was made from, with the same weights (the
        inverse of `convert`, for [`fp8ax.strip_fp8`][]). A layer made low precision by
        other means may be returned as it is."""
        raise NotImplementedError(f"{type(self).__name__} must implement `strip`.")

    def is_serving(self, x: Any) -> bool:
        """Whether `x` is the serving form of a layer of this kind (what `to_serving` made
        of one). The default: no serving form."""
        return False

    def to_serving(self, layer: Any, freeze: Any) -> Any:
        """The serving form of a converted `layer` (see [`fp8ax.to_serving`][]): its weight
        quantized once and stored through `freeze`, a [`fp8ax.ServingFreezer`][], whose
        `dense` gives the stored values and the [`fp8ax.ServingDotGeneral`][] that serves
        them (a drop-in for the layer's op, called with the stored values where the layer
        passed its weight).

        The default serves a layer made low precision by other means (no `op`) as it is,
        and refuses an fp8ax-converted one, naming it: a kind serves its layers only if it
        says how."""
        if self.op(layer) is None:
            return layer
        raise ValueError(
            f"Layer `{freeze.path}` is a converted {self.report_name(layer)} (layer kind {self!r}), which does not "
            "say how to serve it (`LayerKind.to_serving`), so `fp8ax.to_serving` cannot freeze it. Keep that layer "
            "out of the conversion (`Fp8Config.targets`) to serve the model, or serve it from the training model."
        )

    def kept_reason(self, layer: Any) -> str:
        """Why a converted `layer` is kept, for the report."""
        if self.op(layer) is not None:
            return "already FP8 (fp8ax); its state is kept"
        return "already in low precision; left as it is"

    def report_name(self, layer: Any) -> str:
        """The layer's kind as the report shows it: `name`, or the layer's class name."""
        return self.name or type(layer).__name__

    # Two kinds of the same class and settings are the same kind.
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_KINDS: list[LayerKind] = []


def register_layer_kind(kind: LayerKind) -> LayerKind:
    """Makes fp8ax convert the layers `kind` recognises (see [`fp8ax.LayerKind`][]).

    Kinds registered later are asked first, so a kind may claim a subclass of a layer a
    built-in kind converts. Registering the same kind (an equal object) again does
    nothing.

    **Arguments:**

    - `kind`: a [`fp8ax.LayerKind`][] instance.

    **Returns:**

    `kind`.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"`kind` must be an `fp8ax.LayerKind` instance, got {type(kind).__name__}.")
    if kind not in _KINDS:
        _KINDS.insert(0, kind)
    return kind


def layer_kinds() -> tuple[LayerKind, ...]:
    """The registered kinds, in the order they are asked."""
    return tuple(_KINDS)


def serving_kind_of(x: Any) -> LayerKind | None:
    """The kind whose serving form `x` is, or None."""
    for kind in _KINDS:
        if kind.is_serving(x):
            return kind
    return None


def kind_of(x: Any) -> LayerKind | None:
    """The kind of layer `x` (plain or converted), or None if `x` is no layer fp8ax knows."""
    for kind in _KINDS:
        if kind.is_plain(x) or kind.is_converted(x):
            return kind
    return None
