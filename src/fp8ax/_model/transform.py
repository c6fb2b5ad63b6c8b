from __future__ import annotations

import difflib
from typing import Any, Literal, NamedTuple, TypeVar

import jax.tree_util as jtu

from .config import Fp8Config
from .kinds import LayerKind, is_linear, kind_of, layer_features, path_str

T = TypeVar("T")


class Decision(NamedTuple):
    """What [`fp8ax.fp8_linear_layers`][] does with one linear layer, and why."""

    path: str
    action: Literal["convert", "keep", "skip"]  # keep: already low precision, left as it is
    reason: str
    selected: bool  # whether `config.targets` selects it


def decide(path: str, layer: Any, config: Fp8Config) -> Decision:
    """The one rule of the transform, for the linear layer `layer` at dotted `path`:
    [`fp8ax.fp8_linear_layers`][] and [`fp8ax.conversion_report`][] both ask it."""
    selected = config.matches(path, layer)
    kind = kind_of(layer)
    if kind is not None and kind.is_converted(layer):
        return Decision(path, "keep", kind.kept_reason(layer), selected)
    if not selected:
        return Decision(path, "skip", "not selected by `targets`", False)
    fin, fout = layer_features(layer)
    if min(fin, fout) < config.min_features:
        side = "input" if fin <= fout else "output"
        return Decision(path, "skip", f"{side} size {min(fin, fout)} < `min_features` ({config.min_features})", True)
    return Decision(
        path, "convert", "selected by `targets`" if config.targets is not None else "every linear layer", True
    )


def _converted(kind: LayerKind, node, config: Fp8Config, path: str):
    """`node` converted by its kind, its op's state labelled with the layer's path (see
    `fp8ax.UnusedLayerWarning`)."""
    layer = kind.convert(node, config)
    op = kind.op(layer)
    if op is None:
        raise TypeError(f"{type(kind).__name__}.convert gave a layer without an op (`op` returned None).")
    return kind.with_op(layer, op._labelled(path))


def fp8_linear_layers(module: T, config: Fp8Config | None = None) -> T:
    """Replaces the matmuls in linear layers with [`fp8ax.Fp8DotGeneral`][].

    Converts `haliax.nn.Linear` (its `dot_general` is replaced), the layers inside
    `haliax.nn.Stacked` and `haliax.nn.BlockSeq` (each stacked layer gets its own state:
    the state arrays carry the `Block` axis as a leading dimension) and
    `equinox.nn.Linear`, also inside `equinox.nn.MLP` (replaced by an
    [`fp8ax.Fp8Linear`][] that keeps its `weight` and `bias`).

    Layers that are already FP8 are left as they are, state included, so converting twice
    changes nothing. A `haliax.nn.Linear` that already has a custom `dot_general` (Haliax's
    own FP8 or int8 ops) is left alone as well.

    **Arguments:**

    - `module`: any PyTree holding linear layers.
    - `config`: an [`fp8ax.Fp8Config`][]; default `Fp8Config()` (every linear layer).

    **Returns:**

    A new tree; `module` itself is not modified.

    **Raises:**

    `ValueError` if `module` holds no linear layer, or if `config.targets` is given and
    selects none of them (the message lists the paths that exist). `RuntimeError` if
    it converts a `haliax.nn.Linear` and the installed Haliax cannot run a named-axis
    matmul on the installed JAX (the message says which versions to install).

    !!! Example

        ```python
        model = fp8ax.fp8_linear_layers(model)
        model = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(targets=["up_proj"]))
        ```
    """
    if config is None:
        config = Fp8Config()
    if not isinstance(config, Fp8Config):
        raise TypeError(f"`config` must be an `fp8ax.Fp8Config`, got {type(config).__name__}.")

    decisions: list[Decision] = []

    def convert(path, node):
        kind = kind_of(node)
        if kind is None:
            return node
        d = decide(path_str(path), node, config)
        decisions.append(d)
        return _converted(kind, node, config, d.path) if d.action == "convert" else node

    out = jtu.tree_map_with_path(convert, module, is_leaf=is_linear)
    problem = config_problem(module, config, decisions)
    if problem is not None:
        raise ValueError(problem)
    return out


def config_problem(module: Any, config: Fp8Config, decisions: list[Decision]) -> str | None:
    """Why `fp8_linear_layers(module, config)` would convert nothing or ignore part of
    `config` (the message it raises), or None if all is well."""
    seen = [d.path for d in decisions]
    if not seen:
        return (
            "`fp8_linear_layers` found no linear layer (`haliax.nn.Linear` or `equinox.nn.Linear`) in `module` "
            f"(a {type(module).__name__})."
        )
    selected = sum(d.selected for d in decisions)
    if selected == 0:
        shown = ", ".join(repr(p) for p in seen[:8]) + (", ..." if len(seen) > 8 else "")
        return (
            f"`config.targets` ({config.targets!r}) matches none of the {len(seen)} linear layers. "
            f"Their paths: {shown}. A list entry matches a path that equals it or ends with '.' + entry; a "
            "string must re.fullmatch the whole path."
        )
    if isinstance(config.targets, tuple):
        unmatched = [name for name in config.targets if not any(p == name or p.endswith("." + name) for p in seen)]
        if unmatched:
            return _unmatched_targets_message(unmatched, seen)
    if not any(d.selected and d.action != "skip" for d in decisions):
        return (
            f"`config.min_features` ({config.min_features}) skips all {selected} selected linear layers (each has "
            "an input or output smaller than that), so nothing was converted. Lower `min_features`."
        )
    return None


def _unmatched_targets_message(unmatched: list[str], paths: list[str]) -> str:
    # Close matches among the paths and their dotted suffixes ("linear1" for "linear_1").
    candidates = sorted({".".join(p.split(".")[i:]) for p in paths for i in range(len(p.split(".")))})
    lines = []
    for name in unmatched:
        close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
        lines.append(f"{name!r}" + (f" (close: {', '.join(repr(c) for c in close)})" if close else ""))
    return (
        f"`config.targets` entries {', '.join(lines)} match none of the {len(paths)} linear layers; every entry of a "
        "list must match at least one layer (a misspelt name would silently leave its layer unconverted). A list "
        "entry matches a path that equals it or ends with '.' + entry."
    )


def strip_fp8(module: T) -> T:
    """Undoes [`fp8ax.fp8_linear_layers`][]: plain linear layers with the same weights.

    Every [`fp8ax.Fp8Linear`][] becomes the `equinox.nn.Linear` it was built from, and
    every `haliax.nn.Linear` whose `dot_general` is an [`fp8ax.Fp8DotGeneral`][] (or
    Haliax's own `Fp8DotGeneralOp`) gets Haliax's default `dot_general` back. Weights and
    biases are the same arrays; the FP8 state is dropped. Everything else is untouched,
    and a tree with nothing to strip is returned as it is.

    **Arguments:**

    - `module`: any PyTree, typically a model converted by [`fp8ax.fp8_linear_layers`][].

    **Returns:**

    The model with plain, high-precision linear layers. Its PyTree structure is that of
    the model before conversion, so a checkpoint of the unconverted model loads into it
    with `eqx.tree_deserialise_leaves`.
    """

    def converted(x):
        kind = kind_of(x)
        return kind is not None and kind.is_converted(x)

    def strip(node):
        if not converted(node):
            return node
        kind = kind_of(node)
        assert kind is not None
        return kind.strip(node)

    return jtu.tree_map(strip, module, is_leaf=converted)
