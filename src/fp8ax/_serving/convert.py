# Serving: the weights of FP8 layers quantized once and stored in low precision.
#
# `to_serving` quantizes every FP8 layer's weight with the layer's recipe and state, as
# the training forward would quantize it, and keeps only the low-precision values and
# their scale. At a call, the activation is quantized as in training (delayed scaling:
# with the scale the frozen state gives; other recipes: from the activation itself) and
# the GEMM is the training pipeline's own (`_gemm.run_gemm`), so the output is the
# training forward's, bit for bit.
#

from __future__ import annotations

import functools
from typing import NamedTuple, TypeVar

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jaxtyping import Array

from .._gemm import (
    Call,
    RaggedCall,
    quantize_weights,
    quantizing_recipe,
    stateful_recipe,
)
from .._model import (
    Fp8DotGeneral,
    Fp8RaggedDot,
    fp8_op,
    is_linear,
    kind_of,
    path_str,
)
from .._quantized import QuantizedArray
from .._recipes import AbstractStatefulRecipe, Operand
from .._state import CORRUPT_STATE
from .codec import encode, packed_length, storable
from .layers import is_serving_layer
from .ops import ServingDotGeneral, ServingRaggedDot

T = TypeVar("T")
_E8M0 = np.dtype(jnp.float8_e8m0fnu)


def _vmapped(f, n: int):
    for _ in range(n):
        f = jax.vmap(f)
    return f


def _check_filled(layer: str, dg: Fp8DotGeneral, stacked: str) -> None:
    recipe = stateful_recipe(dg.settings)
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
                "quantization: any scalar function of the output will do as `loss_fn`), or exclude the layer "
                "from the FP8 conversion (`Fp8Config(targets=...)`)."
            )


class _Frozen(NamedTuple):
    """What serving keeps of one FP8 op's weight."""

    q: QuantizedArray  # the weight quantized as the training forward quantized it
    input_scale: Array | None  # frozen from the input's state (a stateful recipe), else None
    scale: Array  # the weight's scale; a 1-byte format (E8M0, E4M3) as its bits
    scale_format: np.dtype
    weight_dtype: np.dtype  # the training weight's dtype


def _freeze(layer: str, op: Fp8DotGeneral, w: Array, quantize, n_batch: int, check: bool, stacked: str) -> _Frozen:
    """The serving form of the weight `w` of the FP8 op `op` (dense or grouped: `n_batch`
    leading stacked dims), quantized by `quantize(w, state)` under `vmap` over the
    stacked dims, and the input scale frozen from the op's state."""
    st = op.settings  # what the training forward ran
    what = "expert weights" if isinstance(op, Fp8RaggedDot) else "weight"
    if st.operand_recipe("rhs") is None or "fwd" in st.high_precision_gemms:
        raise ValueError(
            f"Layer `{layer}` keeps its {what} in high precision in the forward GEMM (`rhs_recipe='off'` or "
            f"`high_precision_gemms` with 'fwd'), so it has no low-precision {what} to serve. Exclude it from the "
            "FP8 conversion (`Fp8Config(targets=...)`) to serve it as a plain layer."
        )
    if (
        isinstance(st.recipe, AbstractStatefulRecipe)
        and type(st.recipe).serving_scale is AbstractStatefulRecipe.serving_scale
    ):
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
        _check_filled(layer, op, stacked)
    state = tuple(jax.tree.leaves(op.rhs)) if delayed else None
    q = eqx.filter_jit(_vmapped(quantize, n_batch))(w, state)
    storable(np.dtype(q.values.dtype), layer)
    input_scale = None
    if delayed:
        lhs_dtype = quantizing_recipe(st, "lhs").dtype_for("lhs")

        def frozen(state):
            return stateful_recipe(st).serving_scale(state, lhs_dtype)

        input_scale = eqx.filter_jit(_vmapped(frozen, n_batch))(tuple(jax.tree.leaves(op.lhs)))
    scale = q.scale
    scale_format = np.dtype(scale.dtype)
    if scale_format.itemsize == 1:  # E8M0 (MX), E4M3 (NVFP4): kept as bits, which no cast touches
        scale = lax.bitcast_convert_type(scale, jnp.uint8)
    return _Frozen(q, input_scale, scale, scale_format, weight_dtype)


def _convert_gemm(
    layer: str, dg: Fp8DotGeneral, w: Array, contracting: tuple[int, ...], n_batch: int, check: bool, stacked: str
) -> tuple[Array, ServingDotGeneral]:
    """The stored weight (encoded) and the serving dot general of one FP8 GEMM whose
    weight `w` (`n_batch` leading stacked dims) the training forward passes as `rhs`,
    contracting `contracting` (axes of one stacked entry)."""
    recipe = quantizing_recipe(dg.settings, "rhs")  # `_freeze` refuses a weight kept in high precision

    def quantize(w, state):
        op = Operand(w, tuple(contracting), recipe.dtype_for("rhs"), state, role="rhs")
        return recipe.quantize_operands([op])[0][0]

    f = _freeze(layer, dg, w, quantize, n_batch, check, stacked)
    serving = ServingDotGeneral(
        weight_scale=f.scale,
        input_scale=f.input_scale,
        weight_outer_scale=f.q.outer_scale,
        settings=dg.settings,
        weight_dtype=f.weight_dtype,
        value_dtype=np.dtype(f.q.values.dtype),
        tile=f.q.tile,
        int_exponent=f.q.int_exponent,
        weight_scale_dtype=np.dtype(f.scale.dtype),
        layer=layer,
        packed_length=packed_length(f.q.values),
        weight_scale_format=f.scale_format if f.scale_format.itemsize == 1 else _E8M0,
    )
    return eqx.filter_jit(encode)(f.q.values), serving


def _check_frozen(method: str, op, op_type: type, weight, n_batch) -> None:
    """The arguments every `ServingFreezer` method takes, checked where a mistake would
    otherwise surface deep in the quantization."""
    if not isinstance(op, op_type):
        raise TypeError(
            f"`ServingFreezer.{method}`: `op` must be an `fp8ax.{op_type.__name__}`, got {type(op).__name__}."
        )
    if not hasattr(weight, "ndim") or not hasattr(weight, "dtype"):
        raise TypeError(f"`ServingFreezer.{method}`: `weight` must be an array, got {type(weight).__name__}.")
    if isinstance(n_batch, bool) or not isinstance(n_batch, int) or not 0 <= n_batch <= weight.ndim - 2:
        raise ValueError(
            f"`ServingFreezer.{method}`: `n_batch` must be an int from 0 to {weight.ndim - 2} (the stacked dimensions "
            f"in front of a weight of {weight.ndim} dimensions), got {n_batch!r}."
        )


class ServingFreezer:
    """What [`fp8ax.to_serving`][] hands a layer kind's `LayerKind.to_serving`: it freezes
    the weight of one FP8 op, quantized once with the op's recipe and state as the
    training forward quantized it, and gives the stored values and the op that serves
    them. `path` is the layer's dotted path (for messages)."""

    def __init__(self, path: str, check: bool = True):
        self.path = path
        self._check = check  # read the state (`to_serving`), or only shapes (`serving_template`)

    def dense(
        self, op: Fp8DotGeneral, weight: Array, contracting: tuple[int, ...], n_batch: int = 0, stacked: str = ""
    ) -> tuple[Array, ServingDotGeneral]:
        """`(stored, serving_op)` for the weight of the FP8 `dot_general` `op`.

        **Arguments:**

        - `op`: the layer's [`fp8ax.Fp8DotGeneral`][], with its state.
        - `weight`: the array the layer passes to `op` as its `rhs` (its second operand),
          with `n_batch` leading stacked dimensions (one state each).
        - `contracting`: the axes of one stacked entry of `weight` the layer's call contracts.
        - `n_batch`: the number of leading stacked dimensions of `weight`.
        - `stacked`: those dimensions in words, for messages.

        **Returns:**

        `stored`, the low-precision values as they are saved (FP8 as uint8 bits, FP4 two
        per byte), and `serving_op`, an [`fp8ax.ServingDotGeneral`][] to call in place of
        `op` with `stored` in place of `weight`: the output is the training forward's, bit
        for bit.
        """
        layer, check = self.path, self._check
        _check_frozen("dense", op, Fp8DotGeneral, weight, n_batch)
        if isinstance(op, Fp8RaggedDot):
            raise TypeError("`ServingFreezer.dense`: `op` is a grouped GEMM (`fp8ax.Fp8RaggedDot`); use `grouped`.")
        own = weight.ndim - n_batch
        if not (
            isinstance(contracting, tuple | list)
            and contracting
            and all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a < own for a in contracting)
        ):
            raise ValueError(
                f"`ServingFreezer.dense`: `contracting` must be a non-empty tuple of axes of one stacked entry of "
                f"`weight` (ints in [0, {own})), got {contracting!r}."
            )
        stacked = stacked or f"the leading weight dims {tuple(weight.shape[:n_batch])}"
        return _convert_gemm(layer, op, weight, tuple(contracting), n_batch, check, stacked)

    def grouped(
        self, op: Fp8RaggedDot, weight: Array, n_batch: int = 0, stacked: str = ""
    ) -> tuple[Array, ServingRaggedDot]:
        """`(stored, serving_op)` for the expert weights `weight` (`(*stacked, experts,
        in, out)`) of the grouped GEMM `op`, as `dense` for a dense one."""
        layer, check, rg = self.path, self._check, op
        _check_frozen("grouped", op, Fp8RaggedDot, weight, n_batch)
        if weight.ndim - n_batch != 3:
            raise ValueError(
                "`ServingFreezer.grouped`: `weight` must be (*stacked, experts, in, out) with `n_batch` stacked "
                f"dimensions, got shape {tuple(weight.shape)} and n_batch={n_batch}."
            )
        weight_dtype = np.dtype(weight.dtype)

        def quantize(w, state):
            dims = (((1,), (1,)), ((), ()))
            call = Call(
                rg.settings, dims, weight_dtype, np.dtype(w.dtype), weight_dtype, None, (), frozenset(), frozenset()
            )
            return quantize_weights(RaggedCall(call, rg.per_expert_weights, rg.per_group_tokens), w, (1,), state, None)[
                0
            ]

        f = _freeze(layer, rg, weight, quantize, n_batch, check, stacked or "its stacked axes")
        if f.q.outer_scale is not None:
            raise ValueError(
                f"Layer `{layer}`: `fp8ax.to_serving` does not serve grouped GEMMs with two-level scales (NVFP4) "
                "yet; exclude the layer from the FP8 conversion or train it with another recipe."
            )
        ragged = ServingRaggedDot(
            weight_scale=f.scale,
            input_scale=f.input_scale,
            settings=rg.settings,
            per_expert_weights=rg.per_expert_weights,
            weight_dtype=f.weight_dtype,
            value_dtype=np.dtype(f.q.values.dtype),
            tile=f.q.tile,
            int_exponent=f.q.int_exponent,
            weight_scale_format=f.scale_format,
            layer=layer,
            packed_length=packed_length(f.q.values),
            per_group_tokens=rg.per_group_tokens,
        )
        return eqx.filter_jit(encode)(f.q.values), ragged


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
        kind = kind_of(node)
        if kind is None or not kind.is_converted(node):
            return node  # a plain layer (exempt from FP8): served as it is
        if fp8_op(node) is not None:
            converted.append(layer)
        return kind.to_serving(node, ServingFreezer(layer, check))

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
    weight is quantized once, with the layer's recipe and state, and stored in low
    precision. The float weight is not kept.

    - An [`fp8ax.Fp8Linear`][] becomes an [`fp8ax.ServingLinear`][]; a
      `haliax.nn.Linear` with an [`fp8ax.Fp8DotGeneral`][] (also inside
      `haliax.nn.Stacked`) becomes an [`fp8ax.ServingHaliaxLinear`][]; an
      [`fp8ax.Fp8MoELinear`][] an [`fp8ax.ServingMoELinear`][]; a layer of a kind you
      registered, what its kind's `to_serving` makes of it ([`fp8ax.LayerKind`][]). Plain
      layers (not converted to FP8, e.g. by `Fp8Config(targets=...)`) are left as they are.
    - Stored: FP8 values (as uint8 bits) for FP8 recipes, int8 values for
      [`fp8ax.Int8Scaling`][], elements and E8M0 scales for [`fp8ax.MXScaling`][], with
      the weight's scale in float32 (tensor and row scales).
    - Activations are quantized at every call as in training. Delayed scaling: with the
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
