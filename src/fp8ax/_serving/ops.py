# The serving GEMMs: `ServingDotGeneral` and `ServingRaggedDot`, the training forward's
# GEMM on a weight quantized once (`_gemm.run_gemm`, and the grouped `ragged_gemm`), so
# a served output equals the training forward's, bit for bit.

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array

if TYPE_CHECKING:
    pass

from .. import _formats
from .._boundaries import vma
from .._gemm import (
    Call,
    GemmSettings,
    RaggedCall,
    group_ids,
    quantize,
    quantize_tokens,
    quantizing_recipe,
    ragged_gemm,
    ragged_out_dtype,
    run_gemm,
)
from .._model import (
    check_explicit_sharding,
    check_operand,
    check_reduction_order,
    make_call,
    with_out_sharding,
)
from .._quantized import QuantizedArray
from .codec import decode

_FP4 = np.dtype(jnp.float4_e2m1fn)
_E8M0 = np.dtype(jnp.float8_e8m0fnu)


class _Serve(NamedTuple):
    """The static part of one serving GEMM (hashable: a custom-JVP static argument)."""

    call: Call
    role: Literal["lhs", "rhs"]  # which operand of the dot general is the stored weight
    layer: str
    tile: tuple[int, ...] | None  # the quantized weight's layout (QuantizedArray's static fields)
    int_exponent: int
    scale_format: np.dtype  # the weight scale's dtype before storage (stored as uint8 bits if 8-bit)


def _serve(s: _Serve, x, w_values, w_scale, x_scale, w_outer):
    call = s.call
    st = call.settings
    (lc, rc), _ = call.dims
    x_role = "rhs" if s.role == "lhs" else "lhs"
    x_axes = rc if s.role == "lhs" else lc
    if x_scale is not None:  # delayed scaling: the frozen activation scale
        dtype = quantizing_recipe(st, x_role).fwd_dtype
        qx = QuantizedArray(_formats.quantize(x, x_scale, dtype), x_scale)
    else:
        qx, _ = quantize(call, x_role, x, x_axes)
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
        "quantized weights would be silently wrong or zero. Differentiate (train, fine-tune) the training model "
        "that `fp8ax.to_serving` was called on instead, and convert again."
    )


_serving_gemm.defjvp(_serving_gemm_jvp, symbolic_zeros=True)


def _is_low_precision(dtype) -> bool:
    dtype = np.dtype(dtype)
    return dtype.itemsize == 1 or dtype == _FP4


class ServingDotGeneral(eqx.Module):
    """The dot general of a serving layer: one operand is the layer's stored
    low-precision weight, the other (the activation) is quantized at every call.

    Built by [`fp8ax.to_serving`][]; it computes exactly what the training layer's
    [`fp8ax.Fp8DotGeneral`][] computed in its forward pass, from the weight's quantized
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
    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        *,
        out_sharding=None,
        reduction_order=None,
    ) -> Array:
        """`jax.lax.dot_general(lhs, rhs, dimension_numbers, precision,
        preferred_element_type, out_sharding=out_sharding)` where one of `lhs`, `rhs` is
        the stored weight (its low-precision values, or the array `fp8ax.to_serving` stored,
        FP8 and FP4 as uint8 bits) and the other the activation. (Operands sharded over
        explicit mesh axes are not supported.) `reduction_order` must be None, as for
        [`fp8ax.Fp8DotGeneral`][].

        **Returns:**

        What the training layer's [`fp8ax.Fp8DotGeneral`][] returned for the same
        activation, bit for bit.
        """
        check_reduction_order(reduction_order, "fp8ax.ServingDotGeneral")
        lhs, rhs = self._decoded(lhs), self._decoded(rhs)
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
        check_explicit_sharding("fp8ax.ServingDotGeneral", None, x, w)
        w_dtype = self.weight_dtype
        if st.compute_dtype is not None:
            x = x.astype(st.compute_dtype)
            w_dtype = st.compute_dtype
        if role == "lhs":
            if self.input_scale is not None or st.operand_recipe("lhs") != st.operand_recipe("rhs"):
                raise ValueError(
                    f"Layer `{self.layer}`: `hax.dot` passed the weight as the first operand of the dot general "
                    "(it does when the input shares a non-contracted axis with the weight), so in training the "
                    "weight was quantized as the activation (`lhs`) and the activation as the weight, with the "
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
        out = _serving_gemm(s, x, w, self.weight_scale, self.input_scale, self.weight_outer_scale)
        return with_out_sharding(out, out_sharding)

    def _decoded(self, x):
        # The stored weight as `fp8ax.to_serving` stored it (uint8 bits: what a layer of a
        # kind defined outside fp8ax holds and passes), read as its values.
        if np.dtype(getattr(x, "dtype", np.float32)) == np.uint8 and self.value_dtype != np.uint8:
            return decode(x, self.value_dtype, self.packed_length)
        return x

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
        qx = QuantizedArray(_formats.quantize(x, x_scale, quantizing_recipe(call.settings, "lhs").fwd_dtype), x_scale)
    else:
        qx, _ = quantize_tokens(rc, "lhs", x, (1,), None, None, group_sizes)
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
    as the recipe quantized them in training) and, for delayed scaling, the activation
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
