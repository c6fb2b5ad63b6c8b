# The recipe interface: what the GEMM pipeline asks of a recipe.
#
# Every recipe quantizes one operand of a GEMM, for a role (forward operand or output
# gradient: the recipe's `fwd_dtype` or `grad_dtype`) and the axes that GEMM contracts,
# into a `QuantizedArray` whose scale has a declared layout. A stateful recipe reads its
# state and returns the new one; the GEMM pipeline (`_gemm/`) is the same for all.
# The pipeline hands a recipe the operands of one call together (`plan`, then
# `quantize_operands`), so that a recipe can compute once per call what it would
# otherwise compute per operand: delayed scaling stacks the operands' states and reduces
# their histories together.

import abc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import equinox as eqx
import numpy as np
from jaxtyping import Array, ArrayLike

from .. import _formats
from .._quantized import QuantizedArray, ScaleLayout
from .._state import AbstractState

# What `quantize_operand` returns besides the quantized array: the new state of the
# operand (a `(scale, amax_history)` pair), or None for a stateless recipe.
NewState = tuple[Array, Array] | None


def as_fwd_dtype(value):
    return _formats.as_fp8_dtype(value, "fwd_dtype")


def as_grad_dtype(value):
    return _formats.as_fp8_dtype(value, "grad_dtype")


def no_merge(value):
    return value


class Operand(NamedTuple):
    """One operand of a call, as [`fp8ax.AbstractScalingRecipe.quantize_operands`][]
    takes it: the arguments of `quantize_operand`, plus the operand's `plan` and its
    `role` in the GEMM (`"lhs"`, `"rhs"` or `"grad"`; None when not known), by which a
    recipe picks per-role behavior (its format, a weight's 2D blocks)."""

    x: Array
    contracting_axes: tuple[int, ...]
    dtype: np.dtype
    state: tuple[Array, ...] | None = None
    key: Any = None
    merge: Callable[[Array], Array] = no_merge
    plan: Any = None
    role: str | None = None


def as_operands(operands) -> list[Operand]:
    operands = list(operands)
    for op in operands:
        if not isinstance(op, Operand):
            raise TypeError(
                f"`operands` must be a sequence of `fp8ax.Operand`, got an element of type {type(op).__name__}."
            )
    return operands


class AbstractScalingRecipe(eqx.Module):
    """How a low-precision dot general quantizes its operands: what every fp8ax recipe
    answers.

    A recipe is configuration only (all of its fields are static). It names the formats
    of the forward operands and of the output gradient (`fwd_dtype`, `grad_dtype`), the
    layout of its scales (`scale_layout`), and quantizes the operands of one GEMM call
    (`quantize_operands`). A recipe derives from one of two bases:

    - [`fp8ax.AbstractStatelessRecipe`][] (current, MX, int8, blockwise, NVFP4): the scale
      comes from the tensor itself; it implements `quantize_role`, and modules carry no
      state;
    - [`fp8ax.AbstractStatefulRecipe`][] ([`fp8ax.DelayedScaling`][]): the scale comes
      from a state that training writes back through the gradient (see
      [`fp8ax.apply_updates`][]); it implements `init_state`, `quantize_operand` and the
      questions the rest of fp8ax asks about a state.

    Concrete recipes are final: to change one, wrap it rather than subclass it.
    """

    fwd_dtype: eqx.AbstractVar[np.dtype]
    grad_dtype: eqx.AbstractVar[np.dtype]

    @property
    def stateful(self) -> bool:
        """Whether the recipe keeps state between steps."""
        return False

    @property
    def scale_layout(self) -> ScaleLayout:
        """The layout of the scales this recipe makes: `"tensor"`, `"row"` or `"block"`
        (see [`fp8ax.QuantizedArray`][]). A tensor-wise scale does not depend on the
        contracting axes, so the GEMM pipeline reuses a forward operand, quantized once,
        in the backward GEMMs."""
        raise NotImplementedError

    def dtype_for(self, role: str) -> np.dtype:
        """The format operand `role` (`"lhs"`, `"rhs"` or `"grad"`) is quantized to:
        `grad_dtype` for the output gradient, `fwd_dtype` for the others."""
        return self.grad_dtype if role == "grad" else self.fwd_dtype

    def contraction_independent(self, role: str) -> bool:
        """Whether operand `role` is quantized the same whatever axes its GEMM contracts,
        so that the forward pass's quantized copy serves the backward GEMMs too (and the
        output gradient is quantized once for both). True for tensor-wise scales (the
        default derives it from `scale_layout`); a recipe with 2D weight blocks says so
        for `"rhs"`."""
        del role
        return self.scale_layout == "tensor"

    def rounding_seed(self, role: str) -> int | None:
        """The seed operand `role` is rounded stochastically with, or None (the default)
        to round it to nearest. In a GEMM the pipeline derives the key of each tensor from
        this seed and the tensor's contents (reproducible, and new at every step) and
        hands it to `quantize_operand(s)` as `key`; [`fp8ax.quantize`][] takes the key
        from its caller."""
        del role
        return None

    def stochastic(self, role: str) -> bool:
        """Whether operand `role` is rounded stochastically (it then needs a `key`):
        `rounding_seed(role)` is not None. Override `rounding_seed`, not this."""
        return self.rounding_seed(role) is not None

    def __check_init__(self):
        if self.stateful and not isinstance(self, AbstractStatefulRecipe):
            raise TypeError(
                f"{type(self).__name__} keeps state (`stateful` is True): derive it from `fp8ax.AbstractStatefulRecipe`, "
                "which adds the state's members (`init_state`, `quantize_operand`, `state_observed`, ...), instead of "
                "`fp8ax.AbstractScalingRecipe`."
            )
        if type(self).stochastic is not AbstractScalingRecipe.stochastic:
            raise TypeError(
                f"{type(self).__name__} overrides `stochastic`; define `rounding_seed(role)` instead (the seed the "
                "operand is rounded stochastically with, or None to round to nearest): the GEMM pipeline derives "
                "each tensor's key from it."
            )

    def weight_gradient_rotation(self) -> Array | None:
        """An orthogonal `(n, n)` matrix that both operands of the weight-gradient GEMM
        (the activation and the output gradient) are multiplied by along their
        contraction, `n` elements at a time, before they are quantized (NVFP4's random
        Hadamard transform); the GEMM is unchanged in exact arithmetic. None (the
        default): no rotation."""
        return None

    def init_state(self, batch_shape: tuple[int, ...] = ()) -> AbstractState | None:
        """Fresh state for one operand (`batch_shape` for stacked layers), or None for a
        stateless recipe (this default): see [`fp8ax.AbstractStatefulRecipe`][]."""
        del batch_shape
        return None

    @abc.abstractmethod
    def quantize_operands(self, operands: Sequence[Operand]) -> list[tuple[QuantizedArray, NewState]]:
        """Quantizes the operands of one GEMM call (each an [`fp8ax.Operand`][]: the
        tensor, the axes its GEMM contracts, its format, and its state, key, role and plan
        as the recipe needs them), returning `(quantized, new_state)` for each, in order:
        a [`fp8ax.QuantizedArray`][] and, for a stateful recipe, the operand's new state
        (None otherwise). What the GEMM pipeline calls."""


class AbstractStatefulRecipe(AbstractScalingRecipe):
    """A recipe whose scales come from a state that training writes back: the state's
    members on top of [`fp8ax.AbstractScalingRecipe`][]'s.

    It implements `init_state` (a fresh state, an instance of the recipe's own
    [`fp8ax.AbstractState`][] subclass), `quantize_operand` (one operand with its state,
    returning the new one) and `state_observed`; the rest have defaults. The GEMM pipeline
    passes the state's arrays (in its `fields` order) to `plan` and `quantize_operand(s)`
    as a tuple, and the rest of fp8ax asks the recipe about them with the `state_*`
    methods and `serving_scale`, which receive the same tuple of concrete (NumPy) or
    traced float32 arrays, with the stacked-layer dimensions in front.
    [`fp8ax.DelayedScaling`][] is one; `tests/running_max.py` is one written outside
    fp8ax.
    """

    @property
    def stateful(self) -> bool:
        """True: the recipe keeps state between steps."""
        return True

    @abc.abstractmethod
    def init_state(self, batch_shape: tuple[int, ...] = ()) -> AbstractState:
        """Fresh state for one operand, one per entry of `batch_shape` (stacked layers):
        an instance of the recipe's own [`fp8ax.AbstractState`][] subclass. An
        [`fp8ax.Fp8DotGeneral`][] asks for the states of its three operands as one, with
        `batch_shape` ending in 3 (its role axis: lhs, rhs, grad), and the GEMM pipeline
        hands the recipe each operand's row."""

    @abc.abstractmethod
    def state_observed(self, state: tuple[ArrayLike, ...]) -> np.ndarray:
        """Per stacked layer (a bool array of the state's batch shape): whether the state
        holds an observation, so that its scale comes from data. `fp8ax.to_serving`
        refuses a state that has observed nothing. Concrete arrays only."""

    def state_valid(self, state: tuple[ArrayLike, ...]) -> np.ndarray:
        """Per stacked layer: whether the state is one fp8ax's updates can have written (a
        state that went through an optimizer is not). Concrete arrays only. The default
        accepts finite, non-negative arrays."""
        ok = None
        for value, extra in zip(state, self._entry_ndims()):
            value = np.asarray(value)
            here = np.all(np.isfinite(value) & (value >= 0), axis=tuple(range(value.ndim - extra, value.ndim)))
            ok = here if ok is None else ok & here
        return cast(np.ndarray, ok)  # set: a state has at least one field

    def _entry_ndims(self) -> tuple[int, ...]:
        return type(self.init_state()).entry_ndims

    def serving_scale(self, state: tuple[Array, ...], dtype: np.dtype) -> Array:
        """The dequantization scale, frozen from one layer's state (no stacked dimensions),
        that serving quantizes the input operand with, to `dtype`. `fp8ax.to_serving`
        calls it under `jax.jit` (and `vmap` for stacked layers). A stateful recipe that
        can be served defines it; the default refuses."""
        del state, dtype
        raise NotImplementedError(
            f"{type(self).__name__} does not say how to freeze its state for serving (`serving_scale`)."
        )

    def state_stats(self, state: tuple[ArrayLike, ...]) -> dict[str, np.ndarray]:
        """Named numbers from one operand's state, for [`fp8ax.scaling_stats`][]: each a
        NumPy array of the state's batch shape. Concrete arrays only. The default reports
        nothing."""
        del state
        return {}

    def state_history(self, state: tuple[ArrayLike, ...]) -> np.ndarray | None:
        """The amaxes the state remembers, newest first (shape `(*batch, n)`), for
        [`fp8ax.plot_amax_history`][]; None (the default) if it remembers none."""
        del state
        return None

    @abc.abstractmethod
    def quantize_operand(
        self,
        x: Array,
        contracting_axes: tuple[int, ...],
        dtype: np.dtype,
        *,
        state: tuple[Array, ...] | None = None,
        key: Any = None,
        merge: Callable[[Array], Array] = no_merge,
    ) -> tuple[QuantizedArray, NewState]:
        """Quantizes `x`, one operand of a GEMM that contracts `contracting_axes`, to
        `dtype` (the recipe's `fwd_dtype` or `grad_dtype`).

        **Arguments:**

        - `x`: the operand.
        - `contracting_axes`: the axes of `x` the GEMM contracts.
        - `dtype`: the low-precision format.
        - `state`: the arrays of the operand's state (float32, in the `fields` order of
          the recipe's state type: `(data,)` for delayed scaling). (Keyword only
          argument.)
        - `key`: a PRNG key for stochastic rounding, or None. (Keyword only argument.)
        - `merge`: reduces a per-call observation (an amax, or a pytree of values
          observed together) to one value for the whole observation: a max over `vmap`
          data axes and `shard_map` shards the state does not vary over. (Keyword only
          argument.)

        **Returns:**

        `(quantized, new_state)`: a [`fp8ax.QuantizedArray`][], and the arrays of the
        operand's state after this call, in the same order. The new
        state must be monotone non-decreasing in what the call observed: several uses of
        a layer are merged with an elementwise max.
        """

    def plan(self, states: Sequence[tuple[Array, ...] | None], dtypes: Sequence[np.dtype] | None = None) -> list[Any]:
        """What the operands of one call share, decided once from their states.

        The GEMM pipeline calls this once per call, in the forward pass, with the state
        of every operand of the call that this recipe quantizes with state (forward
        operands and output gradient) and the format each is quantized to (`dtypes`, in
        the same order; None when unknown), and hands each operand its plan in
        `quantize_operands`, in the forward pass or the backward one. A plan is a pytree
        of arrays (it is kept for the backward pass). The default plans nothing: one None
        per state.
        """
        del dtypes
        return [None] * len(states)

    def planned_scale(self, plan: Any) -> Array | None:
        """The tensor-wise scale an operand with this `plan` will be quantized with, if
        its state alone decides it (None otherwise, the default).

        The pipeline multiplies the planned scales of a GEMM's two operands into the
        GEMM's output scale beside them, and puts the plans and those products behind
        one optimization barrier: an FP8 cast then depends on nothing computed from its
        own tensor, and each GEMM's scale is ready with its operands' (on XLA:GPU, in the
        same kernel)."""
        del plan
        return None

    def quantize_operands(self, operands: Sequence[Operand]) -> list[tuple[QuantizedArray, NewState]]:
        """Quantizes several operands of one call, each as `quantize_operand` would, with
        their plans (see `plan`). This default quantizes them one by one."""
        return [
            self.quantize_operand(op.x, op.contracting_axes, op.dtype, state=op.state, key=op.key, merge=op.merge)
            for op in as_operands(operands)
        ]
