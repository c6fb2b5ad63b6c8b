import dataclasses
import functools
from typing import ClassVar, Unpack, cast

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
    tensors, the input (`lhs`), the kernel (`rhs`) and the gradient of the output
    (`grad`), in one field, `state`: one [`fp8ax.ScalingState`][] whose array has a role
    axis of size 3 (in that order) before the state's own axis, `(*batch, 3,
    history_length + 2)`. One array per layer, not three, keeps each flatten, view and
    rebuild of a traced model, and each step's state write, at one per layer
    (docs/state.md, "What the state costs"). `lhs`, `rhs` and `grad` read the three rows
    as states of their own (`dg.lhs.scale`, `dg.grad.amax_history`); `with_states`
    replaces them. Its custom VJP returns the new state as the "gradient" of `state`; see
    [`fp8ax.apply_updates`][]. With a stateless recipe ([`fp8ax.CurrentScaling`][],
    [`fp8ax.MXScaling`][], [`fp8ax.Int8Scaling`][]) `state` is `None` (and so are `lhs`,
    `rhs` and `grad`) and the module has no array leaves.

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

    state: AbstractState | tuple[AbstractState, AbstractState, AbstractState] | None
    settings: GemmSettings = eqx.field(static=True)

    # Whether `state` is one state with a role axis (this class), or the three states
    # themselves, a tuple (`Fp8RaggedDot`, whose states differ in shape).
    _roles_stacked: ClassVar[bool] = True

    def __init__(self, state=None, settings: GemmSettings | None = None, *extra, **changes):
        """Builds the module from its state and settings; most code wants
        [`fp8ax.Fp8DotGeneral.init`][] instead.

        **Arguments:**

        - `state`: the recipe's state of the three operands, with the role axis (size 3:
          lhs, rhs, grad) last among its stacked dimensions; or a tuple `(lhs, rhs, grad)`
          of three states of one type and shape, which are stacked into one; or `None`
          (a stateless recipe).
        - `settings`: an [`fp8ax.GemmSettings`][] (default: its defaults).
        - Keyword arguments named like a field of [`fp8ax.GemmSettings`][] replace that
          field of `settings` (so `dataclasses.replace(dg, mode="qdq")` works).
        """
        if extra or isinstance(settings, AbstractState):
            raise TypeError(
                "`Fp8DotGeneral` takes its three states as one argument since they are held in one array: "
                f"`{type(self).__name__}((lhs, rhs, grad), settings)`; got {2 + len(extra)} positional arguments, "
                f"the second a {type(settings).__name__}."
            )
        settings = GemmSettings() if settings is None else settings
        if not isinstance(settings, GemmSettings):
            raise TypeError(f"`settings` must be an `fp8ax.GemmSettings`, got {type(settings).__name__}.")
        unknown = sorted(set(changes) - set(SETTINGS_FIELDS))
        if unknown:
            raise TypeError(f"`Fp8DotGeneral` got unexpected keyword arguments {unknown}.")
        if changes:
            settings = dataclasses.replace(settings, **changes)
        if isinstance(state, tuple | list) and all(s is None for s in state):
            state = None  # (a stateless recipe's three "states")
        if isinstance(state, tuple | list):
            state = _stacked_roles(tuple(state)) if type(self)._roles_stacked else _three_states(tuple(state))
        self.state, self.settings = state, settings

    def __check_init__(self):
        if self.state is None or not type(self)._roles_stacked:
            return
        if not isinstance(self.state, AbstractState):
            raise TypeError(
                "`state` must be a recipe's state (an `fp8ax.AbstractState`, such as `fp8ax.ScalingState`) with a "
                f"role axis of size 3, a tuple (lhs, rhs, grad) of states, or None; got {type(self.state).__name__}."
            )
        batch = self.state.batch_shape
        if not batch or batch[-1] != len(ROLES):
            raise ValueError(
                "`state` must hold the three operands' states (lhs, rhs, grad) along a role axis of size 3, the "
                f"last of its stacked dimensions; got a `{type(self.state).__name__}` of batch shape {batch}. Give "
                "`(lhs, rhs, grad)` to stack three states."
            )

    @property
    def lhs(self) -> AbstractState | None:
        """The input's state: row 0 of `state` (None for a stateless recipe)."""
        return _role(self, 0)

    @property
    def rhs(self) -> AbstractState | None:
        """The kernel's state: row 1 of `state` (None for a stateless recipe)."""
        return _role(self, 1)

    @property
    def grad(self) -> AbstractState | None:
        """The output gradient's state: row 2 of `state` (None for a stateless recipe)."""
        return _role(self, 2)

    def with_states(
        self, *, lhs: AbstractState | None = None, rhs: AbstractState | None = None, grad: AbstractState | None = None
    ) -> "Fp8DotGeneral":
        """This op with the states given replaced (each of the type and shape of the one
        it replaces: `lhs`, `rhs`, `grad` as read), the others kept.

        !!! Example

            ```python
            dg = dg.with_states(lhs=fp8ax.ScalingState(scale, amax_history))
            ```
        """
        if self.state is None:
            raise ValueError("This `Fp8DotGeneral` has a stateless recipe: it has no state to replace.")
        given = {"lhs": lhs, "rhs": rhs, "grad": grad}
        states = []
        for role, new in given.items():
            old = getattr(self, role)
            if new is None:
                states.append(old)
                continue
            if type(new) is not type(old) or [np.shape(v) for v in new._values] != [np.shape(v) for v in old._values]:
                raise ValueError(
                    f"`{role}` must be a `{type(old).__name__}` of the shapes of the state it replaces "
                    f"({[np.shape(v) for v in old._values]}), got {new!r}."
                )
            states.append(new)
        if not type(self)._roles_stacked:
            return _with_state(self, tuple(states))
        return _with_state(self, _stacked_roles(tuple(states), cast(AbstractState, self.state)))

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
        return cls(settings.recipe.init_state((*batch_shape, len(ROLES))), settings)

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
            state_role_axes=_role_axes(self),
        )
        return with_out_sharding(quantized_dot(call, lhs, rhs, *raw), out_sharding)

    def _state_problems(self, empty: bool = True) -> list[tuple[str, str]]:
        """`(role, problem)` for each of `lhs`, `rhs`, `grad` whose state is `"corrupt"`
        (values no fp8ax update writes: it went through an optimizer) or, if `empty`,
        `"empty"` (it has observed nothing: the layer was never run, or its new state was
        never written); for stacked layers, a problem of any entry. Reads the values:
        concrete arrays only. Empty for a stateless recipe."""
        if self.state is None:
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
        if self.state is None:
            return ()
        states = _states(self)
        note_called(states[0]._name)
        raw = []
        names = ROLES if len(states) > 1 else ("state",)
        for where, state in zip(names, states):
            for leaf_name, leaf in zip(state.fields, state._raw()):
                if not (is_max(leaf) or getattr(leaf, "dtype", None) == np.float32):
                    raise TypeError(
                        f"FP8 state `{where}.{leaf_name}` has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}, but "
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
        if self.state is None:
            return self
        if not isinstance(self.state, AbstractState):
            return _with_state(self, tuple(s._named(batch_axes) for s in _states(self)))
        return _with_state(self, self.state._named((*batch_axes, (ROLE_AXIS, len(ROLES)))))

    def _labelled(self, path: str) -> "Fp8DotGeneral":
        """This op with its states named after the layer at `path` (for the warning about
        a layer the training step never calls)."""
        if self.state is None:
            return self
        return _with_state(self, _mapped(self.state, lambda s: s._labelled(path)))

    def _overwritten_by(self, new: "Fp8DotGeneral") -> "Fp8DotGeneral":
        # Used by `apply_updates`: take the new state of every layer the step used.
        if self.state is None:  # a stateless recipe: nothing to write
            return self
        # A stateful op holds its states together (`init` makes them so); a `new` without
        # them is refused by `AbstractState._overwritten_by`.
        if not isinstance(self.state, AbstractState):
            return _with_state(self, tuple(o._overwritten_by(n) for o, n in zip(_states(self), _states(new))))
        return _with_state(self, self.state._overwritten_by(_states(new)[0]))

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


def _with_state(op: Fp8DotGeneral, state) -> Fp8DotGeneral:
    """`op` with its `state` replaced, everything else shared. Written out rather than
    `eqx.tree_at`, which flattens `op` twice: with a traced state, each flatten makes a
    fresh view of each state value (`_state._view`), per layer and step."""
    new = object.__new__(type(op))
    new.__dict__.update(op.__dict__)
    object.__setattr__(new, "state", state)
    return new


def _states(op: Fp8DotGeneral) -> tuple:
    """`op`'s states as it holds them: its one state, or its three (`Fp8RaggedDot`)."""
    return op.state if isinstance(op.state, tuple) else (op.state,)


def _role_axes(op: Fp8DotGeneral) -> tuple[int, ...]:
    """`Call.state_role_axes` of `op`'s state: its role axis, counted from the end of each
    of its arrays; empty for three states or none."""
    if not isinstance(op.state, AbstractState):
        return ()
    return tuple(-1 - e for e in op.state.entry_ndims)


def _mapped(state, fn):
    return tuple(fn(s) for s in state) if isinstance(state, tuple) else fn(state)


def _role(op: Fp8DotGeneral, i: int) -> AbstractState | None:
    if op.state is None:
        return None
    if isinstance(op.state, tuple):
        return op.state[i]
    if not isinstance(op.state, AbstractState) or not all(hasattr(v, "shape") for v in op.state._values):
        # (A placeholder: `eqx.tree_at`'s, or a filter's None.) Not an AttributeError,
        # which would send Python to `__getattr__` and its "no attribute" message.
        raise TypeError(
            f"`{ROLES[i]}` is row {i} of the layer's one state (`state`, with a role axis: lhs, rhs, grad), read "
            f"from it; it is not a pytree node of its own. To replace it, use `dg.with_states({ROLES[i]}=...)`, "
            "or replace `state` (`eqx.tree_at(lambda m: m.state, dg, new_state)`)."
        )
    return _role_of(op.state, i)


def _three_states(states: tuple) -> tuple:
    if len(states) != len(ROLES) or not all(isinstance(s, AbstractState) for s in states):
        raise TypeError(
            "`state` must be a tuple of three states (lhs, rhs, grad), each an `fp8ax.AbstractState`, or None; got "
            f"{tuple(type(s).__name__ for s in states)}."
        )
    return states


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
    state_role_axes: tuple[int, ...] = (),
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
        state_role_axes=state_role_axes,
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


# The name of the role axis of a Haliax layer's state (see `AbstractState`'s named axes).
ROLE_AXIS = "fp8ax_role"


def _role_of(state: AbstractState, i: int) -> AbstractState:
    """Row `i` of `state`'s role axis (see `Fp8DotGeneral`), a state of the same type."""
    values, axes = [], state._axes_of()
    for k, extra in enumerate(state.entry_ndims):
        v = state._leaf(k)
        values.append(None if v is None else _eager_if_concrete(_row, v, i, np.ndim(v) - extra - 1))
    if axes is not None:
        axes = tuple(
            None if ax is None else tuple(p for j, p in enumerate(ax) if j != len(ax) - extra - 1)
            for ax, extra in zip(axes, state.entry_ndims)
        )
    return type(state)._make(tuple(values), axes, state._label)


def _stacked_roles(states: tuple, like: AbstractState | None = None) -> AbstractState:
    """The states `(lhs, rhs, grad)` stacked along a new role axis (see `Fp8DotGeneral`),
    with `like`'s axis names and label where given."""
    if len(states) != len(ROLES) or not all(isinstance(s, AbstractState) for s in states):
        raise TypeError(
            f"`state` as a tuple must hold three states (lhs, rhs, grad), got {tuple(type(s).__name__ for s in states)}."
        )
    first = states[0]
    shapes = [[np.shape(v) for v in s._values] for s in states]
    if any(type(s) is not type(first) for s in states) or any(sh != shapes[0] for sh in shapes):
        raise ValueError(
            "The three states (lhs, rhs, grad) must be of one type and shape, got "
            f"{[type(s).__name__ for s in states]} of shapes {shapes}."
        )
    values = []
    for k, extra in enumerate(first.entry_ndims):
        rows = [s._leaf(k) for s in states]
        values.append(_eager_if_concrete(_stack, rows, np.ndim(rows[0]) - extra))
    if like is not None:
        return type(first)._make(tuple(values), like._axes_of(), like._label)
    axes = first._axes_of()
    if axes is not None:
        axes = tuple(
            None if ax is None else (*ax[: len(ax) - extra], (ROLE_AXIS, len(ROLES)), *ax[len(ax) - extra :])
            for ax, extra in zip(axes, first.entry_ndims)
        )
    return type(first)._make(tuple(values), axes, first._label)


def _row(x, i, axis):
    return lax.index_in_dim(x, i, axis, keepdims=False)


def _stack(rows, axis):
    return jnp.stack(rows, axis=axis)


def _eager_if_concrete(fn, x, *args):
    """`fn(x, *args)` (`x` an array or a list of them), computed at once where `x` holds
    no tracer, even inside a trace (a model closed over by a jitted function reads
    concrete states, and must not stage their rows)."""
    if any(isinstance(v, jax.core.Tracer) for v in (x if isinstance(x, list) else [x])):
        return fn(x, *args)
    with jax.ensure_compile_time_eval():
        return fn(x, *args)
