# Scaling statistics of a model's FP8 layers as a flat {name: float} dict (for W&B,
# TensorBoard, printing); `plot.py` plots their amax histories from the same layers.
#
# The state statistics are what each layer's recipe reads from its state. The batch statistics (saturation,
# underflow) need the tensors each layer quantizes: `scaling_stats` runs the given
# function on a copy of the model in which every `Fp8DotGeneral` is wrapped by
# `_Capture`. The wrapper calls the layer unchanged, quantizes its operands once more
# with the layer's own recipe and state, and sends the counts to the host with
# `jax.debug.callback` (one call per use: per example under `vmap`, per layer under
# `Stacked`'s scan, which slices the wrapper's layer index with the state).

import functools
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array

from .. import _formats
from .._gemm import bwd_layout, stateful_recipe
from .._maxgrad import merged_amax
from .._model import Fp8DotGeneral, Fp8RaggedDot, fp8_op, kind_of, path_str
from .._quantized import QuantizedArray
from .._recipes import Operand
from .._state import CORRUPT_STATE

ROLES = ("lhs", "rhs", "grad")
_COUNTS = ("saturated", "underflow", "nonzero", "total")

_LOCK = threading.Lock()
_active: dict | None = None  # (slot, index) -> {role: counts}, while `scaling_stats` runs `fn`


def fp8_layers(model) -> list[tuple[str, Fp8DotGeneral, tuple[int, ...]]]:
    """`(name, dot general, stacked shape)` of every `Fp8DotGeneral`, in tree order; the
    name is the layer's dotted path (`blocks.stacked.mlp.up_proj`)."""
    out = []
    for path, node in jtu.tree_flatten_with_path(model, is_leaf=_is_holder)[0]:
        if not _is_holder(node):
            continue
        name = path_str(path)
        if isinstance(node, Fp8DotGeneral):
            out.append((name or "dot_general", node, _state_shape(node)))
        else:
            kind, op = kind_of(node), fp8_op(node)
            assert kind is not None and op is not None
            out.append((name or "(root)", op, kind.stacked_shape(node)))
    return out


def _is_holder(x) -> bool:
    """A bare `Fp8DotGeneral`, or a converted layer of a registered kind holding a dense
    one (named by the layer's path). A grouped op (`Fp8RaggedDot`, not observed) is named
    by its own path, `<layer>.ragged` for an `Fp8MoELinear`."""
    if isinstance(x, Fp8DotGeneral):
        return True
    op = fp8_op(x)
    return isinstance(op, Fp8DotGeneral) and not isinstance(op, Fp8RaggedDot)


def _state_shape(dg: Fp8DotGeneral) -> tuple[int, ...]:
    if isinstance(dg, Fp8RaggedDot):
        return dg.layer_batch_shape  # without the per-expert or per-group dimension
    lhs = dg.lhs
    return lhs.batch_shape if lhs is not None else ()


def index_str(index: tuple[int, ...]) -> str:
    return f"[{','.join(map(str, index))}]" if index else ""


def _bound(dtype) -> float:
    """The largest magnitude the quantized values can hold."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return float(jnp.iinfo(dtype).max)
    return float(jnp.finfo(dtype).max)


def operand_counts(x: Array, q: QuantizedArray) -> dict[str, Array]:
    """How many elements of `x` the quantization `q` (of `x`) saturated or flushed to zero.

    - `saturated`: finite elements with `|x| / scale` beyond the largest value of the
      format (they are clipped to it);
    - `underflow`: finite nonzero elements whose quantized value is zero;
    - `nonzero`, `total`: finite nonzero elements, and all elements.
    """
    xf = jnp.asarray(x).astype(jnp.float32)
    finite = jnp.isfinite(xf)
    # The scale of every element (tensor, row or MX block), as the values' dtype reads it.
    one = q.with_values(jnp.ones_like(q.values))
    elem_scale = jnp.broadcast_to(one.dequantize(jnp.float32), xf.shape)
    # The quantizer's own arithmetic: x * (1 / scale), in float32.
    saturated = finite & (jnp.abs(xf * _formats.reciprocal(elem_scale)) > jnp.float32(_bound(q.values.dtype)))
    nonzero = finite & (xf != 0)
    underflow = nonzero & (q.values == jnp.zeros((), q.values.dtype))
    total = jnp.int32(xf.size)
    return {
        "saturated": jnp.sum(saturated, dtype=jnp.int32),
        "underflow": jnp.sum(underflow, dtype=jnp.int32),
        "nonzero": jnp.sum(nonzero, dtype=jnp.int32),
        "total": total,
    }


def _quantized_as_the_layer_does(recipe, role: str, x, axes, state=()) -> QuantizedArray:
    """`x` quantized by `recipe` as the layer's `role` operand, with the arrays of its
    `state` (empty for a stateless recipe)."""
    dtype = recipe.dtype_for(role)
    key = jax.random.key(0) if recipe.stochastic(role) else None
    if not state:
        return recipe.quantize_operands([Operand(x, tuple(axes), dtype, key=key, role=role)])[0][0]
    # As the GEMM pipeline does: a first call (of delayed scaling: an empty history) under
    # `vmap` calibrates on the amax of the whole batch, not of each example.
    op = Operand(x, tuple(axes), dtype, tuple(state), key, lambda v: merged_amax(v, state[0]), role=role)
    return recipe.quantize_operands([op])[0][0]


def _state_of(dg: Fp8DotGeneral, role: str) -> tuple:
    state = getattr(dg, role)
    return () if state is None else tuple(jax.tree.leaves(state))


class _Capture(eqx.Module):
    """An `Fp8DotGeneral` that also reports what its operands lose to quantization."""

    inner: Fp8DotGeneral
    index: Array  # int32 of the stacked shape: which stacked layer (sliced with the state)
    slot: int = eqx.field(static=True)  # the layer's position in `fp8_layers(model)`

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **keywords):
        # (`keywords`: `out_sharding` and `reduction_order`, which `inner` checks.)
        out = self.inner(lhs, rhs, dimension_numbers, precision, preferred_element_type, **keywords)
        st = self.inner.settings
        if "fwd" in st.high_precision_gemms:
            return out
        # The counts need no derivative (and `fn` may differentiate through here).
        lhs, rhs = jax.lax.stop_gradient((jnp.asarray(lhs), jnp.asarray(rhs)))
        inner = jax.lax.stop_gradient(self.inner)
        if st.compute_dtype is not None:
            lhs, rhs = lhs.astype(st.compute_dtype), rhs.astype(st.compute_dtype)
        (lc, rc), _ = dimension_numbers
        counts = {}
        for role, x, axes in (("lhs", lhs, lc), ("rhs", rhs, rc)):
            if st.operand_recipe(role) is None:
                continue
            axes = tuple(int(a) % x.ndim for a in axes)
            q = _quantized_as_the_layer_does(st.operand_recipe(role), role, x, axes, _state_of(inner, role))
            counts[role] = operand_counts(x, q)
        jax.debug.callback(functools.partial(_record, self.slot), self.index, counts)
        if "dlhs" in st.high_precision_gemms and "drhs" in st.high_precision_gemms:
            return out
        grad_recipe = st.operand_recipe("grad")
        if grad_recipe is None:
            return out
        # The output gradient is quantized in the backward pass: an identity whose VJP
        # quantizes the incoming gradient as the layer's does (per tensor along the
        # axes the input-gradient GEMM contracts) and reports what that loses.
        axes = bwd_layout(dimension_numbers, lhs.ndim, rhs.ndim).g_rfree
        consts = jax.lax.stop_gradient((self.index, *_state_of(self.inner, "grad")))
        return _observe_gradient(grad_recipe, axes, self.slot, out, *consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _observe_gradient(recipe, axes, slot, out, index, *state):
    del recipe, axes, slot, index, state
    return out


def _observe_gradient_fwd(recipe, axes, slot, out, index, *state):
    return out, (index, state)


def _observe_gradient_bwd(recipe, axes, slot, residuals, g):
    index, state = residuals
    q = _quantized_as_the_layer_does(recipe, "grad", g, axes, state)
    jax.debug.callback(functools.partial(_record, slot), index, {"grad": operand_counts(g, q)})
    zeros = tuple(jnp.zeros_like(s) for s in state)
    return (g, np.zeros(np.shape(index), jax.dtypes.float0), *zeros)


_observe_gradient.defvjp(_observe_gradient_fwd, _observe_gradient_bwd)


def _record(slot: int, index, counts) -> None:
    index = np.asarray(index)
    shape = _SHAPES.get(slot, ())
    # The stacked layer(s) this call ran: one under `Stacked`'s scan (the index is sliced
    # like the state), all of them if the stacked axis was not sliced.
    flat = [int(i) for i in index.reshape(-1)]
    keys = [tuple(int(i) for i in np.unravel_index(k, shape)) for k in flat] if shape else [()]
    with _LOCK:
        if _active is None:
            return
        for key in keys:
            acc = _active.setdefault((slot, key), {})
            for role, c in counts.items():
                prev = acc.setdefault(role, dict.fromkeys(_COUNTS, 0))
                for name in _COUNTS:
                    prev[name] += int(np.asarray(c[name]))


_SHAPES: dict[int, tuple[int, ...]] = {}  # slot -> stacked shape, for the run in progress


def _wrapped(model, layers):
    slot_of = {id(dg): i for i, (_, dg, _) in enumerate(layers)}

    def wrap(dg):
        i = slot_of[id(dg)]
        shape = layers[i][2]
        index = jnp.arange(int(np.prod(shape, dtype=int)), dtype=jnp.int32).reshape(shape)
        return _Capture(dg, index, i)

    def visit(node):
        if isinstance(node, Fp8RaggedDot):
            return node  # grouped GEMMs: not observed (their operands are ragged)
        if isinstance(node, Fp8DotGeneral):
            return wrap(node)
        op = fp8_op(node)
        if op is None or isinstance(op, Fp8RaggedDot):
            return node
        kind = kind_of(node)
        assert kind is not None
        return kind.with_op(node, wrap(op))

    return jtu.tree_map(visit, model, is_leaf=_is_holder)


def concrete(x, what: str) -> np.ndarray:
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"`{what}` reads the values of the FP8 state, so it must be called outside `jax.jit`, `jax.grad` and "
            "other transformations (on the model a training step returned)."
        )
    return np.asarray(x, np.float64)


def scaling_stats(model: Any, fn: Callable | None = None, *args, **kwargs) -> dict[str, float]:
    """Per-layer FP8 scaling statistics as a flat `{name: float}` dict, ready for
    `wandb.log` or TensorBoard's `add_scalar`.

    For every [`fp8ax.Fp8DotGeneral`][] with a stateful recipe, and each of its three
    tensors `lhs` (input), `rhs` (weight) and `grad` (output gradient), the numbers its
    recipe reads from the state (`AbstractStatefulRecipe.state_stats`); for
    [`fp8ax.DelayedScaling`][]:

    - `"{path}/{tensor}/scale"`: the dequantization scale its last call used;
    - `"{path}/{tensor}/amax"`: the newest amax in its history (0 before the first step);
    - `"{path}/{tensor}/amax_history_max"`: the largest amax in its history, which sets the
      next call's scale with `amax_compute_algo="max"`.

    `path` is the layer's dotted path (`blocks.stacked.mlp.up_proj`, as in
    [`fp8ax.conversion_report`][]). A layer inside `haliax.nn.Stacked` (or an ensemble)
    has one entry per stacked layer, its index in brackets: `blocks.stacked.mlp.up_proj[1]/lhs/scale`.

    Given `fn` and its arguments, it also runs `fn(model, *args, **kwargs)` (once, on a
    copy of the model that observes each layer's operands) and adds, for the forward
    operands `lhs` and `rhs` of every FP8 layer that `fn` calls (stateless recipes too),
    and for its output gradient `grad` when `fn` differentiates through the layer (pass
    `eqx.filter_grad(loss_fn)`, or the `fp8ax.microbatched` gradient your step uses):

    - `"{path}/{tensor}/saturation"`: the fraction of its elements beyond the format's
      range at the scale the layer uses (`|x| / scale > 448` for E4M3), which the
      quantization clips;
    - `"{path}/{tensor}/underflow"`: the fraction of its nonzero elements that quantize
      to zero.

    Both are computed with the layer's own recipe and state, as the call in `fn` would
    quantize them; a layer used several times in `fn` (`vmap` over examples, a `scan`,
    microbatches) counts all its uses together. The state of the model is not changed.
    An output gradient far larger than its history (a loss scaled differently from the
    one the history saw, see the "How the FP8 state works" page) shows as a `grad`
    saturation well above 0. Calls inside `jax.shard_map`, whose amax would be reduced
    over shards, are not covered.

    **Arguments:**

    - `model`: a model with FP8 layers. Its state must be concrete: call this outside
      `jax.jit`, on the model your training step returned.
    - `fn`: optional; a function whose first argument is the model, such as the loss
      function or the model's forward pass. Pass a jitted one (`eqx.filter_jit`) to
      compile it once for repeated logging.
    - `*args`, `**kwargs`: the rest of `fn`'s arguments, e.g. a batch.

    **Returns:**

    A `dict` from names to Python floats.

    !!! Example

        ```python
        wandb.log(fp8ax.scaling_stats(model), step=step)                  # scales and amaxes
        wandb.log(fp8ax.scaling_stats(model, loss_fn, x, y), step=step)   # ... and saturation, underflow
        stats = fp8ax.scaling_stats(model, eqx.filter_grad(loss_fn), x, y)  # ... of the gradients too
        ```
    """
    global _active
    layers = fp8_layers(model)
    out: dict[str, float] = {}
    for name, dg, _ in layers:
        numbers = {}
        for role, _ in dg._state_problems(empty=False) if dg.state is not None and not _traced(dg) else ():
            raise ValueError(f"FP8 state `{name}/{role}`: {CORRUPT_STATE}")
        for role in ROLES:
            state = getattr(dg, role)
            if state is not None:
                fields = tuple(concrete(v, "scaling_stats") for v in jax.tree.leaves(state))
                numbers[role] = stateful_recipe(dg.settings).state_stats(fields)  # the recipe reads its own state
        if not numbers:
            continue
        for index in np.ndindex(*_state_shape(dg)):  # one entry per stacked layer
            for role, named in numbers.items():
                for stat, values in named.items():
                    values = np.asarray(values)[index]
                    # Per-expert or per-group state (`Fp8RaggedDot`): one entry per expert.
                    for expert in np.ndindex(*values.shape):
                        key = f"{name}{index_str(index)}/{role}{index_str(expert)}/{stat}"
                        out[key] = float(values[expert])
    if fn is None:
        if args or kwargs:
            raise TypeError("`scaling_stats` got arguments for `fn`, but no `fn`: pass the function first.")
        return out
    if not callable(fn):
        raise TypeError(f"`fn` must be a callable taking the model first (e.g. the loss), got {type(fn).__name__}.")
    with _LOCK:
        if _active is not None:
            raise RuntimeError("`scaling_stats` is already running a function (in another thread?).")
        _active = {}
        _SHAPES.clear()
        _SHAPES.update({i: shape for i, (_, _, shape) in enumerate(layers)})
    try:
        result = fn(_wrapped(model, layers), *args, **kwargs)
        jax.block_until_ready(result)
        jax.effects_barrier()
        with _LOCK:
            seen = dict(_active)
    finally:
        with _LOCK:
            _active = None
    for (slot, index), roles in sorted(seen.items()):
        name = layers[slot][0]
        for role in ROLES:
            c = roles.get(role)
            if c is None:
                continue
            key = f"{name}{index_str(index)}/{role}"
            out[f"{key}/saturation"] = c["saturated"] / c["total"] if c["total"] else 0.0
            out[f"{key}/underflow"] = c["underflow"] / c["nonzero"] if c["nonzero"] else 0.0
    return out


def _traced(dg) -> bool:
    # (A traced state is refused below, with `scaling_stats`'s own message.)
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(dg))
