import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import equinox as eqx
import numpy as np

from .._gemm import GEMM_KEYWORDS, GemmKeywords, GemmSettings, Mode, SettingsView, settings_from
from .._recipes import AbstractScalingRecipe
from .dot_general import Fp8DotGeneral
from .ragged_dot import Fp8RaggedDot

Targets = None | str | Sequence[str] | Callable[[str, Any], bool]
# `targets` once checked: a string compiled, a list of names made a tuple (a callable's
# result is read as a bool).
CheckedTargets = None | re.Pattern[str] | tuple[str, ...] | Callable[[str, Any], object]


class Fp8Config(SettingsView):
    """Which linear layers [`fp8ax.fp8_linear_layers`][] converts, and how: `targets` and
    `min_features` choose the layers, `settings` (an [`fp8ax.GemmSettings`][]) says how
    their GEMMs run, and `fp8_all_gather` asks for each layer's FSDP all-gather in FP8.

    Immutable; every field is checked when the config is built. The fields of `settings`
    can be read on the config too (`config.recipe`, `config.mode`, ...).
    """

    targets: CheckedTargets = eqx.field(static=True)
    min_features: int = eqx.field(static=True)
    fp8_all_gather: bool = eqx.field(static=True)
    settings: GemmSettings = eqx.field(static=True)
    per_expert_weights: bool = eqx.field(static=True)
    per_group_tokens: bool = eqx.field(static=True)

    def __init__(
        self,
        targets: Targets = None,
        recipe: AbstractScalingRecipe | None = None,
        mode: Mode = "direct",
        *,
        settings: GemmSettings | None = None,
        min_features: int = 0,
        fp8_all_gather: bool = False,
        per_expert_weights: bool = True,
        per_group_tokens: bool = False,
        **gemm: Unpack[GemmKeywords],
    ):
        """**Arguments:**

        - `targets`: which layers to convert, by their dotted path in the model (the
          attribute path, list indices as numbers, `stacked` included for layers inside
          `haliax.nn.Stacked`, e.g. `"blocks.stacked.mlp.up_proj"`):
            - `None` (default): every linear layer;
            - a list of names: a layer matches a name if its path equals it or ends with
              `"." + name` (`"up_proj"` and `"mlp.up_proj"` both match
              `"blocks.0.mlp.up_proj"`);
            - a string: a regular expression that must `re.fullmatch` the path;
            - a callable `(path: str, layer) -> bool`.
        - `recipe`: the scaling recipe, default [`fp8ax.DelayedScaling`][]`()`.
        - `mode`: `"direct"` or `"qdq"`, see [`fp8ax.GemmSettings`][].
        - `settings`: an [`fp8ax.GemmSettings`][], instead of `recipe`, `mode` and the
          GEMM keyword arguments below (keyword only).
        - `min_features`: skip layers whose input or output size is below this (keyword
          only). Small GEMMs get slower in FP8: the casts and scaling cost more than the
          faster matmul saves.
        - `fp8_all_gather`: for FSDP. Quantize each `haliax.nn.Linear` weight to FP8
          while it is still sharded, and lay the FP8 weight out as the current Haliax axis
          mapping asks (inside `haliax.named_jit(..., axis_resources=...)`), so the
          all-gather moves FP8 bytes instead of bf16/f32 ones (keyword only). No effect
          on `equinox.nn.Linear` layers, outside an axis mapping, or with stateless
          recipes (their weight is quantized per GEMM, after the gather). See the "Distributed
          training" page of the docs.
        - `compute_dtype`, `fwd_precision`, `dlhs_precision`, `drhs_precision`,
          `lhs_recipe`, `rhs_recipe`, `grad_recipe`, `high_precision_gemms`: fields of
          [`fp8ax.GemmSettings`][], with its defaults, documented there (keyword only).
          (`fp8_all_gather_axes` comes from each layer's axes, with `fp8_all_gather`.)
        - `per_expert_weights`: in mixture-of-experts layers (`haliax.nn.MoELinear`),
          quantize each expert's weight as a tensor of its own, with its own scale and
          state (default); False: all experts' weights as one tensor (keyword only). See
          [`fp8ax.Fp8RaggedDot`][].
        - `per_group_tokens`: in mixture-of-experts layers, scale the tokens routed to
          each expert (and their output gradients) together, one scale and state per
          expert, instead of one per tensor (keyword only; needs a recipe with tensor
          scales).
        """
        self.targets = _check_targets(targets)
        allowed = tuple(k for k in GEMM_KEYWORDS if k != "fp8_all_gather_axes")
        settings = settings_from("Fp8Config", recipe, mode, settings, gemm, allowed=allowed)
        self.settings = settings
        self.min_features = min_features
        if not isinstance(fp8_all_gather, bool):
            raise TypeError(f"`fp8_all_gather` must be a bool, got {fp8_all_gather!r}.")
        self.fp8_all_gather = fp8_all_gather
        if not isinstance(per_expert_weights, bool):
            raise TypeError(f"`per_expert_weights` must be a bool, got {per_expert_weights!r}.")
        self.per_expert_weights = per_expert_weights
        if not isinstance(per_group_tokens, bool):
            raise TypeError(f"`per_group_tokens` must be a bool, got {per_group_tokens!r}.")
        self.per_group_tokens = per_group_tokens

    def __check_init__(self):
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int | np.integer):
            raise TypeError(f"`min_features` must be an int >= 0, got {self.min_features!r}.")
        if self.min_features < 0:
            raise ValueError(f"`min_features` must be >= 0, got {self.min_features}.")

    def matches(self, path: str, layer: Any) -> bool:
        """Whether `targets` selects the layer at dotted `path` (ignores `min_features`)."""
        t = self.targets
        if t is None:
            return True
        if isinstance(t, re.Pattern):
            return t.fullmatch(path) is not None
        if isinstance(t, tuple):
            return any(path == name or path.endswith("." + name) for name in t)
        return bool(t(path, layer))

    def make_dot_general(
        self, batch_shape: tuple[int, ...] = (), rhs_axes: tuple[str, ...] | None = None
    ) -> Fp8DotGeneral:
        """A fresh [`fp8ax.Fp8DotGeneral`][] with this config's settings.

        `rhs_axes` are the Haliax axis names of the weight (without stacked axes), which
        `fp8_all_gather` needs; [`fp8ax.fp8_linear_layers`][] passes them.
        """
        settings = self.settings
        if self.fp8_all_gather and rhs_axes is not None:
            settings = dataclasses.replace(settings, fp8_all_gather_axes=tuple(rhs_axes))
        return Fp8DotGeneral.init(settings=settings, batch_shape=batch_shape)

    def make_ragged_dot(
        self, batch_shape: tuple[int, ...], num_experts: int, rhs_axes: tuple[str, ...] | None = None
    ) -> Fp8RaggedDot:
        """A fresh [`fp8ax.Fp8RaggedDot`][] with this config's settings, for a
        mixture-of-experts layer of `num_experts` experts. `rhs_axes`: the names of the
        expert weights' axes, (Experts, In, Out), which `fp8_all_gather` needs."""
        settings = self.settings
        if self.fp8_all_gather and rhs_axes is not None:
            settings = dataclasses.replace(settings, fp8_all_gather_axes=tuple(rhs_axes))
        return Fp8RaggedDot.init(
            settings=settings,
            batch_shape=batch_shape,
            num_experts=num_experts,
            per_expert_weights=self.per_expert_weights,
            per_group_tokens=self.per_group_tokens,
        )


def _check_targets(targets) -> CheckedTargets:
    if targets is None or callable(targets) and not isinstance(targets, str | re.Pattern):
        return targets
    if isinstance(targets, re.Pattern):
        return targets
    if isinstance(targets, str):
        try:
            return re.compile(targets)
        except re.error as e:
            raise ValueError(f"`targets` is a string, so it must be a regular expression; {targets!r} is not: {e}.")
    if isinstance(targets, Sequence):
        bad = [t for t in targets if not isinstance(t, str)]
        if bad:
            raise TypeError(f"`targets` as a list must hold layer names (str), got {bad[:3]!r}.")
        if not targets:
            raise ValueError("`targets` is an empty list, which selects no layer; pass None to convert every layer.")
        return tuple(targets)
    raise TypeError(
        "`targets` must be None, a list of layer names, a regular expression string or a callable "
        f"(path, layer) -> bool, got {type(targets).__name__}."
    )
