# Serving: the weights of FP8 layers quantised once and stored in low precision.
#
# `to_serving` quantises every FP8 layer's weight with the layer's recipe and state, as
# the training forward would quantise it, and keeps only the low-precision values and
# their scale. At a call, the activation is quantised as in training (delayed scaling:
# with the scale the frozen state gives; other recipes: from the activation itself) and
# the GEMM is the training pipeline's own (`_gemm.run_gemm`), so the output is the
# training forward's, bit for bit.
#
# Storage. `eqx.tree_serialise_leaves` cannot save 8-bit float dtypes (numpy writes them
# as raw bytes that do not load back), so values are stored as their bit patterns:
# uint8 for FP8 (and E8M0 scales), one 4-bit code per uint8 for FP4, int8 as int8.
# Decoding is a bitcast (exact) inside the forward.

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, PRNGKeyArray

if TYPE_CHECKING:
    import haliax as hax
    import haliax.nn as hnn

from . import _formats, _haliax
from ._boundaries import vma
from ._gemm import (
    Call,
    GemmSettings,
    RaggedCall,
    group_ids,
    quantise,
    quantise_tokens,
    quantise_weights,
    ragged_gemm,
    ragged_out_dtype,
    run_gemm,
)
from ._model import (
    Fp8DotGeneral,
    Fp8Linear,
    Fp8MoELinear,
    check_operand,
    is_linear,
    linear_call,
    make_call,
    moe_call,
    path_str,
)
from ._quantized import QuantizedArray
from ._recipes import AbstractScalingRecipe, Operand
from ._state import CORRUPT_STATE

T = TypeVar("T")

_FP4 = np.dtype(jnp.float4_e2m1fn)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)


# --------------------------------------------------------------------------- storage


def _storable(dtype: np.dtype, layer: str) -> None:
    if dtype == np.dtype(np.int8) or dtype in _formats.FP8_DTYPES or dtype in (_FP4, _E8M0):
        return
    raise ValueError(
        f"Layer `{layer}`: its weight is quantised to {dtype}, which `fp8ax.to_serving` cannot store (it stores "
        "FP8, E8M0, FP4 (e2m1) and int8). Exclude the layer from the FP8 conversion, or train it with another "
        "element type."
    )


def encode(values: Array) -> Array:
    """Low-precision values as an array `eqx.tree_serialise_leaves` can save: int8 as it
    is, 8-bit floats as their bits (uint8), FP4 packed two codes per byte along the last
    axis (element `2i` in the low nibble of byte `i`, the last byte half empty for an odd
    length)."""
    dtype = np.dtype(values.dtype)
    if dtype == np.dtype(np.int8):
        return values
    if dtype == _FP4:
        n = values.shape[-1]
        padded = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, n % 2)])
        # XLA bitcasts a pair of FP4 values into one byte, element 0 in the low nibble.
        return lax.bitcast_convert_type(padded.reshape(*values.shape[:-1], -1, 2), jnp.uint8)
    return lax.bitcast_convert_type(values, jnp.uint8)


def decode(stored: Array, dtype: np.dtype, length: int | None = None) -> Array:
    """Inverse of `encode` (bit-exact); `length` is the last axis's length before FP4
    values were packed."""
    dtype = np.dtype(dtype)
    if dtype == np.dtype(np.int8):
        return stored
    if dtype == _FP4:
        values = lax.bitcast_convert_type(stored, dtype)  # (..., m) bytes -> (..., m, 2) values
        values = values.reshape(*stored.shape[:-1], -1)
        return values if length is None else values[..., :length]
    return lax.bitcast_convert_type(stored, dtype)


def packed_length(values: Array) -> int | None:
    """The last axis's length of FP4 values (which `encode` packs), else None."""
    return int(values.shape[-1]) if np.dtype(values.dtype) == _FP4 else None


# --------------------------------------------------------------------------- the GEMM


class _Serve(NamedTuple):
    """The static part of one serving GEMM (hashable: a custom-JVP static argument)."""

    call: Call
    role: Literal["lhs", "rhs"]  # which operand of the dot general is the stored weight
    layer: str
    tile: tuple[int, ...] | None  # the quantised weight's layout (QuantizedArray's static fields)
    int_exponent: int
    scale_format: np.dtype  # the weight scale's dtype before storage (stored as uint8 bits if 8-bit)


def _serve(s: _Serve, x, w_values, w_scale, x_scale, w_outer):
    call = s.call
    st = call.settings
    (lc, rc), _ = call.dims
    x_role = "rhs" if s.role == "lhs" else "lhs"
    x_axes = rc if s.role == "lhs" else lc
    if x_scale is not None:  # delayed scaling: the frozen activation scale
        dtype = st.operand_recipe(x_role).fwd_dtype
        qx = QuantizedArray(_formats.quantize(x, x_scale, dtype), x_scale)
    else:
        qx, _ = quantise(call, x_role, x, x_axes)
    if np.dtype(w_scale.dtype) == np.dtype(np.uint8):
        w_scale = lax.bitcast_convert_type(w_scale, s.scale_format)
    qw = QuantizedArray(w_values, w_scale, s.tile, s.int_exponent, outer_scale=w_outer)
    if s.role == "rhs":
        return run_gemm(call, qx, x, qw, None, call.dims, call.fwd_precision, call.out_dtype)
    return run_gemm(call, qw, None, qx, x, call.dims, call.fwd_precision, call.out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _serving_gemm(s: _Serve, x, w_values, w_scale, x_scale, w_outer):
    return _serve(s, x, w_values, w_scale, x_scale, w_outer)


def _serving_gemm_jvp(s, primals, tangents):
    del primals
    names = ("its input", "its weight", "its weight scale", "its activation scale", "its weight's tensor scale")
    what = [n for n, t in zip(names, tangents) if t is not None and not isinstance(t, SymbolicZero)]
    raise TypeError(
        f"Layer `{s.layer}` is a serving layer (`fp8ax.to_serving`): its weight is stored in low precision and "
        f"it cannot be differentiated (a derivative reached {' and '.join(what) or 'it'}). A gradient through "
        "quantised weights would be silently wrong or zero. Differentiate (train, fine-tune) the training model "
        "that `fp8ax.to_serving` was called on instead, and convert again."
    )


_serving_gemm.defjvp(_serving_gemm_jvp, symbolic_zeros=True)


def _is_low_precision(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 or dtype == _FP4


class ServingDotGeneral(eqx.Module):
    """The dot general of a serving layer: one operand is the layer's stored
    low-precision weight, the other (the activation) is quantised at every call.

    Built by [`fp8ax.to_serving`][]; it computes exactly what the training layer's
    [`fp8ax.Fp8DotGeneral`][] computed in its forward pass, from the weight's quantised
    values instead of the weight. It holds the weight's scale (`weight_scale`), and for
    delayed scaling the activation scale frozen at conversion (`input_scale`; `None` for
    recipes that scale the activation from itself). It updates no state and cannot be
    differentiated: a derivative through it raises a `TypeError` that names the layer.
    """

    weight_scale: Array
    input_scale: Array | None
    weight_outer_scale: Array | None  # two-level scales (NVFP4): the weight's per-tensor float32 scale
    settings: GemmSettings = eqx.field(static=True)
    weight_dtype: np.dtype = eqx.field(static=True)  # the training weight's dtype (before `compute_dtype`)
    value_dtype: np.dtype = eqx.field(static=True)  # the low-precision format of the stored values
    tile: tuple[int, ...] | None = eqx.field(static=True)  # the layout of the weight's scales
    int_exponent: int = eqx.field(static=True)
    weight_scale_dtype: np.dtype = eqx.field(static=True)  # as stored: float32, or uint8 bits of E8M0 / E4M3
    layer: str = eqx.field(static=True)  # the layer's path in the model, for messages
    packed_length: int | None = eqx.field(static=True, default=None)  # FP4: the last axis before packing
    weight_scale_format: np.dtype = eqx.field(static=True, default=_E8M0)  # an 8-bit scale's format

    @jax.named_scope("fp8ax.ServingDotGeneral")
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> Array:
        """`jax.lax.dot_general(lhs, rhs, dimension_numbers, precision,
        preferred_element_type)` where one of `lhs`, `rhs` is the stored weight's
        low-precision values (as the layer passes them) and the other the activation.

        **Returns:**

        What the training layer's [`fp8ax.Fp8DotGeneral`][] returned for the same
        activation, bit for bit.
        """
        lhs_lp = _is_low_precision(getattr(lhs, "dtype", np.float32))
        rhs_lp = _is_low_precision(getattr(rhs, "dtype", np.float32))
        if lhs_lp == rhs_lp:
            raise TypeError(
                f"Layer `{self.layer}`: a serving dot general takes the stored weight ({self.value_dtype}) and one "
                f"floating-point activation, got operands of dtype {getattr(lhs, 'dtype', None)} and "
                f"{getattr(rhs, 'dtype', None)}."
            )
        role = "lhs" if lhs_lp else "rhs"
        w, x = (lhs, rhs) if lhs_lp else (rhs, lhs)
        if np.dtype(w.dtype) != self.value_dtype:
            raise TypeError(f"Layer `{self.layer}`: the weight must be {self.value_dtype}, got {w.dtype}.")
        self._check_scales()
        st = self.settings
        x = check_operand(x, "lhs" if role == "rhs" else "rhs")
        w_dtype = self.weight_dtype
        if st.compute_dtype is not None:
            x = x.astype(st.compute_dtype)
            w_dtype = st.compute_dtype
        if role == "lhs":
            if self.input_scale is not None or st.operand_recipe("lhs") != st.operand_recipe("rhs"):
                raise ValueError(
                    f"Layer `{self.layer}`: `hax.dot` passed the weight as the first operand of the dot general "
                    "(it does when the input shares a non-contracted axis with the weight), so in training the "
                    "weight was quantised as the activation (`lhs`) and the activation as the weight, with the "
                    "other operand's state or recipe. A serving layer cannot reproduce that: serve this layer "
                    "with a stateless recipe and one recipe for both operands, or exclude it from the FP8 "
                    "conversion."
                )
            lhs_shape, lhs_dtype, rhs_shape, rhs_dtype = w.shape, w_dtype, x.shape, np.dtype(x.dtype)
        else:
            lhs_shape, lhs_dtype, rhs_shape, rhs_dtype = x.shape, np.dtype(x.dtype), w.shape, w_dtype
        call = make_call(
            st,
            lhs_shape,
            lhs_dtype,
            rhs_shape,
            rhs_dtype,
            dimension_numbers,
            precision,
            preferred_element_type,
            state_is_max=(),
            lhs_vma=vma(lhs),
            rhs_vma=vma(rhs),
        )
        s = _Serve(call, role, self.layer, self.tile, self.int_exponent, self.weight_scale_format)
        return _serving_gemm(s, x, w, self.weight_scale, self.input_scale, self.weight_outer_scale)

    def _check_scales(self):
        want = self.weight_scale_dtype
        scales = (
            ("weight_scale", self.weight_scale),
            ("input_scale", self.input_scale),
            ("weight_outer_scale", self.weight_outer_scale),
        )
        for name, value in scales:
            if value is not None and np.dtype(value.dtype) != (want if name == "weight_scale" else np.float32):
                raise TypeError(
                    f"Layer `{self.layer}`: `{name}` has dtype {value.dtype}, but a serving scale must stay as "
                    "converted (float32, or uint8 bits of E8M0 or E4M3). It was probably cast along with the model: cast "
                    "with `fp8ax.cast_floating(model, dtype)`, which leaves serving scales alone."
                )

    # Haliax state dicts: the serving scales are not plain weights; exports hold none.
    def to_state_dict(self, prefix: str | None = None) -> dict:
        """Haliax state-dict hook: no entries."""
        del prefix
        return {}

    def from_state_dict(self, state_dict: dict, prefix: str | None = None) -> ServingDotGeneral:
        """Haliax state-dict hook: keeps this module as it is."""
        del state_dict, prefix
        return self


# --------------------------------------------------------------------------- layers


class ServingLinear(eqx.Module):
    """The serving form of an [`fp8ax.Fp8Linear`][] (an `equinox.nn.Linear` trained in
    FP8): the weight is stored quantised, as `weight` (encoded: uint8 bits for FP8, int8
    for int8) and the scale in `dot_general`.

    Built by [`fp8ax.to_serving`][]. Called like `equinox.nn.Linear` (leading batch
    dimensions allowed, as for [`fp8ax.Fp8Linear`][]); returns what the training layer
    returned, bit for bit.
    """

    weight: Array
    bias: Array | None
    dot_general: ServingDotGeneral
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingLinear")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """**Arguments:**

        - `x`: the input, shape `(..., in_features)` (or `()` if `in_features="scalar"`).
        - `key`: ignored. (Keyword only argument.)

        **Returns:**

        The output, shape `(..., out_features)` (or `(...)` if `out_features="scalar"`).
        """
        del key
        dg = self.dot_general
        return linear_call(self, x, decode(self.weight, dg.value_dtype, dg.packed_length))


class ServingHaliaxLinear(eqx.Module):
    """The serving form of a `haliax.nn.Linear` trained in FP8: `weight` is a
    `NamedArray` with the original weight's axes holding the quantised values (encoded:
    uint8 bits for FP8, int8 for int8), the scale is in `dot_general`.

    Built by [`fp8ax.to_serving`][]. Called like `haliax.nn.Linear`; returns what the
    training layer returned, bit for bit. Inside `haliax.nn.Stacked` the stacked axis
    stays the leading axis of every array, as for the training layer's state.
    """

    weight: hax.NamedArray
    bias: hax.NamedArray | None
    dot_general: ServingDotGeneral
    In: Any = eqx.field(static=True)
    Out: Any = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingHaliaxLinear")
    def __call__(self, inputs: hax.NamedArray, *, key: PRNGKeyArray | None = None) -> hax.NamedArray:
        """**Arguments:**

        - `inputs`: a `NamedArray` with the layer's `In` axes.
        - `key`: ignored. (Keyword only argument.)

        **Returns:**

        A `NamedArray` with the `In` axes replaced by `Out`.
        """
        del key
        _haliax.require_haliax_matmul("fp8ax.ServingHaliaxLinear")
        hax = _haliax.hax()
        dg = self.dot_general
        axes = self.weight.axes
        if dg.packed_length is not None:  # FP4 values, packed along the last axis
            axes = axes[:-1] + (axes[-1].resize(dg.packed_length),)
        w = hax.NamedArray(decode(self.weight.array, dg.value_dtype, dg.packed_length), axes)
        # `haliax.nn.Linear` lets `hax.dot` pick the result dtype from the two operands;
        # the training weight's dtype stands in for the stored values'.
        preferred = jnp.result_type(inputs.array, self.dot_general.weight_dtype)
        q = hax.dot(inputs, w, axis=self.In, preferred_element_type=preferred, dot_general=self.dot_general)
        q = hax.auto_sharded(q)
        if self.bias is not None:
            q = q + self.bias
            q = hax.auto_sharded(q)
        return q


class _ServeRagged(NamedTuple):
    """The static part of one serving grouped-GEMM call."""

    call: Call
    per_expert: bool
    per_group: bool
    layer: str
    tile: tuple[int, ...] | None
    int_exponent: int
    scale_format: np.dtype


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _serving_ragged(s: _ServeRagged, x, w_values, w_scale, x_scale, group_sizes):
    call = s.call
    rc = RaggedCall(call, s.per_expert, s.per_group)
    if x_scale is not None:  # delayed scaling: the frozen activation scale (per tensor, or per group)
        if s.per_group:
            x_scale = x_scale[group_ids(group_sizes, x.shape[0])][:, None]
        qx = QuantizedArray(_formats.quantize(x, x_scale, call.settings.operand_recipe("lhs").fwd_dtype), x_scale)
    else:
        qx, _ = quantise_tokens(rc, "lhs", x, (1,), None, None, group_sizes)
    if np.dtype(w_scale.dtype) == np.dtype(np.uint8):
        w_scale = lax.bitcast_convert_type(w_scale, s.scale_format)
    qw = QuantizedArray(w_values, w_scale, s.tile, s.int_exponent)
    return ragged_gemm(rc, "fwd", qx, x, qw, None, group_sizes, call.fwd_precision, call.out_dtype)


def _serving_ragged_jvp(s, primals, tangents):
    del primals, tangents
    raise TypeError(
        f"Layer `{s.layer}` is a serving layer (`fp8ax.to_serving`): its expert weights are stored in low "
        "precision and it cannot be differentiated. Differentiate (train, fine-tune) the training model that "
        "`fp8ax.to_serving` was called on instead, and convert again."
    )


_serving_ragged.defjvp(_serving_ragged_jvp, symbolic_zeros=True)


class ServingRaggedDot(eqx.Module):
    """The grouped GEMM of a serving mixture-of-experts layer ([`fp8ax.ServingMoELinear`][]):
    the expert weights' scales (`weight_scale`: one per tensor, per expert or per block,
    as the recipe quantised them in training) and, for delayed scaling, the activation
    scale frozen at conversion (`input_scale`). Built by [`fp8ax.to_serving`][]."""

    weight_scale: Array
    input_scale: Array | None
    settings: GemmSettings = eqx.field(static=True)
    per_expert_weights: bool = eqx.field(static=True)
    weight_dtype: np.dtype = eqx.field(static=True)
    value_dtype: np.dtype = eqx.field(static=True)
    tile: tuple[int, ...] | None = eqx.field(static=True)
    int_exponent: int = eqx.field(static=True)
    weight_scale_format: np.dtype = eqx.field(static=True)  # the scale's dtype before storage
    layer: str = eqx.field(static=True)
    packed_length: int | None = eqx.field(static=True, default=None)
    per_group_tokens: bool = eqx.field(static=True, default=False)

    def __call__(self, x: Array, values: Array, group_sizes: Array) -> Array:
        """`jax.lax.ragged_dot(x, w, group_sizes)` with the stored expert weights'
        low-precision `values` (G, K, N): what the training layer's
        [`fp8ax.Fp8RaggedDot`][] returned for the same tokens, bit for bit."""
        st = self.settings
        x = check_operand(x, "lhs")
        w_dtype = self.weight_dtype
        if st.compute_dtype is not None:
            x = x.astype(st.compute_dtype)
            w_dtype = st.compute_dtype
        call = Call(
            settings=st,
            dims=(((1,), (1,)), ((), ())),
            lhs_dtype=np.dtype(x.dtype),
            rhs_dtype=np.dtype(w_dtype),
            out_dtype=ragged_out_dtype(np.dtype(x.dtype), np.dtype(w_dtype), None),
            fwd_precision=st.fwd_precision,
            state_is_max=(),
            lhs_vma=vma(x),
            rhs_vma=vma(values),
        )
        s = _ServeRagged(
            call,
            self.per_expert_weights,
            self.per_group_tokens,
            self.layer,
            self.tile,
            self.int_exponent,
            self.weight_scale_format,
        )
        return _serving_ragged(s, x, values, self.weight_scale, self.input_scale, jnp.asarray(group_sizes))


class ServingMoELinear(eqx.Module):
    """The serving form of a `haliax.nn.MoELinear` trained in FP8 ([`fp8ax.Fp8MoELinear`][]):
    `weight` holds the quantised expert weights (encoded as for
    [`fp8ax.ServingHaliaxLinear`][]), laid out `(..., Experts, In, Out)`; the scales are in
    `ragged`. Called like `haliax.nn.MoELinear`; returns what the training layer
    returned, bit for bit. Built by [`fp8ax.to_serving`][]."""

    weight: hax.NamedArray
    bias: hax.NamedArray | None
    ragged: ServingRaggedDot
    Experts: hax.Axis = eqx.field(static=True)
    In: hax.Axis = eqx.field(static=True)
    Out: hax.Axis = eqx.field(static=True)
    use_gmm: bool = eqx.field(static=True)

    @jax.named_scope("fp8ax.ServingMoELinear")
    def __call__(
        self, inputs: hax.NamedArray, group_sizes: hax.NamedArray, *, key: PRNGKeyArray | None = None
    ) -> hax.NamedArray:
        """**Arguments:** as for [`fp8ax.Fp8MoELinear`][]."""
        del key
        rg = self.ragged
        values = decode(self.weight.array, rg.value_dtype, rg.packed_length)
        return moe_call(self, inputs, group_sizes, lambda x, sizes: rg(x, values, sizes))


ServingLayer = ServingLinear | ServingHaliaxLinear | ServingMoELinear


def is_serving_layer(x) -> bool:
    """A serving layer: what `to_serving` makes of an FP8 layer."""
    return isinstance(x, ServingLinear | ServingHaliaxLinear | ServingMoELinear)


# --------------------------------------------------------------------------- conversion


def _axis_names(spec) -> set[str]:
    return {spec.name} if _haliax.is_axis(spec) else {a.name for a in spec}


def _vmapped(f, n: int):
    for _ in range(n):
        f = jax.vmap(f)
    return f


def _check_filled(layer: str, dg: Fp8DotGeneral, stacked: str) -> None:
    recipe = dg.settings.recipe
    for role, what in (("lhs", "activation"), ("rhs", "weight")):
        fields = tuple(jax.tree.leaves(getattr(dg, role)))
        if any(isinstance(v, jax.core.Tracer) for v in fields):
            raise ValueError("`fp8ax.to_serving` reads the FP8 state, so it must be called outside `jax.jit`.")
        fields = tuple(np.asarray(v) for v in fields)
        if not np.all(recipe.state_valid(fields)):
            raise ValueError(f"Layer `{layer}`, {what} state (`{role}`): {CORRUPT_STATE}")
        empty = ~np.asarray(recipe.state_observed(fields))
        if np.any(empty):
            where = ""
            if empty.ndim:
                where = (
                    f" (stacked entries {[tuple(int(i) for i in ix) for ix in np.argwhere(empty)][:8]} of {stacked})"
                )
            raise ValueError(
                f"Layer `{layer}`{where} has an empty {what} amax history (`{role}`), so there is no delayed "
                "scale to freeze for serving. Either of two causes: (1) the training step dropped the new FP8 "
                "state: `eqx.apply_updates(model, updates)` after `fp8ax.partition_for_grad_overwrite` leaves "
                "the state as it was, so write it with `model = fp8ax.apply_updates(model, updates, overwrite)`; "
                f"or (2) the layer never saw a nonzero {what} (it was not trained, or the steps did not reach it): "
                "run it on a few batches with `fp8ax.calibrate(model, loss_fn, batches)` (post-training "
                "quantisation: any scalar function of the output will do as `loss_fn`), or exclude the layer "
                "from the FP8 conversion (`Fp8Config(targets=...)`)."
            )


def _convert_gemm(
    layer: str, dg: Fp8DotGeneral, w: Array, contracting: tuple[int, ...], n_batch: int, check: bool, stacked: str
) -> tuple[Array, ServingDotGeneral]:
    """The stored weight (encoded) and the serving dot general of one FP8 GEMM whose
    weight `w` (`n_batch` leading stacked dims) the training forward passes as `rhs`,
    contracting `contracting` (axes of one stacked entry)."""
    st = dg.settings  # what the training forward ran
    recipe = st.operand_recipe("rhs")
    if recipe is None or "fwd" in st.high_precision_gemms:
        raise ValueError(
            f"Layer `{layer}` keeps its weight in high precision in the forward GEMM (`rhs_recipe='off'` or "
            "`high_precision_gemms` with 'fwd'), so it has no low-precision weight to serve. Exclude it from the "
            "FP8 conversion (`Fp8Config(targets=...)`) to serve it as a plain layer."
        )
    if st.recipe.stateful and type(st.recipe).serving_scale is AbstractScalingRecipe.serving_scale:
        raise ValueError(
            f"Layer `{layer}` uses the stateful recipe {type(st.recipe).__name__}, which does not say how to freeze "
            "its state for serving (it defines no `serving_scale`); `fp8ax.to_serving` serves the stateful recipes "
            "that do (`DelayedScaling`) and the stateless ones."
        )
    weight_dtype = np.dtype(w.dtype)
    if st.compute_dtype is not None:
        w = w.astype(st.compute_dtype)
    delayed = st.recipe.stateful
    if delayed and check:
        _check_filled(layer, dg, stacked)
    dtype = recipe.dtype_for("rhs")

    def quantise(w, state):
        return recipe.quantize_operands([Operand(w, tuple(contracting), dtype, state, role="rhs")])[0][0]

    state = tuple(jax.tree.leaves(dg.rhs)) if delayed else None
    q = eqx.filter_jit(_vmapped(quantise, n_batch))(w, state)
    _storable(np.dtype(q.values.dtype), layer)
    input_scale = None
    if delayed:
        lhs_dtype = st.operand_recipe("lhs").dtype_for("lhs")

        def frozen(state):
            return st.recipe.serving_scale(state, lhs_dtype)

        input_scale = eqx.filter_jit(_vmapped(frozen, n_batch))(tuple(jax.tree.leaves(dg.lhs)))
    scale = q.scale
    scale_format = np.dtype(scale.dtype)
    if scale_format.itemsize == 1:  # E8M0 (MX), E4M3 (NVFP4): kept as bits, which no cast touches
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    serving = ServingDotGeneral(
        weight_scale=scale,
        input_scale=input_scale,
        weight_outer_scale=q.outer_scale,
        settings=st,
        weight_dtype=weight_dtype,
        value_dtype=np.dtype(q.values.dtype),
        tile=q.tile,
        int_exponent=q.int_exponent,
        weight_scale_dtype=np.dtype(scale.dtype),
        layer=layer,
        packed_length=packed_length(q.values),
        weight_scale_format=scale_format if scale_format.itemsize == 1 else _E8M0,
    )
    return eqx.filter_jit(encode)(q.values), serving


def _convert_eqx(layer: str, lin: Fp8Linear, check: bool) -> ServingLinear:
    n_batch = lin.weight.ndim - 2
    weight, dg = _convert_gemm(
        layer,
        lin.dot_general,
        lin.weight,
        (1,),
        n_batch,
        check,
        f"the leading weight dims {lin.weight.shape[:n_batch]}",
    )
    return ServingLinear(weight, lin.bias, dg, lin.in_features, lin.out_features, lin.use_bias)


def _convert_haliax(layer: str, lin: hnn.Linear, check: bool) -> ServingHaliaxLinear:
    _haliax.require_haliax_matmul("fp8ax.to_serving")
    own = _axis_names(lin.In) | _axis_names(lin.Out)
    names = [ax.name for ax in lin.weight.axes]
    n_batch = sum(n not in own for n in names)
    if any(n not in own for n in names[n_batch:]):
        raise ValueError(
            f"Layer `{layer}`: the stacked axes of its weight {lin.weight.axes} must come first (as "
            "`haliax.nn.Stacked` puts them) for `fp8ax.to_serving`."
        )
    # The training call multiplies the weight by the reparametrisation's scale first.
    w = (lin.weight * lin.reparam.active_scale).array
    in_names = _axis_names(lin.In)
    contracting = tuple(i for i, n in enumerate(names[n_batch:]) if n in in_names)
    stacked = f"the stacked axes {lin.weight.axes[:n_batch]}"
    weight, dg = _convert_gemm(layer, lin.dot_general, w, contracting, n_batch, check, stacked)
    axes = lin.weight.axes
    if dg.packed_length is not None:  # FP4: two values per byte along the last axis
        axes = axes[:-1] + (axes[-1].resize(weight.shape[-1]),)
    return ServingHaliaxLinear(_haliax.hax().NamedArray(weight, axes), lin.bias, dg, lin.In, lin.Out)


def _convert_moe(layer: str, lin: Fp8MoELinear, check: bool) -> ServingMoELinear:
    rg = lin.ragged
    st = rg.settings
    if st.operand_recipe("rhs") is None or "fwd" in st.high_precision_gemms:
        raise ValueError(
            f"Layer `{layer}` keeps its expert weights in high precision in the forward GEMM, so it has no "
            "low-precision weight to serve. Exclude it from the FP8 conversion (`Fp8Config(targets=...)`)."
        )
    if st.recipe.stateful and type(st.recipe).serving_scale is AbstractScalingRecipe.serving_scale:
        raise ValueError(
            f"Layer `{layer}` uses the stateful recipe {type(st.recipe).__name__}, which does not say how to freeze "
            "its state for serving (it defines no `serving_scale`)."
        )
    own = [lin.Experts, lin.In, lin.Out]
    batch = [ax for ax in lin.weight.axes if ax.name not in {a.name for a in own}]
    if list(lin.weight.axes[: len(batch)]) != batch:
        raise ValueError(
            f"Layer `{layer}`: the stacked axes of its weight {lin.weight.axes} must come first (as "
            "`haliax.nn.Stacked` puts them) for `fp8ax.to_serving`."
        )
    n_batch = len(batch)
    w = lin.weight.rearrange((*batch, *own)).array
    weight_dtype = np.dtype(w.dtype)
    if st.compute_dtype is not None:
        w = w.astype(st.compute_dtype)
    delayed = st.recipe.stateful
    if delayed and check:
        _check_filled(layer, rg, f"the stacked axes {tuple(batch)} and experts {lin.Experts}")
    call = Call(
        st, (((1,), (1,)), ((), ())), weight_dtype, np.dtype(w.dtype), weight_dtype, None, (), frozenset(), frozenset()
    )
    rc = RaggedCall(call, rg.per_expert_weights, rg.per_group_tokens)

    def quantise(w, state):
        return quantise_weights(rc, w, (1,), state, None)[0]

    state = tuple(jax.tree.leaves(rg.rhs)) if delayed else None
    q = eqx.filter_jit(_vmapped(quantise, n_batch))(w, state)
    _storable(np.dtype(q.values.dtype), layer)
    input_scale = None
    if delayed:
        lhs_dtype = st.operand_recipe("lhs").dtype_for("lhs")
        frozen = lambda state: st.recipe.serving_scale(state, lhs_dtype)  # noqa: E731
        input_scale = eqx.filter_jit(_vmapped(frozen, n_batch))(tuple(jax.tree.leaves(rg.lhs)))
    if q.outer_scale is not None:
        raise ValueError(
            f"Layer `{layer}`: `fp8ax.to_serving` does not serve grouped GEMMs with two-level scales (NVFP4) yet; "
            "exclude the layer from the FP8 conversion or train it with another recipe."
        )
    scale = q.scale
    scale_format = np.dtype(scale.dtype)
    if scale_format.itemsize == 1:
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    ragged = ServingRaggedDot(
        weight_scale=scale,
        input_scale=input_scale,
        settings=st,
        per_expert_weights=rg.per_expert_weights,
        weight_dtype=weight_dtype,
        value_dtype=np.dtype(q.values.dtype),
        tile=q.tile,
        int_exponent=q.int_exponent,
        weight_scale_format=scale_format,
        layer=layer,
        packed_length=packed_length(q.values),
        per_group_tokens=rg.per_group_tokens,
    )
    values = eqx.filter_jit(encode)(q.values)
    axes = tuple(batch) + tuple(own)
    if ragged.packed_length is not None:
        axes = axes[:-1] + (axes[-1].resize(values.shape[-1]),)
    return ServingMoELinear(
        _haliax.hax().NamedArray(values, axes), lin.bias, ragged, lin.Experts, lin.In, lin.Out, lin.use_gmm
    )


def _is_node(x) -> bool:
    return is_linear(x) or is_serving_layer(x)


def _convert(model, check: bool):
    converted = []

    def convert(path, node):
        if not _is_node(node):
            return node
        layer = path_str(path) or "(the model itself)"
        if is_serving_layer(node):
            raise ValueError(
                f"Layer `{layer}` is already a serving layer: `fp8ax.to_serving` was called on this model "
                "before. Convert the training model once; a serving model cannot be converted again."
            )
        if isinstance(node, Fp8Linear):
            converted.append(layer)
            return _convert_eqx(layer, node, check)
        if isinstance(node, Fp8MoELinear):
            converted.append(layer)
            return _convert_moe(layer, node, check)
        if _haliax.is_linear(node) and isinstance(node.dot_general, Fp8DotGeneral):
            converted.append(layer)
            return _convert_haliax(layer, node, check)
        if _haliax.is_linear(node) and isinstance(
            node.dot_general, _haliax.haxq().Fp8DotGeneralOp | _haliax.haxq().Int8DotGeneralOp
        ):
            raise ValueError(
                f"Layer `{layer}` uses Haliax's own {type(node.dot_general).__name__}, which `fp8ax.to_serving` "
                "cannot convert. Convert the model with `fp8ax.fp8_linear_layers` instead of "
                "`haliax.quantization.quantize_linear_layers`."
            )
        return node  # a plain layer (exempt from FP8): served as it is

    out = jtu.tree_map_with_path(convert, model, is_leaf=_is_node)
    if not converted:
        raise ValueError(
            f"`fp8ax.to_serving` found no FP8 layer in `model` (a {type(model).__name__}). Convert the model with "
            "`fp8ax.fp8_linear_layers(model, config)` first (and, for delayed scaling, train or "
            "`fp8ax.calibrate` it)."
        )
    return out


def to_serving(model: T) -> T:
    """Converts a model trained (or calibrated) in FP8 for serving: each FP8 layer's
    weight is quantised once, with the layer's recipe and state, and stored in low
    precision. The float weight is not kept.

    - An [`fp8ax.Fp8Linear`][] becomes an [`fp8ax.ServingLinear`][]; a
      `haliax.nn.Linear` with an [`fp8ax.Fp8DotGeneral`][] (also inside
      `haliax.nn.Stacked`) becomes an [`fp8ax.ServingHaliaxLinear`][]. Plain layers (not
      converted to FP8, e.g. by `Fp8Config(targets=...)`) are left as they are.
    - Stored: FP8 values (as uint8 bits) for FP8 recipes, int8 values for
      [`fp8ax.Int8Scaling`][], elements and E8M0 scales for [`fp8ax.MXScaling`][], with
      the weight's scale in float32 (tensor and row scales).
    - Activations are quantised at every call as in training. Delayed scaling: with the
      scale the layer's state gives now (the state is frozen; serving updates nothing).
      Other recipes: from the activation itself.

    The serving model's forward output equals the training model's on the same input,
    bit for bit. It is an ordinary PyTree: `eqx.tree_serialise_leaves` saves it (the
    weights at 1 byte per value), and [`fp8ax.serving_template`][] gives the structure
    to load it into. It cannot be differentiated (a derivative through a serving layer
    raises an error that names the layer).

    **Arguments:**

    - `model`: a model converted by [`fp8ax.fp8_linear_layers`][]. Call this outside
      `jax.jit`: it reads the state.

    **Returns:**

    The serving model; `model` itself is not modified.

    **Raises:**

    `ValueError` naming the layer if a delayed-scaling layer's activation or weight
    history is empty (never observed: run [`fp8ax.calibrate`][] first), if `model` is
    already a serving model, or if it holds no FP8 layer.

    !!! Example

        ```python
        serving = fp8ax.to_serving(model)
        eqx.tree_serialise_leaves("served.eqx", serving)
        ```
    """
    return _convert(model, check=True)


def serving_template(model: T) -> T:
    """The structure of [`fp8ax.to_serving`][]`(model)`, with zero-filled arrays: the
    template to load a serving checkpoint into.

    The FP8 state of `model` is not read, so a freshly converted, never-trained model
    will do: `fp8ax.serving_template(fp8ax.fp8_linear_layers(init_model, config))` with
    the config the served model was trained with.

    **Arguments:**

    - `model`: a model converted by [`fp8ax.fp8_linear_layers`][].

    **Returns:**

    A serving model whose arrays are all zero.

    !!! Example

        ```python
        like = fp8ax.serving_template(fp8ax.fp8_linear_layers(init_model, config))
        serving = fp8ax.tree_deserialise_leaves("served.eqx", like)
        ```
    """
    shapes = eqx.filter_eval_shape(functools.partial(_convert, check=False), model)
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, shapes)
