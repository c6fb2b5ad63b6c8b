import dataclasses
import functools
from typing import Unpack, cast

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from .. import _formats
from .._boundaries import check_eager_shard_map, vma
from .._gemm import (
    ROLES,
    SETTINGS_FIELDS,
    Call,
    DimensionNumbers,
    GemmKeywords,
    GemmSettings,
    Mode,
    SettingsView,
    check_dimension_numbers,
    explicitly_sharded,
    quantized_dot,
    settings_from,
    stateful_recipe,
)
from .._maxgrad import is_max, note_called, to_f32
from .._recipes import AbstractScalingRecipe
from .._state import CORRUPT_STATE, AbstractState, OverwriteWithGradient
from .advice import advise_gpu_compile


class Fp8DotGeneral(OverwriteWithGradient, SettingsView):
    """Low-precision drop-in for `jax.lax.dot_general`: FP8 (or MX, or int8) GEMMs.

    With [`fp8ax.DelayedScaling`][] (the default) it holds the scaling state of its three
    tensors as float32 leaves: `lhs` (the input), `rhs` (the kernel) and `grad` (the
    gradient of the output), each a [`fp8ax.ScalingState`][] with `scale` and
    `amax_history`. Its custom VJP returns the new state as the "gradient" of those
    leaves; see [`fp8ax.apply_updates`][]. With a stateless recipe
    ([`fp8ax.CurrentScaling`][], [`fp8ax.MXScaling`][], [`fp8ax.Int8Scaling`][]) the three
    fields are `None` and the module has no array leaves.

    Its array leaves are exactly those states' arrays, whatever happens to the model
    (`jax.device_put`, a `lax.scan` carry, `eqx.filter_vmap`, a checkpoint restore): a
    training step is one program, the first step's included (see
    [`fp8ax.DelayedScaling`][]'s `calibrate_first_call`), and an optimizer state built
    from the whole model (`opt.init(eqx.filter(model, eqx.is_array))`) matches the
    gradients on every step.

    Everything else is one static field, `settings` (an [`fp8ax.GemmSettings`][]); its
    fields can be read on the module too (`dg.recipe`, `dg.mode`, ...).

    It has the call signature of `jax.lax.dot_general`, so it goes wherever Haliax takes a
    `dot_general`: `hax.nn.Linear(..., dot_general=...)`, `hax.dot(..., dot_general=...)`,
    `NamedArray.dot(..., dot_general=...)`.
    """

    lhs: AbstractState | None
    rhs: AbstractState | None
    grad: AbstractState | None
    settings: GemmSettings = eqx.field(static=True)

    def __init__(self, lhs, rhs, grad, settings: GemmSettings | None = None, **changes):
        """Builds the module from its state and settings; most code wants
        [`fp8ax.Fp8DotGeneral.init`][] instead. Keyword arguments named like a field of
        [`fp8ax.GemmSettings`][] replace that field of `settings` (so
        `dataclasses.replace(dg, mode="qdq")` works)."""
        settings = GemmSettings() if settings is None else settings
        if not isinstance(settings, GemmSettings):
            raise TypeError(f"`settings` must be an `fp8ax.GemmSettings`, got {type(settings).__name__}.")
        unknown = sorted(set(changes) - set(SETTINGS_FIELDS))
        if unknown:
            raise TypeError(f"`Fp8DotGeneral` got unexpected keyword arguments {unknown}.")
        if changes:
            settings = dataclasses.replace(settings, **changes)
        self.lhs, self.rhs, self.grad, self.settings = lhs, rhs, grad, settings

    def __check_init__(self):
        for name in ("lhs", "rhs", "grad"):
            if not isinstance(getattr(self, name), AbstractState | None):
                raise TypeError(
                    f"`{name}` must be a recipe's state (an `fp8ax.AbstractState`, such as `fp8ax.ScalingState`) or "
                    f"None, got {type(getattr(self, name)).__name__}."
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
        lhs, rhs, grad = (settings.recipe.init_state(batch_shape) for _ in range(3))
        return cls(lhs, rhs, grad, settings)

    @jax.named_scope("fp8ax.Fp8DotGeneral")
    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        dimension_numbers: DimensionNumbers,
        precision=None,
        preferred_element_type=None,
        *,
        out_sharding=None,
        reduction_order=None,
    ) -> Array:
        """`jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
        out_sharding=out_sharding)` computed on FP8-quantized operands.

        **Arguments:**

        - `lhs`: the input (activations), a floating-point array.
        - `rhs`: the kernel (weights), a floating-point array.
        - `dimension_numbers`: `((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`,
          as for `jax.lax.dot_general`.
        - `precision`: used for the forward GEMM unless `fwd_precision` was set.
        - `preferred_element_type`: the output dtype, as for `jax.lax.dot_general`.
        - `out_sharding`: the result's sharding, as for `jax.lax.dot_general` (a
          `PartitionSpec` or `NamedSharding` of explicit mesh axes; Haliax passes one under
          an explicit mesh, None otherwise). (Keyword only argument.)
        - `reduction_order`: must be None (the default). `jax.lax.dot_general` takes it from
          jax 0.12.1 on, to set the order of the contraction's sums; an FP8 GEMM sums in its
          kernel's order, so any other value raises `NotImplementedError`. (Keyword only
          argument.)

        **Returns:**

        An array of the shape and dtype that `jax.lax.dot_general` returns for the same
        arguments (bf16 operands give a bf16 result unless `preferred_element_type` says
        otherwise), sharded as `out_sharding` says.
        """
        check_reduction_order(reduction_order, "fp8ax.Fp8DotGeneral")
        st = self.settings
        lhs = check_operand(lhs, "lhs")
        rhs = check_operand(rhs, "rhs")
        check_explicit_sharding("fp8ax.Fp8DotGeneral", st, lhs, rhs)
        lhs, rhs, raw, state_is_max = Fp8DotGeneral._begin_call(self, lhs, rhs)
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
        return with_out_sharding(quantized_dot(call, lhs, rhs, *raw), out_sharding)

    def _state_problems(self, empty: bool = True) -> list[tuple[str, str]]:
        """`(role, problem)` for each of `lhs`, `rhs`, `grad` whose state is `"corrupt"`
        (values no fp8ax update writes: it went through an optimizer) or, if `empty`,
        `"empty"` (it has observed nothing: the layer was never run, or its new state was
        never written); for stacked layers, a problem of any entry. Reads the values:
        concrete arrays only. Empty for a stateless recipe."""
        if self.lhs is None:
            return []
        recipe = stateful_recipe(self.settings)
        out = []
        for role in ("lhs", "rhs", "grad"):
            fields = tuple(jax.tree.leaves(getattr(self, role)))
            if any(isinstance(v, jax.core.Tracer) for v in fields):
                raise ValueError("The FP8 state's values are read here, so this must be called outside `jax.jit`.")
            fields = tuple(np.asarray(v) for v in fields)
            if not np.all(recipe.state_valid(fields)):
                out.append((role, "corrupt"))
            elif empty and not np.all(recipe.state_observed(fields)):
                out.append((role, "empty"))
        return out

    def _begin_call(self, lhs: Array, rhs: Array) -> tuple[Array, Array, tuple, tuple[bool, ...]]:
        """What every call of an op does first: the operands in `compute_dtype`, the
        state's raw arrays and which of them are in max form, the checks on the state
        and the one-time GPU advice."""
        st = self.settings
        if st.compute_dtype is not None:
            lhs = lhs.astype(st.compute_dtype)
            rhs = rhs.astype(st.compute_dtype)
        # (Methods of an Equinox module are called through the class in the paths every
        # call and step take: `self.method` builds a bound-method module, which
        # flattens `self`, a fresh view of each traced state: see `_state._view`.)
        raw = Fp8DotGeneral._raw_state(self)
        state_is_max = tuple(is_max(v) for v in raw)
        if any(state_is_max):
            check_eager_shard_map()
            # A float32 view of each state value, never used: where the call runs in a
            # branch of a per-example `lax.cond` under `vmap` (the state closed over), the
            # view's batching rule is where fp8ax recognises the rule that would sum the
            # state, and refuses if the step is differentiated (`_boundaries.py`). Dead
            # code otherwise, which JAX drops.
            for v in raw:
                if is_max(v):
                    to_f32(v)
        Fp8DotGeneral._refuse_corrupt_state(self, raw)
        advise_gpu_compile()
        return lhs, rhs, raw, state_is_max

    def _refuse_corrupt_state(self, raw: tuple) -> None:
        # An eager call sees the state's values: it refuses one that went through an
        # optimizer. (A traced step cannot raise without a host callback, which would
        # keep JAX's persistent cache from storing it: it calibrates on such a state
        # instead, and `fp8ax.check_state` reports it.)
        if not raw or any(isinstance(v, jax.core.Tracer) for v in raw):
            return
        corrupt = [role for role, _ in self._state_problems(empty=False)]
        if corrupt:
            raise ValueError(f"FP8 state `{corrupt[0]}`: {CORRUPT_STATE}")

    def _raw_state(self) -> tuple:
        if self.lhs is None:
            return ()
        note_called(self.lhs._name)
        raw = []
        for name in ("lhs", "rhs", "grad"):
            state: AbstractState = getattr(self, name)
            for leaf_name, leaf in zip(state.fields, state._raw()):
                if not (is_max(leaf) or getattr(leaf, "dtype", None) == np.float32):
                    raise TypeError(
                        f"FP8 state `{name}.{leaf_name}` has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}, but "
                        "must be float32 or bfloat16 (whose float32 exponent range holds every scale and amax; "
                        "float16 overflows above 65504 and flushes small scales to zero). It was probably cast "
                        "along with the model: cast to bfloat16 instead (a mixed-precision policy such as jmp's "
                        "`p=f32,c=bfloat16`), or with `fp8ax.cast_floating(model, dtype)`, which leaves FP8 state "
                        "alone."
                    )
                raw.append(leaf)
        return tuple(raw)

    def _with_named_state(self, batch_axes: tuple[tuple[str, int], ...]) -> "Fp8DotGeneral":
        """This op with its states' axes named (the state of a Haliax layer): `batch_axes`,
        `(name, size)` pairs, for the stacked-layer dimensions (see `AbstractState`)."""
        if self.lhs is None:
            return self
        states = tuple(cast(AbstractState, s)._named(batch_axes) for s in (self.lhs, self.rhs, self.grad))
        return _with_states(self, states)

    def _labelled(self, path: str) -> "Fp8DotGeneral":
        """This op with its states named after the layer at `path` (for the warning about
        a layer the training step never calls)."""
        if self.lhs is None:
            return self
        states = tuple(cast(AbstractState, s)._labelled(path) for s in (self.lhs, self.rhs, self.grad))
        return _with_states(self, states)

    def _overwritten_by(self, new: "Fp8DotGeneral") -> "Fp8DotGeneral":
        # Used by `apply_updates`: take the new state of every layer the step used.
        if self.lhs is None:  # a stateless recipe: nothing to write
            return self
        # A stateful op holds its three states together (`init` makes them so); a `new`
        # without them is refused by `AbstractState._overwritten_by`.
        old = cast(tuple[AbstractState, ...], (self.lhs, self.rhs, self.grad))
        written = cast(tuple[AbstractState, ...], (new.lhs, new.rhs, new.grad))
        states = tuple(o._overwritten_by(n) for o, n in zip(old, written))
        return _with_states(self, states)

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


def _with_states(op: Fp8DotGeneral, states: tuple) -> Fp8DotGeneral:
    """`op` with its `(lhs, rhs, grad)` states replaced, everything else shared. Written
    out rather than `eqx.tree_at`, which flattens `op` twice: with a traced state, each
    flatten makes a fresh view of each state value (`_state._view`), per layer and step."""
    new = object.__new__(type(op))
    new.__dict__.update(op.__dict__)
    for name, state in zip(("lhs", "rhs", "grad"), states, strict=True):
        object.__setattr__(new, name, state)
    return new


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


def check_reduction_order(reduction_order, op: str) -> None:
    """Refuses a `reduction_order` other than None, the keyword `jax.lax.dot_general` and
    `jax.lax.ragged_dot` take from jax 0.12.1 on (an order for the contraction's sums):
    an FP8 GEMM sums in its kernel's own order. `jnp.einsum` passes it to its
    `_dot_general` only when it is set."""
    if reduction_order is not None:
        raise NotImplementedError(
            f"`{op}` takes no `reduction_order` (got {reduction_order!r}): an FP8 GEMM sums its products in the "
            "order of the GEMM kernel, which fp8ax does not choose. Leave the layers whose sums need an order in "
            "high precision (`fp8ax.Fp8Config(targets=...)`)."
        )


def check_operand(x, argname: str) -> Array:
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
            f"`{argname}` must be a float16, bfloat16, float32 or float64 array to be quantized to FP8, got dtype "
            f"{dtype}. For integer or complex matmuls use `jax.lax.dot_general`."
        )
    return jnp.asarray(x)


def with_out_sharding(out: Array, out_sharding) -> Array:
    """`out` sharded as a `dot_general`'s `out_sharding` asks (JAX's `reshard`, which takes
    and refuses the same shardings as `jax.lax.dot_general`). A sharding on an empty mesh,
    which `jnp.einsum` passes outside any mesh, asks for nothing, as in `dot_general`."""
    if out_sharding is None or getattr(getattr(out_sharding, "mesh", None), "empty", False):
        return out
    return jax.sharding.reshard(out, out_sharding)


def check_explicit_sharding(op: str, settings: GemmSettings | None, *operands) -> None:
    """Under JAX's explicit sharding, fp8ax runs tensor-wise recipes (delayed scaling,
    tensor-wise current scaling) in its dense op; anything else raises here, in fp8ax's
    words, instead of a sharding error from inside a quantizer. (`settings` None: the op
    supports no explicit sharding at all.)"""
    if not any(explicitly_sharded(x) for x in operands):
        return
    recipes = [] if settings is None else [settings.operand_recipe(r) for r in ROLES]
    if settings is not None and all(r is None or r.scale_layout == "tensor" for r in recipes):
        return
    what = "this op" if settings is None else f"recipe {settings.recipe!r}"
    raise NotImplementedError(
        f"fp8ax: {op} got operands sharded over explicit mesh axes (`jax.sharding.AxisType.Explicit`), which "
        f"fp8ax supports for tensor-wise recipes in `Fp8DotGeneral` only (`DelayedScaling()`, "
        f"`CurrentScaling('tensor')`), not for {what}. Make the mesh's axes `AxisType.Auto` (the default of "
        "`jax.make_mesh`), or use a tensor-wise recipe."
    )
