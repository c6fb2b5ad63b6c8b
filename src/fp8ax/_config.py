import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import numpy as np
from jax import lax

from ._dot_general import (
    Fp8DotGeneral,
    Mode,
    _check_compute_dtype,
    _check_precision,
    _check_recipe_and_mode,
    check_operand_recipes,
)
from ._recipes import AbstractScalingRecipe, DelayedScaling

Targets = None | str | Sequence[str] | Callable[[str, Any], bool]


class Fp8Config(eqx.Module):
    """Which linear layers [`fp8ax.fp8_linear_layers`][] converts, and how.

    Immutable; every field is checked when the config is built.
    """

    targets: Targets = eqx.field(static=True)
    recipe: AbstractScalingRecipe = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True)
    min_features: int = eqx.field(static=True)
    fwd_precision: lax.Precision | None = eqx.field(static=True)
    dlhs_precision: lax.Precision | None = eqx.field(static=True)
    drhs_precision: lax.Precision | None = eqx.field(static=True)
    fp8_all_gather: bool = eqx.field(static=True)
    lhs_recipe: Any = eqx.field(static=True)
    rhs_recipe: Any = eqx.field(static=True)
    grad_recipe: Any = eqx.field(static=True)
    high_precision_gemms: tuple[str, ...] = eqx.field(static=True)

    def __init__(
        self,
        targets: Targets = None,
        recipe: AbstractScalingRecipe | None = None,
        mode: Mode = "direct",
        *,
        compute_dtype=None,
        min_features: int = 0,
        fwd_precision: lax.Precision | None = None,
        dlhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        drhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        fp8_all_gather: bool = False,
        lhs_recipe=None,
        rhs_recipe=None,
        grad_recipe=None,
        high_precision_gemms: Sequence[str] = (),
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
        - `mode`: `"direct"` or `"qdq"`, see [`fp8ax.Fp8DotGeneral.init`][].
        - `compute_dtype`: cast both operands to this dtype before quantising (keyword only).
        - `min_features`: skip layers whose input or output size is below this (keyword
          only). Small GEMMs get slower in FP8: the casts and scaling cost more than the
          faster matmul saves.
        - `fwd_precision`, `dlhs_precision`, `drhs_precision`: `lax.Precision` per GEMM,
          see [`fp8ax.Fp8DotGeneral.init`][] (keyword only).
        - `fp8_all_gather`: for FSDP. Quantise each `haliax.nn.Linear` weight to FP8
          while it is still sharded, and lay the FP8 weight out as the current Haliax axis
          mapping asks (inside `haliax.named_jit(..., axis_resources=...)`), so the
          all-gather moves FP8 bytes instead of bf16/f32 ones (keyword only). No effect
          on `equinox.nn.Linear` layers, outside an axis mapping, or with stateless
          recipes (their weight is quantised per GEMM, after the gather). See the "Distributed
          training" page of the docs.
        - `lhs_recipe`, `rhs_recipe`, `grad_recipe`, `high_precision_gemms`: per-operand
          recipes and GEMMs kept in high precision, for stateless recipes; see
          [`fp8ax.Fp8DotGeneral.init`][] (keyword only).
        """
        self.targets = _check_targets(targets)
        if recipe is None:
            recipe = DelayedScaling()
        self.recipe = recipe
        self.mode = mode
        self.compute_dtype = None if compute_dtype is None else _check_compute_dtype(compute_dtype)
        self.min_features = min_features
        self.fwd_precision = _check_precision(fwd_precision, "fwd_precision")
        self.dlhs_precision = _check_precision(dlhs_precision, "dlhs_precision")
        self.drhs_precision = _check_precision(drhs_precision, "drhs_precision")
        if not isinstance(fp8_all_gather, bool):
            raise TypeError(f"`fp8_all_gather` must be a bool, got {fp8_all_gather!r}.")
        self.fp8_all_gather = fp8_all_gather
        (self.lhs_recipe, self.rhs_recipe, self.grad_recipe, self.high_precision_gemms) = check_operand_recipes(
            recipe, lhs_recipe, rhs_recipe, grad_recipe, high_precision_gemms)

    def __check_init__(self):
        _check_recipe_and_mode(self.recipe, self.mode)
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
        """A fresh [`fp8ax.Fp8DotGeneral`][] with this config's recipe and settings.

        `rhs_axes` are the Haliax axis names of the weight (without stacked axes), which
        `fp8_all_gather` needs; [`fp8ax.fp8_linear_layers`][] passes them.
        """
        return Fp8DotGeneral.init(
            self.recipe,
            mode=self.mode,
            compute_dtype=self.compute_dtype,
            fwd_precision=self.fwd_precision,
            dlhs_precision=self.dlhs_precision,
            drhs_precision=self.drhs_precision,
            batch_shape=batch_shape,
            fp8_all_gather_axes=rhs_axes if self.fp8_all_gather else None,
            lhs_recipe=self.lhs_recipe,
            rhs_recipe=self.rhs_recipe,
            grad_recipe=self.grad_recipe,
            high_precision_gemms=self.high_precision_gemms,
        )


def _check_targets(targets):
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

