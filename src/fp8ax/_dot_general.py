import dataclasses
import functools
from typing import Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from . import _formats
from ._boundaries import check_eager_shard_map
from ._layout import DimensionNumbers, check_dimension_numbers
from ._maxgrad import is_max
from ._pipeline import Call, quantized_dot, vma
from ._recipes import AbstractScalingRecipe
from ._settings import GemmKeywords, GemmSettings, Mode, settings_from
from ._state import AbstractState, OverwriteWithGradient

# The names of GemmSettings' fields, read through the module and the config.
_SETTINGS_FIELDS = tuple(f.name for f in dataclasses.fields(GemmSettings))
# `Fp8DotGeneral.calibrating` of a fresh layer and of a written one.
_FRESH, _SETTLED = 1.0, 0.0


class Fp8DotGeneral(OverwriteWithGradient):
    """Low-precision drop-in for `jax.lax.dot_general`: FP8 (or MX, or int8) GEMMs.

    With [`fp8ax.DelayedScaling`][] (the default) it holds the scaling state of its three
    tensors as float32 leaves: `lhs` (the input), `rhs` (the kernel) and `grad` (the
    gradient of the output), each a [`fp8ax.ScalingState`][] with `scale` and
    `amax_history`. Its custom VJP returns the new state as the "gradient" of those
    leaves; see [`fp8ax.apply_updates`][]. With a stateless recipe
    ([`fp8ax.CurrentScaling`][], [`fp8ax.MXScaling`][], [`fp8ax.Int8Scaling`][]) the three
    fields are `None` and the module has no array leaves.

    A recipe with a first-call mode (`DelayedScaling(calibrate_first_call=True)`, the
    default) adds one more leaf, `calibrating`: a Python float, 1.0 while the layer has
    never been written, 0.0 once [`fp8ax.apply_updates`][] or [`fp8ax.calibrate`][] has
    written its state. It picks the program (see `settled` and `program_recipe`). Like
    `eqx.nn.Dropout`'s `inference`, it is a leaf that is not an array: `eqx.filter_jit`
    treats it as static (one program for each value), `eqx.filter(model, eqx.is_array)`
    and `eqx.filter_grad` leave it out, and the module's pytree structure stays the same
    when it changes, so an optimiser state built from the whole model
    (`opt.init(eqx.filter(model, eqx.is_array))`) keeps matching the gradients. Where a
    transformation traces it (`jax.jit` rather than `eqx.filter_jit`, a `lax.scan` carry)
    the layer runs the first-call program, which is correct for a written state too, but
    on XLA:GPU costs what the switch saves (see `_settled`). (A float rather than a bool
    so that `jax.grad` of a function of the whole model accepts it.)

    Everything else is one static field, `settings` (an [`fp8ax.GemmSettings`][]); its
    fields can be read on the module too (`dg.recipe`, `dg.mode`, ...).

    It has the call signature of `jax.lax.dot_general`, so it goes wherever Haliax takes a
    `dot_general`: `hax.nn.Linear(..., dot_general=...)`, `hax.dot(..., dot_general=...)`,
    `NamedArray.dot(..., dot_general=...)`.
    """

    lhs: AbstractState | None
    rhs: AbstractState | None
    grad: AbstractState | None
    calibrating: float | None
    settings: GemmSettings = eqx.field(static=True)

    def __init__(self, lhs, rhs, grad, settings: GemmSettings | None = None, calibrating=None, **changes):
        """Builds the module from its state and settings; most code wants
        [`fp8ax.Fp8DotGeneral.init`][] instead. Keyword arguments named like a field of
        [`fp8ax.GemmSettings`][] replace that field of `settings` (so
        `dataclasses.replace(dg, mode="qdq")` works). `calibrating` is set from the
        settings: None for a recipe without a first-call mode, and for one with it the
        value given, or if None, 1.0 (a fresh layer)."""
        settings = GemmSettings() if settings is None else settings
        if not isinstance(settings, GemmSettings):
            raise TypeError(f"`settings` must be an `fp8ax.GemmSettings`, got {type(settings).__name__}.")
        unknown = sorted(set(changes) - set(_SETTINGS_FIELDS))
        if unknown:
            raise TypeError(f"`Fp8DotGeneral` got unexpected keyword arguments {unknown}.")
        if changes:
            kwargs = {name: getattr(settings, name) for name in _SETTINGS_FIELDS}
            kwargs.update(changes)
            settings = GemmSettings(**kwargs)
        self.lhs, self.rhs, self.grad, self.settings = lhs, rhs, grad, settings
        if not self._has_first_call():
            calibrating = None
        elif calibrating is None:
            calibrating = _FRESH
        self.calibrating = calibrating

    def _has_first_call(self) -> bool:
        # Only a stateful recipe whose settled program differs needs the switch.
        recipe = self.settings.recipe
        return self.lhs is not None and recipe.after_state_written() is not recipe

    @property
    def settled(self) -> bool:
        """Whether the layer runs its settled program: its state has been written (by
        [`fp8ax.apply_updates`][] or [`fp8ax.calibrate`][]), or its recipe has no
        first-call mode."""
        flag = self.calibrating
        if flag is None:
            return True
        if isinstance(flag, jax.core.Tracer):
            return False  # traced (`jax.jit`, a `lax.scan` carry): run the program that is right either way
        return float(np.asarray(flag)) == _SETTLED

    @property
    def program_recipe(self) -> AbstractScalingRecipe:
        """The recipe the layer's program runs now: `recipe`, or once the layer is
        `settled`, `recipe.after_state_written()` (for `DelayedScaling`, the recipe
        without `calibrate_first_call`)."""
        recipe = self.settings.recipe
        return recipe.after_state_written() if self.settled else recipe

    def _program_settings(self) -> GemmSettings:
        # The settings the GEMM pipeline builds this call's program from.
        recipe = self.settings.recipe
        program = self.program_recipe
        return self.settings if program is recipe else dataclasses.replace(self.settings, recipe=program)

    def __check_init__(self):
        for name in ("lhs", "rhs", "grad"):
            if not isinstance(getattr(self, name), AbstractState | None):
                raise TypeError(
                    f"`{name}` must be a recipe's state (an `fp8ax.AbstractState`, such as `fp8ax.ScalingState`) or "
                    f"None, got {type(getattr(self, name)).__name__}."
                )
        flag = self.calibrating
        if flag is not None and not (
            isinstance(flag, jax.core.Tracer)
            or (np.shape(flag) == () and np.asarray(flag).item() in (_FRESH, _SETTLED))
        ):
            raise TypeError(f"`calibrating` must be None, 1.0 (a fresh layer) or 0.0 (a written one), got {flag!r}.")

    # Read-only views of the settings, under the names users know.
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

    @classmethod
    def init(
        cls,
        recipe: AbstractScalingRecipe | None = None,
        *,
        settings: GemmSettings | None = None,
        batch_shape: tuple[int, ...] = (),
        mode: Mode = "direct",
        **gemm: Unpack[GemmKeywords],
    ) -> "Fp8DotGeneral":
        """Builds an `Fp8DotGeneral` with fresh state (scale 1, empty history).

        **Arguments:**

        - `recipe`: the scaling recipe; default [`fp8ax.DelayedScaling`][]`()`.
        - `settings`: an [`fp8ax.GemmSettings`][] to use as it is, instead of `recipe`,
          `mode` and the GEMM keyword arguments. (Keyword only argument.)
        - `batch_shape`: leading shape of the state arrays, one state per stacked layer
          (what [`fp8ax.fp8_linear_layers`][] uses inside `haliax.nn.Stacked`). (Keyword
          only argument.)
        - `mode`, and the GEMM keyword arguments `compute_dtype`, `fwd_precision`,
          `dlhs_precision`, `drhs_precision`, `fp8_all_gather_axes`, `lhs_recipe`,
          `rhs_recipe`, `grad_recipe`, `high_precision_gemms`: the fields of
          [`fp8ax.GemmSettings`][], with its defaults, documented there. (Keyword only
          arguments.)
        """
        settings = settings_from("Fp8DotGeneral.init", recipe, mode, settings, gemm)
        batch_shape = tuple(int(b) for b in batch_shape)
        states = [settings.recipe.init_state(batch_shape) for _ in range(3)]
        return cls(*states, settings)

    @jax.named_scope("fp8ax.Fp8DotGeneral")
    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: DimensionNumbers,
        precision=None,
        preferred_element_type=None,
    ) -> Array:
        """`jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)`
        computed on FP8-quantised operands.

        **Arguments:**

        - `lhs`: the input (activations), a floating-point array.
        - `rhs`: the kernel (weights), a floating-point array.
        - `dimension_numbers`: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`,
          as for `jax.lax.dot_general`.
        - `precision`: used for the forward GEMM unless `fwd_precision` was set.
        - `preferred_element_type`: the output dtype, as for `jax.lax.dot_general`.

        **Returns:**

        An array of the shape and dtype that `jax.lax.dot_general` returns for the same
        arguments (bf16 operands give a bf16 result unless `preferred_element_type` says
        otherwise).
        """
        st = self._program_settings()
        lhs = _check_operand(lhs, "lhs")
        rhs = _check_operand(rhs, "rhs")
        if st.compute_dtype is not None:
            lhs = lhs.astype(st.compute_dtype)
            rhs = rhs.astype(st.compute_dtype)
        raw = self._raw_state()
        state_is_max = tuple(is_max(v) for v in raw)
        if any(state_is_max):
            check_eager_shard_map()
        call = make_call(
            st,
            lhs.shape,
            np.dtype(lhs.dtype),
            rhs.shape,
            np.dtype(rhs.dtype),
            dimension_numbers,
            precision,
            preferred_element_type,
            state_is_max=state_is_max,
            lhs_vma=vma(lhs),
            rhs_vma=vma(rhs),
        )
        return quantized_dot(call, lhs, rhs, *raw)

    def _raw_state(self) -> tuple:
        if self.lhs is None:
            return ()
        raw = []
        for name in ("lhs", "rhs", "grad"):
            state: AbstractState = getattr(self, name)
            for leaf_name, leaf in zip(state.fields, state._raw()):
                if not (is_max(leaf) or getattr(leaf, "dtype", None) == np.float32):
                    raise TypeError(
                        f"FP8 state `{name}.{leaf_name}` has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}, but "
                        "must stay float32 (a bf16 amax or scale loses the precision the scaling needs). It was "
                        "probably cast along with the model: cast with `fp8ax.cast_floating(model, dtype)`, which "
                        "leaves FP8 state alone."
                    )
                raw.append(leaf)
        return tuple(raw)

    def _overwritten_by(self, new: "Fp8DotGeneral") -> "Fp8DotGeneral":
        # Used by `apply_updates`: take the new state of every layer the step used, and
        # leave first-call calibration behind (see `_settled`).
        if self.lhs is None:  # a stateless recipe: nothing to write
            return self
        states = (
            self.lhs._overwritten_by(new.lhs),
            self.rhs._overwritten_by(new.rhs),
            self.grad._overwritten_by(new.grad),
        )
        leaves = [leaf for s in states for leaf in jax.tree.leaves(s)]
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            base = self._settled()  # in a trace: what the trace saw (see `_settled`)
        else:  # concrete (`calibrate`, an eager update): what the data says
            recipe = self.settings.recipe
            filled = all(bool(np.all(recipe.state_observed(tuple(jax.tree.leaves(s))))) for s in states)
            base = self._settled() if filled else self
        return eqx.tree_at(
            lambda m: (m.lhs, m.rhs, m.grad), base, states, is_leaf=lambda x: isinstance(x, AbstractState)
        )

    def _settled(self) -> "Fp8DotGeneral":
        """This layer switched to the program of the recipe its recipe becomes once the
        state is written (`AbstractScalingRecipe.after_state_written`), in `apply_updates`
        and `calibrate`: `calibrating` becomes 0.0.

        For `DelayedScaling(calibrate_first_call=True)` that is the recipe without
        first-call calibration: the calibrating program, which a fresh layer's first step
        needs, picks per tensor between the scale from its own amax and the scale from its
        history, and XLA:GPU turns that small conditional into a `select` of both, so every
        FP8 cast would wait on a reduction of its own input on every step. `calibrating`,
        static under `eqx.filter_jit`, says which program to build instead: the
        first step is traced with calibration, the state it writes fills the histories,
        and the step after it compiles once more, to the program of delayed scaling alone.
        (A leaf rather than a static field: the pytree structure, and with it an
        optimiser state built from the whole model, stays the same.) Inside a trace the
        switch can only follow what the trace saw: every layer the gradient reaches is
        switched, and one that did not run in its first step (unused by the loss, or in
        the branch of a `lax.cond` not taken), or saw only zeros or NaNs, starts from scale
        1 when it first runs (Haliax's and Flax's first step), and follows its history
        after that. Written eagerly (`calibrate` does), the state is concrete and a layer
        is switched only once all three of its states have observed (`state_observed`)."""
        if self.settled:
            return self
        return eqx.tree_at(lambda m: m.calibrating, self, _SETTLED)

    # Haliax state dicts (`haliax.state_dict.to_state_dict`, Hugging Face export) hold
    # weights only: the FP8 state is training state, kept by training checkpoints
    # (`eqx.tree_serialise_leaves`), so a converted model exports exactly the keys and
    # values of the plain model and imports plain weights unchanged.
    def to_state_dict(self, prefix: str | None = None) -> dict:
        """Haliax state-dict hook: no entries (the FP8 state is not part of exports)."""
        del prefix
        return {}

    def from_state_dict(self, state_dict: dict, prefix: str | None = None) -> "Fp8DotGeneral":
        """Haliax state-dict hook: keeps this module's FP8 state as it is."""
        del state_dict, prefix
        return self


def make_call(
    settings,
    lhs_shape,
    lhs_dtype,
    rhs_shape,
    rhs_dtype,
    dimension_numbers,
    precision,
    preferred_element_type,
    *,
    state_is_max: tuple,
    lhs_vma,
    rhs_vma,
) -> Call:
    """The static description of one GEMM call (checked dimension numbers, output dtype,
    forward precision), shared by [`fp8ax.Fp8DotGeneral`][] and the serving dot general.
    The shapes and dtypes are those of the operands as the GEMM sees them."""
    dims = check_dimension_numbers(dimension_numbers, lhs_shape, rhs_shape)
    if preferred_element_type is not None:
        try:
            preferred_element_type = np.dtype(preferred_element_type)
        except TypeError:
            raise TypeError(
                f"`preferred_element_type` must be None or a floating dtype, got {preferred_element_type!r}."
            ) from None
        if not jnp.issubdtype(preferred_element_type, jnp.floating):
            raise TypeError(
                f"`preferred_element_type` must be a floating dtype for an FP8 dot, got {preferred_element_type}."
            )
    return Call(
        settings=settings,
        dims=dims,
        lhs_dtype=lhs_dtype,
        rhs_dtype=rhs_dtype,
        out_dtype=_out_dtype(lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, dims, preferred_element_type),
        fwd_precision=settings.fwd_precision if settings.fwd_precision is not None else precision,
        state_is_max=state_is_max,
        lhs_vma=lhs_vma,
        rhs_vma=rhs_vma,
    )


@functools.lru_cache(maxsize=1024)
def _out_dtype(lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, dims, preferred) -> np.dtype:
    """The dtype `lax.dot_general` gives for these arguments (traced once per signature)."""
    out = jax.eval_shape(
        functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=preferred),
        jax.ShapeDtypeStruct(lhs_shape, lhs_dtype),
        jax.ShapeDtypeStruct(rhs_shape, rhs_dtype),
    )
    return np.dtype(out.dtype)


def _check_operand(x, argname: str) -> Array:
    if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(
            f"`{argname}` must be a floating-point array, got a jax.ShapeDtypeStruct: the layer was called on an "
            "abstract value outside a trace. `eqx.filter_jit` treats a ShapeDtypeStruct leaf of a model as a static "
            "constant; to lower a step on abstract arrays (ahead-of-time compilation), pass the model's arrays as "
            "arguments of a `jax.jit` (`eqx.partition` the model, flatten the arrays, recombine them inside), as "
            "docs/faq.md shows."
        )
    if not isinstance(x, jax.Array | np.ndarray | np.generic):
        raise TypeError(f"`{argname}` must be a floating-point array, got {type(x).__name__}.")
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype in _formats.FP8_DTYPES:
        raise TypeError(
            f"`{argname}` must be a float16, bfloat16, float32 or float64 array to be quantised to FP8, got dtype "
            f"{dtype}. For integer or complex matmuls use `jax.lax.dot_general`."
        )
    return jnp.asarray(x)
