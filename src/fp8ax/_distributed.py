from collections.abc import Hashable, Sequence
from typing import TypeVar

import equinox as eqx
import jax.tree_util as jtu
from jax import lax

from ._boundaries import vma as _vma
from ._state import is_owg

T = TypeVar("T")


def _axis_names(axis_name) -> tuple[Hashable, ...]:
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, Sequence) and axis_name and all(isinstance(a, str) for a in axis_name):
        return tuple(axis_name)
    raise TypeError(f"`axis_name` must be a mesh axis name or a non-empty sequence of them, got {axis_name!r}.")


def pmean_gradients(grads: T, axis_name: str | Sequence[str]) -> T:
    """Data-parallel reduction inside `jax.shard_map`: mean of gradients, max of FP8 state.

    Each device differentiates the loss of its own shard of the batch. This returns, on
    every device, the gradients averaged over `axis_name` (`lax.pmean`) and the FP8
    state merged with `lax.pmax`: the state of one observation of the whole batch. A
    `pmean` of the state would record the mean of the shards' amaxes (too small: the
    shard with the largest values saturates), a `psum` would multiply it by the device
    count.

    Works with either setting of `shard_map(..., check_vma=...)`:

    - `check_vma=True` (JAX's default): JAX already *sums* the gradient of a replicated
      parameter over the axes the data varies over, and fp8ax already merges the amaxes of
      a replicated layer with `pmax`. Such a gradient is divided by the device count
      here, so the result is the same mean either way.
    - `check_vma=False`: every gradient is per device; they are averaged with `pmean`
      and the states merged with `pmax`.

    **Arguments:**

    - `grads`: the output of `eqx.filter_grad` on a model converted by
      [`fp8ax.fp8_linear_layers`][] (before [`fp8ax.partition_for_grad_overwrite`][]),
      computed inside `jax.shard_map`.
    - `axis_name`: the mesh axis (or axes) the batch is split over.

    **Returns:**

    The reduced gradients, with the structure of `grads`, the same on every device.

    !!! Example

        ```python
        def step(model, x, y):      # runs per device, inside jax.shard_map
            grads = eqx.filter_grad(loss_fn)(model, x, y)
            grads = fp8ax.pmean_gradients(grads, "data")
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            ...
        ```
    """
    axes = _axis_names(axis_name)
    # Under check_vma the axis index varies over its own axis; without it nothing is
    # tracked as varying.
    tracked = {a: a in _vma(lax.axis_index(a)) for a in axes}

    def reduce(x, merge):
        if not eqx.is_array(x):
            return x
        varying = _vma(x)
        for a in axes:
            if not tracked[a] or a in varying:
                x = merge(x, a)
            elif merge is lax.pmean:
                # JAX's autodiff already summed this gradient over `a`.
                x = (x / lax.axis_size(a)).astype(x.dtype)
        return x

    def reduce_node(node):
        if node is None:
            return None
        if is_owg(node):
            return jtu.tree_map(lambda x: reduce(x, lax.pmax), node)
        return reduce(node, lax.pmean)

    return jtu.tree_map(reduce_node, grads, is_leaf=lambda x: x is None or is_owg(x))
