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


def _check_accumulation(value, mode):
    if value is None:
        return None
    if not isinstance(value, EmulatedAccumulation):
        raise TypeError(f"`accumulation` must be an `fp8ax.EmulatedAccumulation` or None, got {value!r}.")
    if mode != "direct":
        raise ValueError(
            f'`accumulation` needs `mode="direct"`, got mode={mode!r}: in "qdq" mode the GEMM runs on dequantized '
            "values, which a tensor core never sees."
        )
    return value


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
    """

    recipe: AbstractScalingRecipe = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    compute_dtype: np.dtype | None = eqx.field(static=True)
    fwd_precision: lax.Precision | None = eqx.field(static=True)
    dlhs_precision: lax.Precision | None = eqx.field(static=True)
    drhs_precision: lax.Precision | None = eqx.field(static=True)
    lhs_recipe: Any = eqx.field(static=True)
    rhs_recipe: Any = eqx.field(static=True)
    grad_recipe: Any = eqx.field(static=True)
    high_precision_gemms: tuple[str, ...] = eqx.field(static=True)
    fp8_all_gather_axes: tuple[str, ...] | None = eqx.field(static=True)
    accumulation: EmulatedAccumulation | None = eqx.field(static=True)
    block_scaled_gemm: bool | None = eqx.field(static=True)

    def __init__(
        self,
        recipe: AbstractScalingRecipe | None = None,
        mode: Mode = "direct",
        *,
        compute_dtype=None,
        fwd_precision: lax.Precision | None = None,
        dlhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        drhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        lhs_recipe=None,
        rhs_recipe=None,
        grad_recipe=None,
        high_precision_gemms: Sequence[str] = (),
        fp8_all_gather_axes: Sequence[str] | None = None,
        accumulation: EmulatedAccumulation | None = None,
        block_scaled_gemm: bool | None = None,
    ):
        """**Arguments:**

        - `recipe`: the scaling recipe; default [`fp8ax.DelayedScaling`][]`()`.
        - `mode`: `"direct"` (default) quantizes both operands and calls
          `lax.dot_general` on the low-precision arrays with a float32 (int32 for int8)
          result, then multiplies by the scales. `"qdq"` quantizes, dequantizes back to
          the compute dtype and calls a high-precision `dot_general`: the
          convert-multiply-dot pattern that XLA's GPU compiler rewrites into a cuBLASLt
          FP8 GEMM. With float32 operands both give the same result up to float32
          rounding; with bf16 operands `"qdq"` dequantizes in bf16 (as XLA's pattern
          requires), which rounds the scales to bf16 too.
        - `compute_dtype`: if given, both operands are cast to it first (for example
          `jnp.bfloat16`). (Keyword only argument.)
        - `fwd_precision`: `lax.Precision` of the forward GEMM; `None` uses the `precision`
          passed by the caller. On GPU, `DEFAULT` lets XLA use FP8 fast accumulation and
          `HIGHEST` turns it off. (Keyword only argument.)
        - `dlhs_precision`, `drhs_precision`: the same for the two backward GEMMs (input
          gradient and kernel gradient). (Keyword only arguments.)
        - `lhs_recipe`, `rhs_recipe`, `grad_recipe`: per-operand overrides of a stateless
          `recipe`: `None` (default) uses `recipe`, `"off"` leaves that operand in high
          precision, a stateless recipe quantizes it that way. (Keyword only arguments.)
        - `high_precision_gemms`: GEMMs computed without quantization, from `"fwd"`,
          `"dlhs"` (input gradient) and `"drhs"` (weight gradient); e.g. `("drhs",)` is
          torchao's `rowwise_with_gw_hp`. Stateless recipes only. (Keyword only argument.)
        - `fp8_all_gather_axes`: the Haliax axis names of `rhs`, in order. If given, the
          FP8 `rhs` is laid out by the current Haliax axis mapping right after
          quantization (a sharding constraint), so that an FSDP all-gather of the weight
          moves FP8 values. `None` (default): no constraint. (Keyword only argument.)
        - `accumulation`: an [`fp8ax.EmulatedAccumulation`][] to compute each GEMM of two
          floating-point quantized operands as a tensor core accumulates it (limited
          precision, promotion to float32 every so many elements), on any backend; needs
          `mode="direct"`. `None` (default): XLA's float32 accumulation. (Keyword only
          argument.)
        - `block_scaled_gemm`: whether a block-scaled GEMM (MXFP8: E4M3 or E5M2 values,
          E8M0 scales per 32 elements of its one contracting axis; NVFP4: E2M1 values,
          E4M3 scales per 16, times the tensor scales) runs as JAX's block-scaled GEMM,
          `jax.nn.scaled_matmul`, which XLA:GPU hands to cuDNN's block-scaled kernel on
          Blackwell (compute capability 10.0 and newer). `None` (default): when the
          default device is such a GPU; `True`: always (JAX lowers it for GPUs only);
          `False`: never (the blocks are dequantized and multiplied, the same numbers).
          (Keyword only argument.)
        """
        self.recipe = _check_recipe(recipe)
        self.mode = _check_mode(mode)
        self.compute_dtype = check_compute_dtype(compute_dtype)
        self.fwd_precision = check_precision(fwd_precision, "fwd_precision")
        self.dlhs_precision = check_precision(dlhs_precision, "dlhs_precision")
        self.drhs_precision = check_precision(drhs_precision, "drhs_precision")
        self.lhs_recipe = _check_override("lhs_recipe", lhs_recipe)
        self.rhs_recipe = _check_override("rhs_recipe", rhs_recipe)
        self.grad_recipe = _check_override("grad_recipe", grad_recipe)
        self.high_precision_gemms = _check_high_precision(high_precision_gemms)
        self.fp8_all_gather_axes = _check_axes(fp8_all_gather_axes)
        self.accumulation = _check_accumulation(accumulation, self.mode)
        if block_scaled_gemm not in (None, True, False):
            raise TypeError(f"`block_scaled_gemm` must be None, True or False, got {block_scaled_gemm!r}.")
        self.block_scaled_gemm = block_scaled_gemm
        changed = any(v is not None for v in (lhs_recipe, rhs_recipe, grad_recipe)) or self.high_precision_gemms
        if changed and self.recipe.stateful:
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
    """Read-only views of `settings`' fields under the names users know: the one place
    that answers what an op's (or a config's) GEMM settings are. [`fp8ax.Fp8DotGeneral`][],
    [`fp8ax.Fp8RaggedDot`][] and [`fp8ax.Fp8Config`][] derive from it;
    tests/test_dot_general.py checks that it names every field of `GemmSettings`."""

    settings: eqx.AbstractVar[GemmSettings]

    recipe = property(lambda self: self.settings.recipe, doc="The scaling recipe (`settings.recipe`).")
    mode = property(lambda self: self.settings.mode, doc="`settings.mode`.")
    compute_dtype = property(lambda self: self.settings.compute_dtype, doc="`settings.compute_dtype`.")
    fwd_precision = property(lambda self: self.settings.fwd_precision, doc="`settings.fwd_precision`.")
    dlhs_precision = property(lambda self: self.settings.dlhs_precision, doc="`settings.dlhs_precision`.")
    drhs_precision = property(lambda self: self.settings.drhs_precision, doc="`settings.drhs_precision`.")
    lhs_recipe = property(lambda self: self.settings.lhs_recipe, doc="`settings.lhs_recipe`.")
    rhs_recipe = property(lambda self: self.settings.rhs_recipe, doc="`settings.rhs_recipe`.")
    grad_recipe = property(lambda self: self.settings.grad_recipe, doc="`settings.grad_recipe`.")
    high_precision_gemms = property(
        lambda self: self.settings.high_precision_gemms, doc="`settings.high_precision_gemms`."
    )
    fp8_all_gather_axes = property(
        lambda self: self.settings.fp8_all_gather_axes, doc="`settings.fp8_all_gather_axes`."
    )
    accumulation = property(lambda self: self.settings.accumulation, doc="`settings.accumulation`.")
    block_scaled_gemm = property(lambda self: self.settings.block_scaled_gemm, doc="`settings.block_scaled_gemm`.")


class GemmKeywords(TypedDict, total=False):
    """The keyword arguments of [`fp8ax.GemmSettings`][] besides `recipe` and `mode`,
    declared once: [`fp8ax.Fp8DotGeneral.init`][] and [`fp8ax.Fp8Config`][] take them as
    they are and pass them on (their defaults and checks are `GemmSettings`')."""

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
