# The settings of one low-precision dot general, in one immutable, validated object: the
# single static field of `Fp8DotGeneral`, passed whole into the GEMM pipeline.

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, cast

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._recipes import AbstractScalingRecipe, AbstractStatefulRecipe, AbstractStatelessRecipe
from .._recipes.delayed import DelayedScaling
from .._tensor_core import EmulatedAccumulation

Mode = Literal["direct", "qdq"]
Role = Literal["lhs", "rhs", "grad"]
MODES = ("direct", "qdq")
GEMMS = ("fwd", "dlhs", "drhs")


def _check_accumulation(value):
    if value is not None and not isinstance(value, EmulatedAccumulation):
        raise TypeError(f"`accumulation` must be an `fp8ax.EmulatedAccumulation` or None, got {value!r}.")
    return value


def _check_block_scaled(value):
    if value is not None and not isinstance(value, bool | np.bool_):
        raise TypeError(f"`block_scaled_gemm` must be None, True or False, got {value!r}.")
    return None if value is None else bool(value)


def _precision(argname: str):
    return lambda value: check_precision(value, argname)


def _override(argname: str):
    return lambda value: _check_override(argname, value)


def check_precision(value, argname: str):
    if value is None or isinstance(value, lax.Precision):
        return value
    if isinstance(value, str):
        try:
            return lax.Precision(value)
        except ValueError:
            pass
    raise TypeError(f"`{argname}` must be None or a `jax.lax.Precision`, got {value!r}.")


def check_compute_dtype(value) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"`compute_dtype` must be None or a floating dtype, got {value!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise TypeError(f"`compute_dtype` must be a floating dtype wider than 8 bits, got {dtype}.")
    return dtype


def _check_recipe(recipe) -> AbstractScalingRecipe:
    if recipe is None:
        return DelayedScaling()
    if not isinstance(recipe, AbstractScalingRecipe):
        raise TypeError(
            "`recipe` must be an fp8ax recipe (`fp8ax.DelayedScaling()`, `fp8ax.CurrentScaling()`, "
            f"`fp8ax.MXScaling()`, `fp8ax.Int8Scaling()`), got {type(recipe).__name__}."
        )
    return recipe


def _check_mode(mode) -> Mode:
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}.")
    return mode


def _check_override(name, value):
    if value is not None and value != "off" and not isinstance(value, AbstractStatelessRecipe):
        raise TypeError(
            f"`{name}` must be None (use `recipe`), 'off' (no quantization) or a stateless recipe "
            f"(`fp8ax.CurrentScaling`, `fp8ax.MXScaling`, `fp8ax.Int8Scaling`), got {value!r}."
        )
    return value


def _as_tuple(value):
    if isinstance(value, str):
        return None
    try:
        return tuple(value)
    except TypeError:
        return None


def _check_high_precision(value) -> tuple[str, ...]:
    names = _as_tuple(value)
    if names is None or not all(g in GEMMS for g in names):
        raise ValueError(f"`high_precision_gemms` must be a sequence of names from {GEMMS}, got {value!r}.")
    return tuple(g for g in GEMMS if g in names)


def _check_axes(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = _as_tuple(value)
    if names is None or not all(isinstance(a, str) for a in names):
        raise TypeError(f"`fp8_all_gather_axes` must be None or a sequence of axis names, got {value!r}.")
    return names


class GemmSettings(eqx.Module):
    """Everything that decides how an [`fp8ax.Fp8DotGeneral`][] computes its three GEMMs:
    the recipe, the mode, the compute dtype, the precision of each GEMM, per-operand
    recipes, GEMMs kept in high precision and the FP8 all-gather layout.

    Immutable and checked when built. [`fp8ax.Fp8Config`][] holds one (plus which layers
    to convert); [`fp8ax.Fp8DotGeneral`][] holds one as its only static field. Change a
    field with `dataclasses.replace(settings, mode="qdq")` (checked again).

    **Arguments** (the fields, in this order; all but `recipe` and `mode` keyword only):

    - `recipe`: the scaling recipe; default [`fp8ax.DelayedScaling`][]`()`.
    - `mode`: `"direct"` (default) quantizes both operands and calls `lax.dot_general`
      on the low-precision arrays with a float32 (int32 for int8) result, then multiplies
      by the scales. `"qdq"` quantizes, dequantizes back to the compute dtype and calls a
      high-precision `dot_general`: the convert-multiply-dot pattern that XLA's GPU
      compiler rewrites into a cuBLASLt FP8 GEMM. With float32 operands both give the
      same result up to float32 rounding; with bf16 operands `"qdq"` dequantizes in bf16
      (as XLA's pattern requires), which rounds the scales to bf16 too.
    - `compute_dtype`: if given, both operands are cast to it first (for example
      `jnp.bfloat16`).
    - `fwd_precision`: `lax.Precision` of the forward GEMM; `None` (default) uses the
      `precision` passed by the caller. On GPU, `DEFAULT` lets XLA use FP8 fast
      accumulation and `HIGHEST` turns it off.
    - `dlhs_precision`, `drhs_precision`: the same for the two backward GEMMs (input
      gradient and kernel gradient); default `lax.Precision.DEFAULT`.
    - `lhs_recipe`, `rhs_recipe`, `grad_recipe`: per-operand overrides of a stateless
      `recipe`: `None` (default) uses `recipe`, `"off"` leaves that operand in high
      precision, a stateless recipe quantizes it that way.
    - `high_precision_gemms`: GEMMs computed without quantization, from `"fwd"`, `"dlhs"`
      (input gradient) and `"drhs"` (weight gradient); e.g. `("drhs",)` is torchao's
      `rowwise_with_gw_hp`. Stateless recipes only. Default `()`.
    - `fp8_all_gather_axes`: the Haliax axis names of `rhs`, in order. If given, the FP8
      `rhs` is laid out by the current Haliax axis mapping right after quantization (a
      sharding constraint), so that an FSDP all-gather of the weight moves FP8 values.
      `None` (default): no constraint.
    - `accumulation`: an [`fp8ax.EmulatedAccumulation`][] to compute each GEMM of two
      floating-point quantized operands as a tensor core accumulates it (limited
      precision, promotion to float32 every so many elements), on any backend; needs
      `mode="direct"`. `None` (default): XLA's float32 accumulation.
    - `block_scaled_gemm`: whether a block-scaled GEMM (MXFP8: E4M3 or E5M2 values, E8M0
      scales per 32 elements of its one contracting axis; NVFP4: E2M1 values, E4M3
      scales per 16, times the tensor scales) runs as JAX's block-scaled GEMM,
      `jax.nn.scaled_matmul`, which XLA:GPU hands to cuDNN's block-scaled kernel on
      Blackwell (compute capability 10.0 and newer). `None` (default): when the default
      device is such a GPU; `True`: always (JAX lowers it for GPUs only); `False`: never
      (the blocks are dequantized and multiplied, the same numbers).
    """

    # Each setting is written here once: its name, type, default and check (the
    # converter). The constructor is the dataclass's; `SettingsView` reads the fields by
    # these names, and `GemmKeywords` types them for static checkers (a test checks that
    # both agree with these fields).
    recipe: AbstractScalingRecipe = eqx.field(static=True, default=None, converter=_check_recipe)
    mode: Mode = eqx.field(static=True, default="direct", converter=_check_mode)
    compute_dtype: np.dtype | None = eqx.field(static=True, default=None, kw_only=True, converter=check_compute_dtype)
    fwd_precision: lax.Precision | None = eqx.field(
        static=True, default=None, kw_only=True, converter=_precision("fwd_precision")
    )
    dlhs_precision: lax.Precision | None = eqx.field(
        static=True, default=lax.Precision.DEFAULT, kw_only=True, converter=_precision("dlhs_precision")
    )
    drhs_precision: lax.Precision | None = eqx.field(
        static=True, default=lax.Precision.DEFAULT, kw_only=True, converter=_precision("drhs_precision")
    )
    lhs_recipe: Any = eqx.field(static=True, default=None, kw_only=True, converter=_override("lhs_recipe"))
    rhs_recipe: Any = eqx.field(static=True, default=None, kw_only=True, converter=_override("rhs_recipe"))
    grad_recipe: Any = eqx.field(static=True, default=None, kw_only=True, converter=_override("grad_recipe"))
    high_precision_gemms: tuple[str, ...] = eqx.field(
        static=True, default=(), kw_only=True, converter=_check_high_precision
    )
    fp8_all_gather_axes: tuple[str, ...] | None = eqx.field(
        static=True, default=None, kw_only=True, converter=_check_axes
    )
    accumulation: EmulatedAccumulation | None = eqx.field(
        static=True, default=None, kw_only=True, converter=_check_accumulation
    )
    block_scaled_gemm: bool | None = eqx.field(static=True, default=None, kw_only=True, converter=_check_block_scaled)

    def __check_init__(self):
        if self.accumulation is not None and self.mode != "direct":
            raise ValueError(
                f'`accumulation` needs `mode="direct"`, got mode={self.mode!r}: in "qdq" mode the GEMM runs on '
                "dequantized values, which a tensor core never sees."
            )
        changed = any(v is not None for v in (self.lhs_recipe, self.rhs_recipe, self.grad_recipe))
        if (changed or self.high_precision_gemms) and self.recipe.stateful:
            raise ValueError(
                "Per-operand recipes and `high_precision_gemms` need a stateless `recipe` (`fp8ax.CurrentScaling`, "
                f"`fp8ax.MXScaling`, `fp8ax.Int8Scaling`); got {type(self.recipe).__name__}, whose state covers all "
                "three tensors."
            )

    def operand_recipe(self, role: Role) -> AbstractScalingRecipe | None:
        """The recipe that quantizes operand `role` (`"lhs"`, `"rhs"` or `"grad"`); None
        if it stays in high precision."""
        override = {"lhs": self.lhs_recipe, "rhs": self.rhs_recipe, "grad": self.grad_recipe}[role]
        if override is None:
            return self.recipe
        return None if override == "off" else override

    @property
    def stateful(self) -> bool:
        """Whether the modules these settings build keep FP8 state."""
        return self.recipe.stateful


def quantizing_recipe(settings: GemmSettings, role: Role) -> AbstractScalingRecipe:
    """`settings.operand_recipe(role)` where the caller knows that operand is quantized
    (it has a plan, a state or a quantized form, or the caller checked): never None."""
    return cast(AbstractScalingRecipe, settings.operand_recipe(role))


def stateful_recipe(settings: GemmSettings) -> AbstractStatefulRecipe:
    """`settings.recipe` where the caller holds a state (or a plan) of it: a stateful
    recipe, which quantizes every operand (per-operand recipes and high-precision GEMMs
    need a stateless one)."""
    recipe = settings.recipe
    if not isinstance(recipe, AbstractStatefulRecipe):
        raise TypeError(f"{type(recipe).__name__} keeps no state: it has no state to read or plan from.")
    return recipe


# The names of GemmSettings' fields.
SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(GemmSettings))


class SettingsView(eqx.Module):
    """Read-only views of `settings`' fields under their own names (`op.mode` is
    `op.settings.mode`): the one place that answers what an op's (or a config's) GEMM
    settings are. [`fp8ax.Fp8DotGeneral`][], [`fp8ax.Fp8RaggedDot`][] and
    [`fp8ax.Fp8Config`][] derive from it. It reads whatever fields `GemmSettings` has, so
    a new setting is readable on all three at once."""

    settings: eqx.AbstractVar[GemmSettings]

    def __getattr__(self, name: str) -> Any:
        # Only called for names the instance and its class do not have.
        if name in SETTINGS_FIELDS:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class GemmKeywords(TypedDict, total=False):
    """The keyword arguments of [`fp8ax.GemmSettings`][] besides `recipe` and `mode`, typed
    for static checkers: [`fp8ax.Fp8DotGeneral.init`][], [`fp8ax.Fp8RaggedDot.init`][] and
    [`fp8ax.Fp8Config`][] take them as they are and pass them on (their defaults and
    checks are `GemmSettings`' fields'). The one copy of the names besides those fields,
    which a type checker cannot derive from a dataclass; tests/test_dot_general.py checks
    that the two agree."""

    compute_dtype: Any
    fwd_precision: lax.Precision | None
    dlhs_precision: lax.Precision | None
    drhs_precision: lax.Precision | None
    lhs_recipe: Any
    rhs_recipe: Any
    grad_recipe: Any
    high_precision_gemms: Sequence[str]
    fp8_all_gather_axes: Sequence[str] | None
    accumulation: EmulatedAccumulation | None
    block_scaled_gemm: bool | None


GEMM_KEYWORDS = tuple(GemmKeywords.__annotations__)


def settings_from(
    owner: str, recipe, mode, settings, gemm: Mapping[str, Any], *, allowed=GEMM_KEYWORDS
) -> GemmSettings:
    """The `GemmSettings` a call of `owner` asks for: `settings` as given, or built from
    `recipe`, `mode` and the keyword arguments `gemm` (names from `allowed`), not both."""
    unknown = sorted(set(gemm) - set(allowed))
    if unknown:
        raise TypeError(f"`{owner}` got unexpected keyword arguments {unknown}.")
    if settings is None:
        return GemmSettings(recipe, mode, **gemm)
    if not isinstance(settings, GemmSettings):
        raise TypeError(f"`settings` must be an `fp8ax.GemmSettings`, got {type(settings).__name__}.")
    given = sorted(gemm) + [
        name for name, value in (("recipe", recipe), ("mode", mode)) if value not in (None, "direct")
    ]
    if given:
        raise ValueError(f"Pass either `settings` or GEMM arguments, not both; also got {given}.")
    return settings
