from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _haliax
from ._state import is_owg, max_merge

T = TypeVar("T")


def _is_leaf(x: Any) -> bool:
    return x is None or is_owg(x)


def accumulate_gradients(acc: T | None, grads: T) -> T:
    """Adds one microbatch's gradients to an accumulator, merging FP8 state with `max`.

    Ordinary gradients are summed. The FP8 state (the new state that
    [`fp8ax.Fp8DotGeneral`][] returns as its "gradient") is merged elementwise with
    `max`, the same merge fp8ax applies to several uses of a layer inside one step. Each
    microbatch's new state holds the old history shifted once with that microbatch's
    amax in front, so the max is the state of one observation of the whole batch: the
    newest amax is the batch's amax, the history is shifted once, and the scale is the one
    a single step would use. Summing instead would multiply the state by the number of
    microbatches.

    A layer a microbatch did not use reports an all-zero state, which is the identity of
    `max`; if no microbatch used it, [`fp8ax.apply_updates`][] keeps its old state.

    **Arguments:**

    - `acc`: the accumulator so far, or `None` to start with `grads`.
    - `grads`: the gradients of one microbatch, as `eqx.filter_grad` returns them
      (before [`fp8ax.partition_for_grad_overwrite`][]). Any PyTree of arrays works,
      e.g. `(loss, grads)`.

    **Returns:**

    The new accumulator, with the structure of `grads`.

    **Raises:**

    `ValueError` if `acc` and `grads` have different structures.

    !!! Example

        ```python
        acc = None
        for xs, ys in microbatches:
            acc = fp8ax.accumulate_gradients(acc, eqx.filter_grad(loss_fn)(model, xs, ys))
        overwrite, grads = fp8ax.partition_for_grad_overwrite(acc)
        ```

    !!! Note

        To average gradients of per-microbatch *mean* losses, partition first and divide
        only the ordinary gradients: `jax.tree.map(lambda g: g / k, grads)`. Dividing the
        whole accumulator would divide the FP8 state too.
    """
    if acc is None:
        return grads
    acc_def = jtu.tree_structure(acc, is_leaf=_is_leaf)
    grads_def = jtu.tree_structure(grads, is_leaf=_is_leaf)
    if acc_def != grads_def:
        raise ValueError(
            "`grads` must have the same tree structure as `acc` (the gradients of the same model), got\n"
            f"  acc:   {acc_def}\n  grads: {grads_def}"
        )

    def merge(a, g):
        if a is None or g is None:
            if not (a is None and g is None):
                raise ValueError("`acc` and `grads` disagree on which leaves are None.")
            return None
        if is_owg(a):
            return jtu.tree_map(max_merge, a, g)
        return _add(a, g)

    return jtu.tree_map(merge, acc, grads, is_leaf=_is_leaf)


def _add(a, g):
    if eqx.is_array(a) or eqx.is_array(g):
        with jax.numpy_dtype_promotion("standard"):
            return (a + g).astype(jnp.result_type(a))
    # A non-array leaf (a Python scalar from a custom module) has no gradient to add.
    return a


def microbatched(fn: Callable[..., T], num_microbatches: int, *, average: bool = False) -> Callable[..., T]:
    """Runs `fn` on microbatches with `jax.lax.scan` and accumulates its results.

    `microbatched(fn, k)(model, *batch)` splits every array in `batch` along its leading
    axis into `k` equal microbatches, calls `fn(model, *microbatch)` on each inside a
    `jax.lax.scan` (one trace, constant memory in `k`), and combines the results with
    [`fp8ax.accumulate_gradients`][]: sums for gradients and losses, `max` for FP8 state.

    **Arguments:**

    - `fn`: `fn(model, *batch)` returning a PyTree of arrays, usually the output of
      `eqx.filter_grad(loss_fn)` or `eqx.filter_value_and_grad(loss_fn)`.
    - `num_microbatches`: `k`, an int >= 1 that divides the leading axis of every array in
      `batch`. Haliax `NamedArray`s are split along their first axis.
    - `average`: divide the summed results by `k`, but never the FP8 state. Use it when
      `fn` differentiates the *mean* loss of its microbatch: the result is then the
      gradient of the mean loss of the whole batch. Without it, write the loss of a
      microbatch as its sum divided by the *whole* batch size. (Keyword only argument.)

    **Returns:**

    A function `(model, *batch) -> result`, with `fn`'s output structure.

    !!! Example

        ```python
        grad_fn = fp8ax.microbatched(eqx.filter_grad(loss_fn), 4, average=True)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grad_fn(model, x, y))
        ```
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int | np.integer):
        raise TypeError(f"`num_microbatches` must be an int >= 1, got {num_microbatches!r}.")
    if num_microbatches < 1:
        raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}.")
    if not isinstance(average, bool):
        raise TypeError(f"`average` must be a bool, got {average!r}.")
    k = int(num_microbatches)

    def run(model, *batch):
        split, rebuild = _split_batch(batch, k)
        first = rebuild(jtu.tree_map(lambda a: a[0], split))
        shapes = eqx.filter_eval_shape(fn, model, *first)
        bad = [jtu.keystr(p) for p, s in jtu.tree_leaves_with_path(shapes) if not isinstance(s, jax.ShapeDtypeStruct)]
        if bad:
            raise TypeError(f"`fn` must return a PyTree of arrays to accumulate; these leaves are not: {bad[:5]}.")
        # All-zero start: the identity of the sum, and of the max for FP8 state.
        init = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(acc, part):
            return accumulate_gradients(acc, fn(model, *rebuild(part))), None

        acc, _ = jax.lax.scan(body, init, split)
        if not average:
            return acc
        state, rest = eqx.partition(acc, is_owg, is_leaf=is_owg)
        with jax.numpy_dtype_promotion("standard"):
            rest = jtu.tree_map(lambda a: (a / k).astype(a.dtype), rest)
        return eqx.combine(state, rest, is_leaf=is_owg)

    return run


def _split_batch(batch: tuple, k: int):
    """`(arrays of shape (k, n // k, ...), rebuild)`; `rebuild` restores the batch structure."""
    is_named = _haliax.is_named
    leaves, treedef = jtu.tree_flatten_with_path(batch, is_leaf=is_named)
    arrays, axes = [], []
    for path, leaf in leaves:
        where = f"batch{jtu.keystr(path)}"
        named = is_named(leaf)
        array = leaf.array if named else leaf
        if not eqx.is_array_like(array) or jnp.ndim(array) == 0:
            raise TypeError(f"`{where}` must be an array with a leading batch axis to split, got {leaf!r}.")
        n = jnp.shape(array)[0]
        if n % k:
            raise ValueError(f"`num_microbatches` ({k}) must divide the leading axis of `{where}` (size {n}).")
        arrays.append(jnp.reshape(jnp.asarray(array), (k, n // k, *jnp.shape(array)[1:])))
        axes.append((leaf.axes[0].resize(n // k), *leaf.axes[1:]) if named else None)

    def rebuild(parts):
        out = [p if ax is None else _haliax.hax().NamedArray(p, ax) for p, ax in zip(parts, axes)]
        return jtu.tree_unflatten(treedef, out)

    return arrays, rebuild
