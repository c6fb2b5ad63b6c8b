import functools
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from . import _formats
from ._maxgrad import as_f32, is_max, merged_amax, raw_to_max
from ._recipes import AbstractScalingRecipe, DelayedScaling
from ._state import ScalingState
from ._update import OverwriteWithGradient

Mode = Literal["direct", "qdq"]
_MODES = ("direct", "qdq")
_GEMMS = ("fwd", "dlhs", "drhs")


def check_operand_recipes(recipe, lhs_recipe, rhs_recipe, grad_recipe, high_precision_gemms):
    """Validates the per-operand overrides; returns them normalised."""
    from ._current import AbstractStatelessRecipe

    overrides = {"lhs_recipe": lhs_recipe, "rhs_recipe": rhs_recipe, "grad_recipe": grad_recipe}
    for name, value in overrides.items():
        if value is not None and value != "off" and not isinstance(value, AbstractStatelessRecipe):
            raise TypeError(
                f"`{name}` must be None (use `recipe`), 'off' (no quantisation) or a stateless recipe "
                f"(`fp8ax.CurrentScaling`, `fp8ax.MXScaling`, `fp8ax.Int8Scaling`), got {value!r}."
            )
    if isinstance(high_precision_gemms, str) or not all(g in _GEMMS for g in high_precision_gemms):
        raise ValueError(f"`high_precision_gemms` must be a sequence of names from {_GEMMS}, got {high_precision_gemms!r}.")
    high_precision_gemms = tuple(g for g in _GEMMS if g in tuple(high_precision_gemms))
    changed = any(v is not None for v in overrides.values()) or high_precision_gemms
    if changed and isinstance(recipe, AbstractScalingRecipe) and recipe.stateful:
        raise ValueError(
            "Per-operand recipes and `high_precision_gemms` need a stateless `recipe` (`fp8ax.CurrentScaling`, "
            f"`fp8ax.MXScaling`, `fp8ax.Int8Scaling`); got {type(recipe).__name__}, whose state covers all three "
            "tensors."
        )
    return lhs_recipe, rhs_recipe, grad_recipe, high_precision_gemms

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _check_precision(value, argname: str):
    if value is None or isinstance(value, lax.Precision):
        return value
    if isinstance(value, str):
        try:
            return lax.Precision(value)
        except ValueError:
            pass
    raise TypeError(f"`{argname}` must be None or a `jax.lax.Precision`, got {value!r}.")


def _check_compute_dtype(value) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(f"`compute_dtype` must be None or a floating dtype, got {value!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise TypeError(f"`compute_dtype` must be a floating dtype wider than 8 bits, got {dtype}.")
    return dtype


def _check_recipe_and_mode(recipe, mode) -> None:
    if not isinstance(recipe, AbstractScalingRecipe):
        raise TypeError(
            "`recipe` must be an fp8ax recipe (`fp8ax.DelayedScaling()`, `fp8ax.CurrentScaling()`, "
            f"`fp8ax.MXScaling()`, `fp8ax.Int8Scaling()`), got {type(recipe).__name__}."
        )
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")


class Fp8DotGeneral(OverwriteWithGradient):
    """Low-precision drop-in for `jax.lax.dot_general`: FP8 (or MX, or int8) GEMMs.

    With [`fp8ax.DelayedScaling`][] (the default) it holds the scaling state of its three
    tensors as float32 leaves: `lhs` (the input), `rhs` (the kernel) and `grad` (the
    gradient of the output), each a [`fp8ax.ScalingState`][] with `scale` and
    `amax_history`. Its custom VJP returns the new state as the "gradient" of those
    leaves; see [`fp8ax.apply_updates`][]. With a stateless recipe
    ([`fp8ax.CurrentScaling`][], [`fp8ax.MXScaling`][], [`fp8ax.Int8Scaling`][]) the three
    fields are `None` and the module has no array leaves.

    It has the call signature of `jax.lax.dot_general`, so it goes wherever Haliax takes a
    `dot_general`: `hax.nn.Linear(..., dot_general=...)`, `hax.dot(..., dot_general=...)`,
    `NamedArray.dot(..., dot_general=...)`.
    """

    lhs: ScalingState
    rhs: ScalingState
    grad: ScalingState
    recipe: AbstractScalingRecipe = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    compute_dtype: np.dtype | None = eqx.field(static=True)
    fwd_precision: lax.Precision | None = eqx.field(static=True)
    dlhs_precision: lax.Precision | None = eqx.field(static=True)
    drhs_precision: lax.Precision | None = eqx.field(static=True)
    fp8_all_gather_axes: tuple[str, ...] | None = eqx.field(static=True, default=None)
    lhs_recipe: Any = eqx.field(static=True, default=None)
    rhs_recipe: Any = eqx.field(static=True, default=None)
    grad_recipe: Any = eqx.field(static=True, default=None)
    high_precision_gemms: tuple[str, ...] = eqx.field(static=True, default=())

    def __check_init__(self):
        _check_recipe_and_mode(self.recipe, self.mode)
        check_operand_recipes(self.recipe, self.lhs_recipe, self.rhs_recipe, self.grad_recipe,
                              self.high_precision_gemms)
        for name in ("lhs", "rhs", "grad"):
            if not isinstance(getattr(self, name), ScalingState | None):
                raise TypeError(f"`{name}` must be an `fp8ax.ScalingState`, got {type(getattr(self, name)).__name__}.")

    @classmethod
    def init(
        cls,
        recipe: AbstractScalingRecipe | None = None,
        *,
        mode: Mode = "direct",
        compute_dtype=None,
        fwd_precision: lax.Precision | None = None,
        dlhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        drhs_precision: lax.Precision | None = lax.Precision.DEFAULT,
        batch_shape: tuple[int, ...] = (),
        fp8_all_gather_axes: Sequence[str] | None = None,
        lhs_recipe=None,
        rhs_recipe=None,
        grad_recipe=None,
        high_precision_gemms: Sequence[str] = (),
    ) -> "Fp8DotGeneral":
        """Builds an `Fp8DotGeneral` with fresh state (scale 1, empty history).

        **Arguments:**

        - `recipe`: the scaling recipe; default [`fp8ax.DelayedScaling`][]`()`.
        - `mode`: `"direct"` (default) quantises both operands and calls
          `lax.dot_general` on the FP8 arrays with a float32 result, then multiplies by
          the two scales. `"qdq"` quantises, dequantises back to the compute dtype and
          calls a high-precision `dot_general`: the convert-multiply-dot pattern that
          XLA's GPU compiler rewrites into a cuBLASLt FP8 GEMM. With float32 operands both
          give the same result up to float32 rounding; with bf16 operands `"qdq"`
          dequantises in bf16 (as XLA's pattern requires), which rounds the scales to
          bf16 too. (Keyword only argument.)
        - `compute_dtype`: if given, both operands are cast to it first (for example
          `jnp.bfloat16`). (Keyword only argument.)
        - `fwd_precision`: `lax.Precision` of the forward GEMM; `None` uses the `precision`
          passed by the caller. On GPU, `DEFAULT` lets XLA use FP8 fast accumulation and
          `HIGHEST` turns it off. (Keyword only argument.)
        - `dlhs_precision`, `drhs_precision`: the same for the two backward GEMMs (input
          gradient and kernel gradient). (Keyword only arguments.)
        - `batch_shape`: leading shape of the state arrays, one state per stacked layer
          (what [`fp8ax.fp8_linear_layers`][] uses inside `haliax.nn.Stacked`). (Keyword
          only argument.)
        - `fp8_all_gather_axes`: the Haliax axis names of `rhs`, in order. If given, the
          FP8 `rhs` is laid out by the current Haliax axis mapping right after
          quantisation (a sharding constraint), so that an FSDP all-gather of the weight
          moves FP8 values. `None` (default): no constraint. (Keyword only argument.)
        - `lhs_recipe`, `rhs_recipe`, `grad_recipe`: per-operand overrides of a stateless
          `recipe`: `None` (default) uses `recipe`, `"off"` leaves that operand in high
          precision, a stateless recipe quantises it that way. (Keyword only arguments.)
        - `high_precision_gemms`: GEMMs computed without quantisation, from `"fwd"`,
          `"dlhs"` (input gradient) and `"drhs"` (weight gradient); e.g. `("drhs",)` is
          torchao's `rowwise_with_gw_hp`. Stateless recipes only. (Keyword only argument.)
        """
        if recipe is None:
            recipe = DelayedScaling()
        _check_recipe_and_mode(recipe, mode)
        lhs_recipe, rhs_recipe, grad_recipe, high_precision_gemms = check_operand_recipes(
            recipe, lhs_recipe, rhs_recipe, grad_recipe, high_precision_gemms)
        stateful = recipe.stateful
        if compute_dtype is not None:
            compute_dtype = _check_compute_dtype(compute_dtype)
        batch_shape = tuple(int(b) for b in batch_shape)
        if fp8_all_gather_axes is not None:
            if isinstance(fp8_all_gather_axes, str) or not all(isinstance(a, str) for a in fp8_all_gather_axes):
                raise TypeError(
                    f"`fp8_all_gather_axes` must be None or a sequence of axis names, got {fp8_all_gather_axes!r}."
                )
            fp8_all_gather_axes = tuple(fp8_all_gather_axes)
        return cls(
            lhs=recipe.init_state(batch_shape) if stateful else None,
            rhs=recipe.init_state(batch_shape) if stateful else None,
            grad=recipe.init_state(batch_shape) if stateful else None,
            recipe=recipe,
            mode=mode,
            compute_dtype=compute_dtype,
            fwd_precision=_check_precision(fwd_precision, "fwd_precision"),
            dlhs_precision=_check_precision(dlhs_precision, "dlhs_precision"),
            drhs_precision=_check_precision(drhs_precision, "drhs_precision"),
            fp8_all_gather_axes=fp8_all_gather_axes,
            lhs_recipe=lhs_recipe,
            rhs_recipe=rhs_recipe,
            grad_recipe=grad_recipe,
            high_precision_gemms=high_precision_gemms,
        )

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
        lhs = _check_operand(lhs, "lhs")
        rhs = _check_operand(rhs, "rhs")
        if self.compute_dtype is not None:
            lhs = lhs.astype(self.compute_dtype)
            rhs = rhs.astype(self.compute_dtype)
        dims = _check_dimension_numbers(dimension_numbers, lhs.shape, rhs.shape)
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
        out = jax.eval_shape(
            functools.partial(lax.dot_general, dimension_numbers=dims, preferred_element_type=preferred_element_type),
            jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
            jax.ShapeDtypeStruct(rhs.shape, rhs.dtype),
        )
        if not self.recipe.stateful:
            return self._stateless_call(lhs, rhs, dims, precision, preferred_element_type, out.dtype)
        raw = []
        for name in ("lhs", "rhs", "grad"):
            state: ScalingState = getattr(self, name)
            for leaf_name, leaf in zip(("scale", "amax_history"), state._raw()):
                if not (is_max(leaf) or getattr(leaf, "dtype", None) == np.float32):
                    raise TypeError(
                        f"FP8 state `{name}.{leaf_name}` has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}, but "
                        "must stay float32 (a bf16 amax or scale loses the precision the scaling needs). It was "
                        "probably cast along with the model: cast with `fp8ax.cast_floating(model, dtype)`, which "
                        "leaves FP8 state alone."
                    )
                raw.append(leaf)
        static = _Static(
            dims=dims,
            lhs_dtype=np.dtype(lhs.dtype),
            rhs_dtype=np.dtype(rhs.dtype),
            out_dtype=np.dtype(out.dtype),
            preferred=preferred_element_type,
            fwd_precision=self.fwd_precision if self.fwd_precision is not None else precision,
            dlhs_precision=self.dlhs_precision,
            drhs_precision=self.drhs_precision,
            mode=self.mode,
            recipe=self.recipe,
            state_is_max=tuple(is_max(v) for v in raw),
            lhs_vma=_vma(lhs),
            rhs_vma=_vma(rhs),
            rhs_axes=self.fp8_all_gather_axes,
        )
        return _fp8_dot(static, lhs, rhs, *raw)

    def _stateless_call(self, lhs, rhs, dims, precision, preferred, out_dtype):
        from ._stateless import StatelessStatic, stateless_dot

        def operand(override):
            return self.recipe if override is None else (None if override == "off" else override)

        static = StatelessStatic(
            dims=dims,
            lhs_dtype=np.dtype(lhs.dtype),
            rhs_dtype=np.dtype(rhs.dtype),
            out_dtype=np.dtype(out_dtype),
            preferred=preferred,
            fwd_precision=self.fwd_precision if self.fwd_precision is not None else precision,
            dlhs_precision=self.dlhs_precision,
            drhs_precision=self.drhs_precision,
            mode=self.mode,
            lhs=operand(self.lhs_recipe),
            rhs=operand(self.rhs_recipe),
            grad=operand(self.grad_recipe),
            high_precision=frozenset(self.high_precision_gemms),
            lhs_vma=_vma(lhs),
            rhs_vma=_vma(rhs),
        )
        return stateless_dot(static, lhs, rhs)

    def _overwritten_by(self, new: "Fp8DotGeneral") -> "Fp8DotGeneral":
        # Used by `apply_updates`: take the new state of every layer the step used.
        if self.lhs is None:  # a stateless recipe: nothing to write
            return self
        return eqx.tree_at(
            lambda m: (m.lhs, m.rhs, m.grad),
            self,
            (
                self.lhs._overwritten_by(new.lhs),
                self.rhs._overwritten_by(new.rhs),
                self.grad._overwritten_by(new.grad),
            ),
            is_leaf=lambda x: isinstance(x, ScalingState),
        )

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


def _check_operand(x, argname: str) -> Array:
    if not isinstance(x, jax.Array | np.ndarray | np.generic):
        raise TypeError(f"`{argname}` must be a floating-point array, got {type(x).__name__}.")
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or dtype in _formats.FP8_DTYPES:
        raise TypeError(
            f"`{argname}` must be a float16, bfloat16, float32 or float64 array to be quantised to FP8, got dtype "
            f"{dtype}. For integer or complex matmuls use `jax.lax.dot_general`."
        )
    return jnp.asarray(x)


def _check_dimension_numbers(dimension_numbers, lhs_shape, rhs_shape):
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in ds) for ds in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise TypeError(
            "`dimension_numbers` must be ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)), "
            f"got {dimension_numbers!r}."
        ) from None
    for name, ds, shape in (("lhs", lc + lb, lhs_shape), ("rhs", rc + rb, rhs_shape)):
        bad = [d for d in ds if not -len(shape) <= d < len(shape)]
        if bad:
            raise ValueError(f"`dimension_numbers` names dimensions {bad} of `{name}`, which has shape {shape}.")
    lc = tuple(d % len(lhs_shape) for d in lc)
    rc = tuple(d % len(rhs_shape) for d in rc)
    lb = tuple(d % len(lhs_shape) for d in lb)
    rb = tuple(d % len(rhs_shape) for d in rb)
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(f"`dimension_numbers` pairs {len(lc)}/{len(lb)} lhs dims with {len(rc)}/{len(rb)} rhs dims.")
    lsz = tuple(lhs_shape[d] for d in lc)
    rsz = tuple(rhs_shape[d] for d in rc)
    if lsz != rsz:
        raise ValueError(
            f"`lhs` and `rhs` do not contract: lhs dims {lc} have sizes {lsz} but rhs dims {rc} have sizes {rsz} "
            f"(lhs shape {lhs_shape}, rhs shape {rhs_shape})."
        )
    lbs = tuple(lhs_shape[d] for d in lb)
    rbs = tuple(rhs_shape[d] for d in rb)
    if lbs != rbs:
        raise ValueError(f"batch dims of `lhs` {lb} (sizes {lbs}) and `rhs` {rb} (sizes {rbs}) differ.")
    return (lc, rc), (lb, rb)


class _Static(NamedTuple):
    dims: tuple
    lhs_dtype: np.dtype
    rhs_dtype: np.dtype
    out_dtype: np.dtype
    preferred: np.dtype | None
    fwd_precision: lax.Precision | None
    dlhs_precision: lax.Precision | None
    drhs_precision: lax.Precision | None
    mode: str
    recipe: AbstractScalingRecipe
    state_is_max: tuple[bool, ...]  # which state values arrive in the max-accumulating dtype
    lhs_vma: frozenset  # `jax.shard_map` axes the operands vary over (empty outside shard_map)
    rhs_vma: frozenset
    rhs_axes: tuple[str, ...] | None  # Haliax names of rhs's axes, for the FP8 all-gather


def _lay_out_by_axis_mapping(q, axes: tuple[str, ...] | None):
    """Sharding constraint on a quantised weight: the layout the current Haliax axis
    mapping gives its named axes. The weight is quantised where it lies (sharded, for
    FSDP), so the all-gather that XLA's SPMD partitioner inserts to reach this layout
    moves FP8 values (without it, `"qdq"` mode gathers the dequantised weight).

    The constraint is put on the FP8 bits viewed as uint8. Put on the FP8 array itself,
    XLA:CPU widens it to float32 before partitioning and gathers 4 bytes per value."""
    if axes is None or len(axes) != q.ndim:
        return q
    if hax.partitioning.current_thread_local_mapping() is None:
        return q
    bits = lax.bitcast_convert_type(q, jnp.uint8)
    named = hax.NamedArray(bits, tuple(hax.Axis(name, size) for name, size in zip(axes, q.shape)))
    return lax.bitcast_convert_type(hax.shard(named).array, q.dtype)


def _vma(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases call it `vma`
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", None) or ())


def _reduce_to(value, vma: frozenset, reduce):
    """Inside `jax.shard_map`: reduce `value` over the manual axes it varies over but
    `vma` does not, so it has the type of a value that varies over `vma` only."""
    extra = tuple(sorted(_vma(value) - vma))
    return reduce(value, extra) if extra else value


def _free_dims(ndim, contracting, batch):
    return tuple(d for d in range(ndim) if d not in contracting and d not in batch)


def _gemm(st: _Static, a, a_scale, b, b_scale, dims, precision, out_dtype, ref_dtype):
    """Scaled GEMM of two quantised operands. `direct`: FP8 dot with a float32 result,
    then one multiply by the product of the scales. `qdq`: dequantise to `ref_dtype`,
    then a dot in that dtype."""
    if st.mode == "direct":
        acc = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)
        return (acc * (a_scale * b_scale)).astype(out_dtype)
    da = _formats.dequantize(a, a_scale, ref_dtype)
    db = _formats.dequantize(b, b_scale, ref_dtype)
    pref = jnp.float32 if ref_dtype == np.float32 else None
    return lax.dot_general(da, db, dims, precision=precision, preferred_element_type=pref).astype(out_dtype)


def _quantise_operand(recipe, x, scale, history, fp8_dtype):
    # Under `jax.shard_map`, a tensor that varies over a manual axis its state does not
    # vary over is one shard of a bigger tensor: its amax is the max over the shards
    # (as `jax.vmap` data axes are merged by `merged_amax`). Under `jax.jit` with
    # shardings, XLA computes the global max by itself.
    amax = _reduce_to(_formats.amax(x), _vma(scale), lax.pmax)
    amax = merged_amax(amax, scale)
    used = recipe.scale_for_call(scale, history, amax, _formats.fp8_max(fp8_dtype))
    return _formats.quantize(x, used, fp8_dtype), used, amax


def _to_rep(value, as_max: bool):
    return raw_to_max(value) if as_max else value


def _compute_dtype(st: _Static):
    return np.result_type(st.lhs_dtype, st.rhs_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(st: _Static, lhs, rhs, l_scale, l_hist, r_scale, r_hist, g_scale, g_hist):
    return _fp8_dot_fwd(st, lhs, rhs, l_scale, l_hist, r_scale, r_hist, g_scale, g_hist)[0]


def _fp8_dot_fwd(st: _Static, lhs, rhs, l_scale, l_hist, r_scale, r_hist, g_scale, g_hist):
    recipe = st.recipe
    ls, lh, rs, rh, gs, gh = (as_f32(v) for v in (l_scale, l_hist, r_scale, r_hist, g_scale, g_hist))
    ql, l_used, l_amax = _quantise_operand(recipe, lhs, ls, lh, recipe.fwd_dtype)
    qr, r_used, r_amax = _quantise_operand(recipe, rhs, rs, rh, recipe.fwd_dtype)
    qr = _lay_out_by_axis_mapping(qr, st.rhs_axes)
    out = _gemm(st, ql, l_used, qr, r_used, st.dims, st.fwd_precision, st.out_dtype, _compute_dtype(st))
    return out, (ql, qr, l_used, r_used, l_amax, r_amax, (ls, lh, rs, rh, gs, gh))


def oriented_gemm(gemm, a_contract, b_contract, a_batch, b_batch, layout_ab, layout_ba):
    """One backward GEMM, in the operand order whose result is already laid out as the
    gradient's operand (no transpose of the result), if either order gives that.

    `gemm(swapped, dims)` computes `a . b` (or `b . a` if `swapped`) with `dims`."""

    def in_order(layout):
        return list(layout) == sorted(layout)

    if not in_order(layout_ab) and in_order(layout_ba):
        out = gemm(True, ((b_contract, a_contract), (b_batch, a_batch)))
        layout = layout_ba
    else:
        out = gemm(False, ((a_contract, b_contract), (a_batch, b_batch)))
        layout = layout_ab
    return out if in_order(layout) else jnp.transpose(out, np.argsort(layout))


class BwdLayout(NamedTuple):
    """Dimension bookkeeping of the two backward GEMMs of `dot_general(lhs, rhs, dims)`."""

    l_free: tuple
    r_free: tuple
    g_batch: tuple
    g_lfree: tuple
    g_rfree: tuple
    dlhs_ab: tuple  # layout of dlhs computed as g . rhs
    dlhs_ba: tuple  # ... as rhs . g
    drhs_ab: tuple  # layout of drhs computed as lhs . g
    drhs_ba: tuple  # ... as g . lhs


def bwd_layout(dims, l_ndim, r_ndim) -> BwdLayout:
    (lc, rc), (lb, rb) = dims
    # dot_general's output layout: (batch..., lhs free..., rhs free...).
    nb = len(lb)
    l_free = _free_dims(l_ndim, lc, lb)
    r_free = _free_dims(r_ndim, rc, rb)
    g_batch = tuple(range(nb))
    g_lfree = tuple(range(nb, nb + len(l_free)))
    g_rfree = tuple(range(nb + len(l_free), nb + len(l_free) + len(r_free)))
    # rhs contracting dim rc[i] stands for lhs dim lc[i] and vice versa; a GEMM's free
    # dims come out in axis order.
    lc_of_rc = tuple(lc[rc.index(d)] for d in sorted(rc))
    rc_of_lc = tuple(rc[lc.index(d)] for d in sorted(lc))
    return BwdLayout(
        l_free, r_free, g_batch, g_lfree, g_rfree,
        dlhs_ab=tuple(lb) + l_free + lc_of_rc, dlhs_ba=tuple(lb) + lc_of_rc + l_free,
        drhs_ab=tuple(rb) + rc_of_lc + r_free, drhs_ba=tuple(rb) + r_free + rc_of_lc,
    )


def _fp8_dot_bwd(st: _Static, residuals, g):
    recipe = st.recipe
    ql, qr, l_used, r_used, l_amax, r_amax, (ls, lh, rs, rh, gs, gh) = residuals
    (_, _), (lb, rb) = st.dims
    qg, g_used, g_amax = _quantise_operand(recipe, g, gs, gh, recipe.grad_dtype)
    lay = bwd_layout(st.dims, ql.ndim, qr.ndim)
    ref = _compute_dtype(st)

    def scaled(a, a_scale, b, b_scale, precision, out_dtype):
        def gemm(swapped, dims):
            if swapped:
                return _gemm(st, b, b_scale, a, a_scale, dims, precision, out_dtype, ref)
            return _gemm(st, a, a_scale, b, b_scale, dims, precision, out_dtype, ref)

        return gemm

    # d lhs: contract g's rhs-free dims with rhs's free dims.
    dlhs = oriented_gemm(scaled(qg, g_used, qr, r_used, st.dlhs_precision, st.lhs_dtype),
                         lay.g_rfree, lay.r_free, lay.g_batch, rb, lay.dlhs_ab, lay.dlhs_ba)
    # d rhs: contract g's lhs-free dims with lhs's free dims.
    drhs = oriented_gemm(scaled(ql, l_used, qg, g_used, st.drhs_precision, st.rhs_dtype),
                         lay.l_free, lay.g_lfree, lb, lay.g_batch, lay.drhs_ab, lay.drhs_ba)

    # New state. Under vmap, residuals can come back batched along data axes where the
    # state is not; merging them again with max is exact (they are equal copies, or
    # per-example amaxes whose max is the observation).
    new = []
    for scale, hist, used, amax in ((ls, lh, l_used, l_amax), (rs, rh, r_used, r_amax), (gs, gh, g_used, g_amax)):
        new.extend(recipe.next_state(merged_amax(used, scale), hist, merged_amax(amax, scale)))
    state = (ls, lh, rs, rh, gs, gh)
    new = [_reduce_to(v, _vma(old), lax.pmax) for v, old in zip(new, state)]
    cts = tuple(_to_rep(v.astype(jnp.float32), m) for v, m in zip(new, st.state_is_max))
    # Under `jax.shard_map` the cotangent of an operand that does not vary over a manual
    # axis (a replicated weight) is summed over it, as JAX's own `dot_general` does.
    dlhs = _reduce_to(dlhs, st.lhs_vma, lax.psum)
    drhs = _reduce_to(drhs, st.rhs_vma, lax.psum)
    return (dlhs, drhs, *cts)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
