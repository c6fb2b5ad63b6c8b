import functools
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from ._boundaries import lowers_for_cpu_only, vma

# The 8-bit floating-point formats fp8ax quantizes to.
FP8_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz)
)


def as_fp8_dtype(value, argname: str) -> np.dtype:
    """Normalizes an FP8 dtype argument, raising an error that names `argname`."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or dtype not in FP8_DTYPES:
        names = ", ".join(f"jnp.{d.name}" for d in FP8_DTYPES)
        raise TypeError(f"`{argname}` must be an 8-bit floating-point dtype ({names}), got {value!r}.")
    return dtype


def dtypes_from_formats(formats, fwd_dtype, grad_dtype) -> tuple[np.dtype, np.dtype]:
    """The (forward, gradient) FP8 dtypes of a recipe's `formats`, `fwd_dtype` and
    `grad_dtype` arguments: `"hybrid"` is E4M3/E5M2, `"e4m3"` E4M3 for both; an explicit
    dtype overrides."""
    if formats not in ("hybrid", "e4m3"):
        raise ValueError(f"`formats` must be 'hybrid' (E4M3 forward, E5M2 gradients) or 'e4m3', got {formats!r}.")
    fwd = jnp.float8_e4m3fn if fwd_dtype is None else fwd_dtype
    grad = (jnp.float8_e5m2 if formats == "hybrid" else jnp.float8_e4m3fn) if grad_dtype is None else grad_dtype
    return as_fp8_dtype(fwd, "fwd_dtype"), as_fp8_dtype(grad, "grad_dtype")


def fp8_max(dtype: np.dtype) -> float:
    """Largest finite value of an FP8 format (448 for E4M3FN, 57344 for E5M2)."""
    return float(jnp.finfo(dtype).max)


def quantize(x: ArrayLike, scale: ArrayLike | None, dtype: np.dtype, *, inv: ArrayLike | None = None) -> Array:
    """`clip(x / scale, -max, max)` rounded to nearest-even in `dtype`.

    The division is computed as `x * (1 / scale)`, both in float32 whatever `x`'s dtype:
    XLA rewrites a division by a broadcast scalar into exactly this, so we write it out to
    make the result well defined (and testable bit for bit). Finite values beyond the
    format's range saturate to +-max instead of becoming inf. Non-finite inputs (NaN and
    +-inf) become NaN, in every format (E5M2's inf included), so a diverging tensor
    shows in the result as it would without FP8 instead of being clipped into a
    plausible number.

    `inv`, when given, is `reciprocal(scale)` computed by the caller (where it is cheaper
    to compute beside the scale); the result is the same. `scale` is not read then (it
    may be None).
    """
    return lax.convert_element_type(scale_and_clip(x, scale, dtype, inv=inv), dtype)


# The smallest normal float32: the least scale any recipe gives. XLA flushes subnormal
# float32 results to zero (on CPUs and GPUs), so a smaller scale would be 0.
SMALLEST_SCALE = np.float32(2.0**-126)


def scale_from_amax(amax: ArrayLike, factor) -> Array:
    """The dequantization scale of an amax: `amax * factor` in float32, rounded once, and
    at least `SMALLEST_SCALE` (for an amax below `SMALLEST_SCALE / factor`, about 5.3e-36
    for E4M3, the values then stay below the format's maximum instead of the tensor
    being flushed to zero). `factor` is `2**margin / (largest value of the format)`,
    as a float32 (an array of them for stacked amaxes). What an amax that is not
    positive and finite gives is the caller's choice: each recipe has its own."""
    amax = _as_array(amax)
    new = lax.mul(amax, broadcast(jnp.asarray(np.asarray(factor, np.float32)), jnp.shape(amax)))
    return lax.max(new, lax.full_like(new, SMALLEST_SCALE))


def reciprocal(scale: ArrayLike) -> Array:
    """`1 / scale` in float32: the multiplier `quantize` applies."""
    return lax.div(np.float32(1.0), _as_f32(scale))


def scale_and_clip(x: ArrayLike, scale: ArrayLike | None, dtype: np.dtype, *, inv: ArrayLike | None = None) -> Array:
    """The float32 values `quantize` rounds: `x * (1 / scale)` clipped to the format's
    range, NaN where `x` is not finite. Shared with the stochastic rounding path."""
    bound = fp8_max(dtype)
    inv = reciprocal(cast(ArrayLike, scale)) if inv is None else _as_f32(inv)  # (`scale` is None only beside `inv`)
    xf = _as_f32(x)
    clipped = lax.clamp(np.float32(-bound), lax.mul(xf, broadcast(inv, xf.shape)), np.float32(bound))
    # Finite values saturate; a non-finite one becomes NaN: `xf - xf` is 0 where `xf` is
    # finite and NaN elsewhere, and subtracting it keeps the sign of a zero. A `select` on
    # `is_finite(xf)` (which kept E5M2's inf) made XLA:GPU write a boolean mask of the
    # tensor in a kernel of its own before some transposing casts: a pass more.
    return lax.sub(clipped, lax.sub(xf, xf))


def select(pred: ArrayLike, on_true: ArrayLike, on_false: ArrayLike) -> Array:
    """`jnp.where(pred, on_true, on_false)` for arrays of one dtype, as a bare
    `lax.select`: `jnp.where` traces a nested jitted function at every call, which the
    per-operand scaling code would pay for many times per step in trace and compile
    time. (It is written with `lax` throughout for the same reason: a `jnp` function or
    an array operator traces a few hundred Python calls, a `lax` op a few dozen.)"""
    pred, on_true, on_false = _as_array(pred), _as_array(on_true), _as_array(on_false)
    if on_false.dtype != on_true.dtype:
        on_false = lax.convert_element_type(on_false, on_true.dtype)
    shape = lax.broadcast_shapes(pred.shape, on_true.shape, on_false.shape)
    return lax.select(broadcast(pred, shape), broadcast(on_true, shape), broadcast(on_false, shape))


def computed_once(tree, *, fence: bool = True):
    """`tree`'s arrays, the same values (exactly), computed apart from what reads them:
    on CPU each computed once into a buffer, elsewhere behind an optimization barrier
    (see `fenced`).

    A barrier does not keep XLA:CPU from copying a chain of cheap elementwise operations
    into every fusion that reads its result (jax 0.10 drops barriers before it fuses;
    jax 0.12 keeps them, at a kernel per value they hold: see `fenced`). A delayed scale is
    such a chain (some 20 to 40 scalar operations from the state to the scale), read by
    the casts, the GEMMs' output scaling (fused into the optimizer's update) and the next
    state: copied into each, it made up a third of a deep model's optimized program and
    of its compile time. A reduction's result is not copied into its readers. So on CPU
    the float32 and bool arrays (the bools as 0 and 1) of the same manual axes go into
    one vector, which is reduced with `max` against the identity of `max`: one small
    reduction for the whole tree, which the chains fuse into. The identity fills seven
    rows, not one: XLA rewrites a reduction of two rows into its elementwise form, which
    is copied again. Other arrays pass unchanged.

    The reduction or the barrier is chosen per platform when the program is lowered
    (`platform_dependent`, as `amax`): XLA:GPU does not copy such chains, and keeps
    optimization barriers through fusion. With `fence=False` there is no barrier either
    (the caller fences what it returns): a barrier on a delayed-scaling plan before it is
    split per operand split XLA:GPU's scalar kernels (the H100 compile of
    bench/state_cost.py's MLP block with `calibrate_first_call=False`: 50 kernels against
    32), where the scales a call's casts use need theirs (56 kernels against 39 without
    it, default recipe)."""
    return _per_platform(tree, cpu=_reduced, default=_barrier if fence else _as_list)


def fenced(tree):
    """`lax.optimization_barrier(tree)` where the program is lowered for anything but a
    CPU, `tree` unchanged on CPU (`platform_dependent`, as `amax`).

    The barriers fp8ax places keep XLA:GPU from merging a call's scalar arithmetic
    (`computed_once`, the GEMM pipeline's plans). XLA:CPU in jax 0.10 drops barriers
    before it fuses, so there they did nothing. XLA:CPU in jax 0.12 keeps them through
    fusion, and then computes every scalar a barrier holds in a kernel of its own,
    instead of in the kernels that read it: nine per layer of delayed scaling, 58 kernels
    for bench/state_cost.py's MLP block against 40."""
    return _per_platform(tree, cpu=_as_list, default=_barrier)


def platform_dependent(*args: Array, cpu, default):
    """`lax.platform_dependent(*args, cpu=cpu, default=default)`: `cpu(*args)` where the
    program is lowered for a CPU, `default(*args)` elsewhere. Where this process can
    lower programs for its CPU only (`lowers_for_cpu_only`), `cpu(*args)` alone.

    `lax.platform_dependent` traces both branches and puts both in the program, with a
    conditional on the platform that lowering resolves. fp8ax takes it a few times per
    layer and call (`amax`, `computed_once`, the delayed-scaling plan), and the branches
    no CPU takes were 9% of a CPU program's traced equations (bench/state_cost.py's
    16-block stack and Stacked decoder) and up to 15% of its trace and lowering
    (bench/README.md, run Q). Both branches compute the same values; they differ in the
    program XLA makes of them, so the rare program traced here and lowered for another
    platform anyway (`jax.export` with `platforms=`) computes the same, in the CPU's form."""
    if lowers_for_cpu_only():
        return cpu(*args)
    return lax.platform_dependent(*args, cpu=cpu, default=default)


def _per_platform(tree, *, cpu, default):
    """`tree`'s arrays through `cpu` or `default` (functions of the flat arrays that
    return a list of as many), chosen when the program is lowered."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    out = platform_dependent(*[_as_array(leaf) for leaf in leaves], cpu=cpu, default=default)
    return jax.tree.unflatten(treedef, list(out))


def _as_list(*leaves) -> list:
    # (One function for every call: JAX caches the trace of a branch by its function.)
    return list(leaves)


def _barrier(*leaves) -> list:
    return list(lax.optimization_barrier(leaves))


def _reduced(*leaves) -> list:
    """`computed_once`'s reduction (see there), on a flat list of arrays."""
    leaves = list(leaves)
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        if leaf.dtype == np.bool_ or leaf.dtype == np.float32:
            groups.setdefault(vma(leaf), []).append(i)
    for idx in groups.values():
        parts = [lax.reshape(lax.convert_element_type(leaves[i], np.float32), (leaves[i].size,)) for i in idx]
        flat = lax.concatenate(parts, 0)
        rows = lax.concatenate([lax.expand_dims(flat, (0,)), lax.full_like(flat, -np.inf, shape=(7, flat.size))], 0)
        once = lax.reduce_max(rows, (0,))
        start = 0
        for i in idx:
            leaf, size = leaves[i], leaves[i].size
            part = lax.reshape(lax.slice_in_dim(once, start, start + size), leaf.shape)
            leaves[i] = lax.ne(part, np.float32(0)) if leaf.dtype == np.bool_ else part
            start += size
    return leaves


def broadcast(x: Array, shape: tuple[int, ...]) -> Array:
    """`x` broadcast to `shape` by NumPy's rules, as one `broadcast_in_dim`."""
    if x.shape == shape:
        return x
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


def _as_array(x: ArrayLike) -> Array:
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _as_f32(x: ArrayLike) -> Array:
    return lax.convert_element_type(_as_array(x), np.float32)


def amax(x: ArrayLike, axes: tuple[int, ...] | None = None, *, keepdims: bool = False) -> Array:
    """max |x| as float32, over `axes` (all of them by default; kept as size-1 dims with
    `keepdims`); not finite (inf or NaN) where any element reduced is NaN or inf.

    Chosen per platform when the program is lowered (`platform_dependent`, so a program
    compiled ahead of time for a GPU on a CPU host with JAX's GPU plugin gets the GPU's
    form): a plain max reduction everywhere but on CPU. XLA's `max` propagates NaN, but the CPU backend
    of jax 0.10 hands the reductions it can to YNNPACK, whose kernel skips NaNs
    (`jnp.max(jnp.abs(x))` of a 256x1024 array holding one NaN returns the largest
    finite value; with `--xla_cpu_experimental_ynn_fusion_type=` it returns NaN, and a
    reduction XLA emits itself with a non-constant initial value skips NaNs too). On CPU
    the max is therefore taken together with the min in one variadic reduction, which
    backends compile with their own reduction emitter (with `abs` fused in, and on CPU
    without the NaN-skipping kernel); the min is NaN exactly when some element is, and
    turns the amax into +inf then. Both results must be used, or XLA drops the min and
    takes the plain max again (a `select` of NaN to inf before the max would cost, on
    CPU, one more pass over every quantized tensor).

    On CPU a tensor of 2**19 elements or more is reduced in two stages, over the last
    axis (each row) and then over the rows' results: XLA:CPU splits a reduction across
    cores only when its result has an outer dimension to split (on 2 cores a 4096x1024
    amax takes 0.22-0.47 ms in two stages against 0.42-0.71 ms in one). A smaller one
    gains nothing from the split (256x1024: 52 us in one stage, 58 in two), and the
    second stage costs XLA's compile one more variadic reduction per tensor: on
    bench/state_cost.py's 16-block stack of small layers, 0.1 s of a 1.3 s compile. Max
    and min are exact, so the order changes nothing in the result. (A reduction over
    some of the axes runs in one stage.) It is jitted so that eager calls with
    `jax_debug_infs` do not see the inf it returns for a NaN."""
    x = _as_array(x)
    axes = tuple(range(x.ndim)) if axes is None else tuple(sorted({a % x.ndim for a in axes}))
    cpu, default = _amax_branches(axes, keepdims)
    return platform_dependent(x, cpu=cpu, default=default)


@functools.cache
def _amax_branches(axes: tuple[int, ...], keepdims: bool) -> tuple:
    # The same two functions for every call with these arguments: JAX caches the trace of
    # a branch by its function, and a fresh `partial` missed that cache every time.
    return (
        functools.partial(_amax_nan_as_inf, axes=axes, keepdims=keepdims),
        functools.partial(_amax_plain, axes=axes, keepdims=keepdims),
    )


def max_min(hi: Array, lo: Array, axes: tuple[int, ...]) -> tuple[Array, Array]:
    """`(max(hi), min(lo))` over `axes` in one variadic float32 reduction (XLA's `max`
    and `min` propagate NaN). With `hi` and `lo` the same array, its max and min; with
    the two results of an earlier stage, their merge. The amax and the history's bounds
    both take it."""
    return lax.reduce((hi, lo), (np.float32(-np.inf), np.float32(np.inf)), _max_min, axes)


def max_min_each(xs: list, *, keepdims: bool = False) -> list[tuple[Array, Array]]:
    """`(max, min)` of each array of `xs` (one shape) over its last axis, in one variadic
    reduction: one kernel for all of them, without first copying them into one array.
    With `keepdims`, each result keeps the last axis (size 1), ready to be concatenated
    along it."""
    if keepdims:
        xs = [lax.expand_dims(x, (x.ndim - 1,)) for x in xs]
    init = (np.float32(-np.inf), np.float32(np.inf)) * len(xs)
    out = lax.reduce(tuple(x for x in xs for _ in (0, 1)), init, _max_min, (xs[0].ndim - 1,))
    return list(zip(out[0::2], out[1::2]))


def _max_min(a, b):
    # Pairs (max, min), as many as reduced: the max of the even entries, the min of the odd.
    return tuple(lax.max(x, y) if i % 2 == 0 else lax.min(x, y) for i, (x, y) in enumerate(zip(a, b)))


def _kept(x: Array, axes: tuple[int, ...], keepdims: bool) -> Array:
    """A reduction's result with the reduced `axes` back as size-1 dims, if `keepdims`."""
    return lax.expand_dims(x, axes) if keepdims and axes else x


@functools.partial(jax.jit, static_argnames=("axes", "keepdims"))
def _amax_plain(x, *, axes=None, keepdims=False):
    # GPUs and TPUs: XLA's `max` propagates NaN there, and a plain max reduction fuses
    # with the cast beside it and with its producer (a variadic reduction made XLA:GPU
    # write the tensor out once more, only for the reduction to read it back). A NaN
    # gives a NaN amax: not finite, as the callers need.
    axes = tuple(range(x.ndim)) if axes is None else axes
    return _kept(lax.reduce_max(_as_f32(lax.abs(x)), axes), axes, keepdims)


# The smallest tensor `amax` reduces in two stages on CPU (see there).
_TWO_STAGES_FROM = 2**19


@functools.partial(jax.jit, static_argnames=("two_stage", "axes", "keepdims"))
def _amax_nan_as_inf(x, *, two_stage: bool | None = None, axes=None, keepdims=False):
    # In float32: XLA:CPU reduces a bfloat16 array in float32 anyway, and rounds each
    # result back to bfloat16 in a scalar kernel of its own (two per tensor).
    # `two_stage`: None chooses by size; True or False forces the form (for tests).
    ax = _as_f32(lax.abs(x))
    every = tuple(range(ax.ndim))
    axes = every if axes is None else axes
    if two_stage is None:
        two_stage = ax.size >= _TWO_STAGES_FROM
    if two_stage and ax.ndim >= 2 and axes == every:
        # Over the last axis, then the rest: no reshape, which could move a tensor
        # sharded along a middle axis.
        hi, lo = max_min(*max_min(ax, ax, (ax.ndim - 1,)), tuple(range(ax.ndim - 1)))
    else:
        hi, lo = max_min(ax, ax, axes)
    return _kept(select(lax.ne(lo, lo), np.float32(np.inf), hi), axes, keepdims)
