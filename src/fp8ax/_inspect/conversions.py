# What `fp8_linear_layers` converts, skips and cannot convert, as a table. The decisions
# come from `_model.transform.decide`, the rule the transform itself follows.

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import equinox as eqx
import jax.tree_util as jtu

from .. import _haliax
from .._model import (
    Fp8Config,
    axis_size,
    config_problem,
    decide,
    is_linear,
    kind_of,
    layer_features,
    path_str,
)

Action = Literal["convert", "keep", "skip", "unsupported"]

_RECURRENT = "a recurrent cell: its matmuls are written inside the cell, not as linear layers"
_CONV = "a convolution: fp8ax converts linear layers only"
_CONV_T = "a transposed convolution: fp8ax converts linear layers only"


Sizes = Callable[[Any], tuple[int | None, int | None]]


def _sizes(a: str, b: str) -> Sizes:
    """The report's sizes of a layer that is not converted: its fields `a` and `b` (ints,
    or Haliax axis specs)."""

    def sizes(layer) -> tuple[int | None, int | None]:
        out = []
        for spec in (getattr(layer, a, None), getattr(layer, b, None)):
            if isinstance(spec, int):
                out.append(spec)
            elif isinstance(spec, tuple) or _haliax.is_axis(spec):
                out.append(axis_size(spec))
            else:
                out.append(None)
        return out[0], out[1]

    return sizes


# The layers fp8ax leaves alone, for the report: each with why and its sizes. They are not
# linear-like (no `LayerKind` converts them). `MultiheadAttention` is listed apart: its
# projections are linear layers (converted), the attention-score matmuls are not.
_EQX_NOT_CONVERTED: tuple[tuple[type, str, Sizes], ...] = (
    (eqx.nn.Conv, _CONV, _sizes("in_channels", "out_channels")),
    (eqx.nn.ConvTranspose, _CONV_T, _sizes("in_channels", "out_channels")),
    (eqx.nn.GRUCell, _RECURRENT, _sizes("input_size", "hidden_size")),
    (eqx.nn.LSTMCell, _RECURRENT, _sizes("input_size", "hidden_size")),
    (eqx.nn.Embedding, "a lookup (gather), not a matmul", _sizes("num_embeddings", "embedding_size")),
)


def _not_converted() -> tuple[tuple[type, str, Sizes], ...]:
    if not _haliax.loaded():
        return _EQX_NOT_CONVERTED
    hnn = _haliax.hnn()
    return _EQX_NOT_CONVERTED + (
        (hnn.Conv, _CONV, _sizes("In", "Out")),
        (hnn.ConvTranspose, _CONV_T, _sizes("In", "Out")),
        (
            hnn.Embedding,
            "a lookup, not a matmul (its `unembed`, as a tied output head, stays in high precision)",
            _sizes("Vocab", "Embed"),
        ),
    )


_ATTENTION = (
    "its q/k/v/output projections are linear layers (rows below); the attention-score matmuls "
    "(q.k and weights.v) stay in high precision"
)


@dataclasses.dataclass(frozen=True)
class LayerConversion:
    """One row of a [`fp8ax.ConversionReport`][]."""

    path: str
    kind: str
    in_features: int | None
    out_features: int | None
    stacked: tuple[int, ...]
    action: Action
    reason: str


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What [`fp8ax.fp8_linear_layers`][] does to a model, layer by layer: the table that
    [`fp8ax.conversion_report`][] returns. `print(report)` shows it.

    - `layers`: one `LayerConversion` per layer, in the model's order, with
        - `path`: the dotted path that `Fp8Config(targets=...)` matches (`blocks.stacked.mlp.up_proj`, `layers.0`);
        - `kind`: the layer's class (`eqx.nn.Linear`, `hax.nn.Linear`, `eqx.nn.Conv2d`, ...);
        - `in_features`, `out_features`: its input and output sizes (the product of the
          axes for a Haliax layer with several; channels for a convolution), or None;
        - `stacked`: the leading shape of a layer inside `haliax.nn.Stacked` or an
          ensemble (one FP8 state each), `()` otherwise;
        - `action`: `"convert"` (becomes FP8), `"keep"` (already FP8 or holding its own
          `dot_general`, left as it is), `"skip"` (a linear layer that `targets` or
          `min_features` leaves out) or `"unsupported"` (a kind fp8ax does not convert);
        - `reason`: why, in words.
    - `problem`: the error message `fp8_linear_layers` would raise with this config (a
      `targets` entry that matches nothing, everything skipped, no linear layer at all),
      or None.
    - `config`: the [`fp8ax.Fp8Config`][] the decisions were made with.

    Matmuls that are not layers (`hax.dot`, `jnp.einsum`, attention scores) do not show
    here; [`fp8ax.gemm_report`][] lists every matmul of a compiled step.
    """

    layers: tuple[LayerConversion, ...]
    problem: str | None
    config: Fp8Config

    def paths(self, action: Action) -> list[str]:
        """The paths of the layers with this `action`."""
        if action not in ("convert", "keep", "skip", "unsupported"):
            raise ValueError(f"`action` must be 'convert', 'keep', 'skip' or 'unsupported', got {action!r}.")
        return [row.path for row in self.layers if row.action == action]

    @property
    def converted(self) -> list[str]:
        """Paths of the layers `fp8_linear_layers` converts."""
        return self.paths("convert")

    @property
    def skipped(self) -> list[str]:
        """Paths of the linear layers it leaves in high precision (`targets`, `min_features`)."""
        return self.paths("skip")

    @property
    def unsupported(self) -> list[str]:
        """Paths of the layers of a kind fp8ax does not convert."""
        return self.paths("unsupported")

    def __str__(self) -> str:
        count = {a: len(self.paths(a)) for a in ("convert", "keep", "skip", "unsupported")}
        n_linear = count["convert"] + count["keep"] + count["skip"]
        c = self.config
        head = (
            f"fp8_linear_layers with targets={_targets_str(c.targets)}, min_features={c.min_features}: "
            f"{count['convert']} of {n_linear} linear layers converted to FP8"
        )
        extra = [f"{count['keep']} already FP8"] if count["keep"] else []
        extra += [f"{count['skip']} skipped"] if count["skip"] else []
        n = count["unsupported"]
        extra += [f"{n} other layer{'s' if n > 1 else ''} not converted"] if n else []
        lines = [head + (f" ({', '.join(extra)})" if extra else "")]
        label = {"convert": "FP8", "keep": "kept", "skip": "skipped", "unsupported": "not converted"}
        rows = [("path", "kind", "in", "out", "decision", "reason")]
        for r in self.layers:
            kind = r.kind + (f" x{'x'.join(map(str, r.stacked))}" if r.stacked else "")
            rows.append(
                (r.path or "(root)", kind, _num(r.in_features), _num(r.out_features), label[r.action], r.reason)
            )
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        for row in rows:
            cells = [row[i].rjust(widths[i]) if i in (2, 3) else row[i].ljust(widths[i]) for i in range(5)]
            lines.append("  " + "  ".join(cells) + "  " + row[5])
        if self.problem is not None:
            lines.append(f"fp8_linear_layers would raise: {self.problem}")
        return "\n".join(lines)


def _num(x) -> str:
    return "" if x is None else str(x)


def _targets_str(targets) -> str:
    if targets is None:
        return "None"
    if isinstance(targets, tuple):
        return repr(list(targets))
    pattern = getattr(targets, "pattern", None)
    if pattern is not None:
        return repr(pattern)
    return getattr(targets, "__name__", type(targets).__name__)


def _kind(layer: Any) -> str:
    kind = kind_of(layer)
    if kind is not None:
        return kind.report_name(layer)
    cls = type(layer)
    modules = [("eqx.nn.", eqx.nn)] + ([("hax.nn.", _haliax.hnn())] if _haliax.loaded() else [])
    for prefix, module in modules:
        if getattr(module, cls.__name__, None) is cls:
            return prefix + cls.__name__
    return cls.__name__


def _stacked(layer: Any) -> tuple[int, ...]:
    kind = kind_of(layer)
    assert kind is not None
    return kind.stacked_shape(layer)


def conversion_report(module: Any, config: Fp8Config | None = None) -> ConversionReport:
    """What [`fp8ax.fp8_linear_layers`][]`(module, config)` converts, what it skips, and
    why; it converts nothing itself.

    Lists every linear layer with its path, sizes and the decision the transform makes
    (the same rule, not a copy of it), and the layers of kinds fp8ax does not convert
    (`eqx.nn.Conv*`, `eqx.nn.Embedding`, `eqx.nn.GRUCell`, `haliax.nn.Embedding`, ...),
    so they do not go unnoticed. Run it on the model you are about to convert; on a
    converted model, its FP8 layers show as kept.

    **Arguments:**

    - `module`: any PyTree, as for [`fp8ax.fp8_linear_layers`][].
    - `config`: an [`fp8ax.Fp8Config`][]; default `Fp8Config()`.

    **Returns:**

    A [`fp8ax.ConversionReport`][]; `print` it for a table. Unlike `fp8_linear_layers`,
    a config that would raise does not: the report carries the message as `problem`.

    !!! Example

        ```python
        print(fp8ax.conversion_report(model, fp8ax.Fp8Config(min_features=256)))
        ```
    """
    if config is None:
        config = Fp8Config()
    if not isinstance(config, Fp8Config):
        raise TypeError(f"`config` must be an `fp8ax.Fp8Config`, got {type(config).__name__}.")
    not_converted = _not_converted()
    other = tuple(kind for kind, _, _ in not_converted)

    def stop(x):
        return is_linear(x) or isinstance(x, other)

    decisions = []
    rows = []
    for path, node in jtu.tree_flatten_with_path(module, is_leaf=stop)[0]:
        if not stop(node):
            continue
        p = path_str(path)
        if is_linear(node):
            d = decide(p, node, config)
            decisions.append(d)
            fin, fout = layer_features(node)
            rows.append(LayerConversion(p, _kind(node), fin, fout, _stacked(node), d.action, d.reason))
        else:
            reason, sizes = next((why, sizes) for kind, why, sizes in not_converted if isinstance(node, kind))
            rows.append(LayerConversion(p, _kind(node), *sizes(node), (), "unsupported", reason))
    # Attention modules hold linear layers, so they are found in a second pass and listed
    # just before their projections.
    is_attn = lambda x: isinstance(x, eqx.nn.MultiheadAttention)  # noqa: E731
    for path, node in jtu.tree_flatten_with_path(module, is_leaf=is_attn)[0]:
        if not is_attn(node):
            continue
        p = path_str(path)
        row = LayerConversion(p, _kind(node), *_sizes("query_size", "output_size")(node), (), "unsupported", _ATTENTION)
        at = next((i for i, r in enumerate(rows) if r.path.startswith(p + ".") or r.path == p), len(rows))
        rows.insert(at, row)
    if callable(getattr(module, "get_lm_head", None)):
        rows = [_lm_head_note(r) if r.path == "lm_head" and r.action == "convert" else r for r in rows]
    return ConversionReport(tuple(rows), config_problem(module, config, decisions), config)


def _lm_head_note(row: LayerConversion) -> LayerConversion:
    # Levanter's language models (`LmHeadModel`: `get_lm_head()`) compute their training
    # loss from `lm_head`'s weight, not by calling the layer.
    return dataclasses.replace(
        row,
        reason=row.reason + "; but Levanter's losses take `get_lm_head()`'s weight and never call this layer: "
        "its FP8 state would never be written (leave it out: targets=lambda path, layer: path != 'lm_head')",
    )
