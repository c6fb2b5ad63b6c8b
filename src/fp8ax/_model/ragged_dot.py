# `Fp8RaggedDot`: the grouped-GEMM op (mixture-of-experts), a drop-in for `jax.lax.ragged_dot`.

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

if TYPE_CHECKING:
    pass

from .._boundaries import vma
from .._gemm import (
    Call,
    GemmKeywords,
    GemmSettings,
    Mode,
    RaggedCall,
    ragged_out_dtype,
    ragged_quantized_dot,
    settings_from,
)
from .._recipes import AbstractScalingRecipe
from .dot_general import (
    Fp8DotGeneral,
    check_explicit_sharding,
    check_operand,
    check_reduction_order,
    with_out_sharding,
)


class Fp8RaggedDot(Fp8DotGeneral):
    """Low-precision drop-in for `jax.lax.ragged_dot`: the grouped GEMM of a
    mixture-of-experts layer, in FP8 (or MX, NVFP4, int8), with its three GEMMs (forward,
    input gradient, weight gradient) as ragged dots on quantized operands.

    `fp8ax.fp8_linear_layers` puts one in every `haliax.nn.MoELinear` it converts (see
    [`fp8ax.Fp8MoELinear`][]); Equinox code calls it directly, as it would call
    `jax.lax.ragged_dot`.

    It is an [`fp8ax.Fp8DotGeneral`][] in everything but the call and the state's form: the
    same settings, the same states (`lhs`, `rhs`, `grad`) written by the same custom-VJP
    "gradient", so
    [`fp8ax.partition_for_grad_overwrite`][], [`fp8ax.apply_updates`][],
    [`fp8ax.calibrate`][] and [`fp8ax.scaling_stats`][] work unchanged, and several uses
    of one layer merge their state by `max`. With `per_expert_weights` (the default of
    [`fp8ax.Fp8RaggedDot.init`][] when given `num_experts`), each expert's weight is
    quantized as a tensor of its own: the `rhs` state has one entry per expert (a leading
    `Experts` dimension), and an expert that no token reaches in a call records nothing
    and keeps its state. Its states differ in shape, so `state` holds them as a tuple
    `(lhs, rhs, grad)` of three states, where [`fp8ax.Fp8DotGeneral`][] holds one state
    with a role axis.

    The tokens (`lhs`) and the output gradient are scaled as one tensor each (or per
    row, for row-wise recipes). MX, blockwise and NVFP4 blocks along the tokens (the
    weight gradient's contraction) may span two groups; the emulation is exact for any
    block layout. `EmulatedAccumulation`, `block_scaled_gemm=True` and NVFP4's Hadamard
    rotation of the weight gradient (which mixes the tokens of neighbouring groups) are not
    used for grouped GEMMs: the first two are refused, the rotation is skipped.
    """

    per_expert_weights: bool = eqx.field(static=True)
    per_group_tokens: bool = eqx.field(static=True)

    _roles_stacked: ClassVar[bool] = False

    def __init__(
        self,
        state=None,
        settings: GemmSettings | None = None,
        per_expert_weights=False,
        per_group_tokens=False,
        **changes,
    ):
        """Builds the module from its states `(lhs, rhs, grad)` (a tuple, or None for a
        stateless recipe) and settings; most code wants [`fp8ax.Fp8RaggedDot.init`][]
        instead."""
        super().__init__(state, settings, **changes)
        for name, value in (("per_expert_weights", per_expert_weights), ("per_group_tokens", per_group_tokens)):
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool, got {value!r}.")
        self.per_expert_weights = per_expert_weights
        self.per_group_tokens = per_group_tokens

    @property
    def layer_batch_shape(self) -> tuple[int, ...]:
        """The stacked-layer dimensions of the state (without the per-expert or per-group
        one)."""
        lhs = self.lhs
        if lhs is None:
            return ()
        shape = lhs.batch_shape
        return shape[:-1] if self.per_group_tokens else shape

    def __check_init__(self):
        super().__check_init__()
        st = self.settings
        if st.accumulation is not None:
            raise ValueError(
                "`accumulation` (an `fp8ax.EmulatedAccumulation`) is not supported for grouped GEMMs "
                "(`Fp8RaggedDot`): leave it None."
            )
        if self.per_group_tokens:
            for role in ("lhs", "grad"):
                recipe = st.operand_recipe(role)
                if recipe is not None and not recipe.contraction_independent(role):
                    raise ValueError(
                        f"`per_group_tokens=True` scales the tokens and output gradients of each group as one tensor, "
                        f"so it needs a recipe with one scale per tensor for them; {type(recipe).__name__} scales the "
                        f"`{role}` per row or block."
                    )
        if st.block_scaled_gemm is True:
            raise ValueError(
                "`block_scaled_gemm=True` is not supported for grouped GEMMs (`Fp8RaggedDot`): "
                "`jax.nn.scaled_matmul` has no grouped form. Leave it None or False."
            )

    @classmethod
    def init(
        cls,
        recipe: AbstractScalingRecipe | None = None,
        *,
        num_experts: int | None = None,
        per_expert_weights: bool | None = None,
        per_group_tokens: bool = False,
        settings: GemmSettings | None = None,
        batch_shape: tuple[int, ...] = (),
        mode: Mode = "direct",
        **gemm: Unpack[GemmKeywords],
    ) -> Fp8RaggedDot:
        """Builds an `Fp8RaggedDot` with fresh state (scale 1, empty history).

        **Arguments:**

        - `recipe`: the scaling recipe; default [`fp8ax.DelayedScaling`][]`()`.
        - `num_experts`: the number of groups (experts). Needed for per-expert weight
          scales with a stateful recipe (the state has one entry per expert). (Keyword
          only argument.)
        - `per_expert_weights`: quantize each expert's weight as a tensor of its own;
          default: True when `num_experts` is given, else False. (Keyword only
          argument.)
        - `per_group_tokens`: scale the tokens (and the output gradients) of each group
          together, one scale per group, instead of one per tensor; needs `num_experts`
          for a stateful recipe and a recipe with tensor scales. (Keyword only argument.)
        - `settings`, `batch_shape`, `mode`, and the GEMM keyword arguments: as for
          [`fp8ax.Fp8DotGeneral.init`][]. (Keyword only arguments.)
        """
        settings = settings_from("Fp8RaggedDot.init", recipe, mode, settings, gemm)
        if per_expert_weights is None:
            per_expert_weights = num_experts is not None
        if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer)):
            raise TypeError(f"`num_experts` must be None or an int >= 1, got {num_experts!r}.")
        if num_experts is not None and num_experts < 1:
            raise ValueError(f"`num_experts` must be >= 1, got {num_experts}.")
        batch_shape = tuple(int(b) for b in batch_shape)
        recipe = settings.recipe
        stateful = recipe.init_state(batch_shape) is not None
        for name, wanted in (("per_expert_weights", per_expert_weights), ("per_group_tokens", per_group_tokens)):
            if wanted and stateful and num_experts is None:
                raise ValueError(
                    f"`{name}=True` with a stateful recipe needs `num_experts` (one state per expert or group)."
                )
        experts = () if num_experts is None else (int(num_experts),)
        tokens = batch_shape + (experts if per_group_tokens else ())
        lhs = recipe.init_state(tokens)
        grad = recipe.init_state(tokens)
        rhs = recipe.init_state(batch_shape + (experts if per_expert_weights else ()))
        return cls(
            (lhs, rhs, grad), settings, per_expert_weights=bool(per_expert_weights), per_group_tokens=per_group_tokens
        )

    @jax.named_scope("fp8ax.Fp8RaggedDot")
    def __call__(
        self,
        lhs: ArrayLike,
        rhs: ArrayLike,
        group_sizes: ArrayLike,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
        out_sharding=None,
        *,
        reduction_order=None,
    ) -> Array:
        """`jax.lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type,
        group_offset, out_sharding)` computed on quantized operands.

        **Arguments:**

        - `lhs`: the tokens, (M, K), grouped: the first `group_sizes[0]` rows go to
          expert 0, the next `group_sizes[1]` to expert 1, and so on.
        - `rhs`: the expert weights, (G, K, N).
        - `group_sizes`: (G,) integers, summing to at most M (rows past the sum give
          zeros).
        - `precision`: used for the forward GEMM unless `fwd_precision` was set.
        - `preferred_element_type`: the output dtype, as for `jax.lax.ragged_dot`.
        - `group_offset`: not supported (must be None).
        - `out_sharding`: the result's sharding, as for `jax.lax.ragged_dot`. (Operands
          sharded over explicit mesh axes are not supported.)
        - `reduction_order`: must be None (the default), as for
          [`fp8ax.Fp8DotGeneral`][]. (Keyword only argument.)

        **Returns:**

        An (M, N) array of the dtype `jax.lax.ragged_dot` gives.
        """
        if group_offset is not None:
            raise NotImplementedError("`group_offset` is not supported by `Fp8RaggedDot`; pass None.")
        check_reduction_order(reduction_order, "fp8ax.Fp8RaggedDot")
        st = self.settings
        lhs = check_operand(lhs, "lhs")
        rhs = check_operand(rhs, "rhs")
        check_explicit_sharding("fp8ax.Fp8RaggedDot", None, lhs, rhs)
        if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
            raise ValueError(
                "`Fp8RaggedDot` takes `lhs` of shape (M, K) and `rhs` of shape (G, K, N), got "
                f"{tuple(lhs.shape)} and {tuple(rhs.shape)}."
            )
        group_sizes = jnp.asarray(group_sizes)
        if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
            raise ValueError(
                f"`group_sizes` must be an integer array of shape ({rhs.shape[0]},) (one size per expert), got "
                f"{group_sizes.dtype} of shape {tuple(group_sizes.shape)}."
            )
        for flag, state, what in (
            (self.per_expert_weights, self.rhs, "per-expert weight"),
            (self.per_group_tokens, self.lhs, "per-group token"),
        ):
            if flag and state is not None:
                experts = state.batch_shape[-1] if state.batch_shape else None
                if experts != rhs.shape[0]:
                    raise ValueError(
                        f"This layer's {what} state is for {experts} experts, but `rhs` has {rhs.shape[0]}."
                    )
        lhs, rhs, raw, state_is_max = Fp8DotGeneral._begin_call(self, lhs, rhs)
        if preferred_element_type is not None:
            preferred_element_type = np.dtype(preferred_element_type)
            if not jnp.issubdtype(preferred_element_type, jnp.floating):
                raise TypeError(
                    "`preferred_element_type` must be None or a floating dtype for an FP8 ragged dot, got "
                    f"{preferred_element_type}."
                )
        call = Call(
            settings=st,
            dims=((((1,), (1,)), ((), ()))),
            lhs_dtype=np.dtype(lhs.dtype),
            rhs_dtype=np.dtype(rhs.dtype),
            out_dtype=ragged_out_dtype(np.dtype(lhs.dtype), np.dtype(rhs.dtype), preferred_element_type),
            fwd_precision=st.fwd_precision if st.fwd_precision is not None else precision,
            state_is_max=state_is_max,
            lhs_vma=vma(lhs),
            rhs_vma=vma(rhs),
        )
        rc = RaggedCall(call, self.per_expert_weights, self.per_group_tokens)
        return with_out_sharding(ragged_quantized_dot(rc, lhs, rhs, group_sizes, *raw), out_sharding)
