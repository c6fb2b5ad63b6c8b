from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._recipes import record_state_write
from ._state import _is_owg

T = TypeVar("T")


def partition_for_grad_overwrite(tree: T) -> tuple[T, T]:
    """Splits a gradient tree (or a model) into FP8 state and everything else.

    **Arguments:**

    - `tree`: the output of `eqx.filter_grad` on a model converted by
      [`fp8ax.fp8_linear_layers`][], or the model itself.

    **Returns:**

    `(overwrite, rest)`, two trees of the same structure as `tree`: `overwrite` holds the
    [`fp8ax.OverwriteWithGradient`][] modules (the new FP8 state) and `None` elsewhere;
    `rest` holds everything else (the ordinary gradients) and, in place of each FP8
    module, the same module filled with zeros: the FP8 state is not trained, so its
    gradient is zero. Give `rest` to the optimiser and `overwrite` to
    [`fp8ax.apply_updates`][], which ignores whatever the optimiser makes of those zeros.

    `rest` has the structure of the model's arrays (`eqx.filter(model, eqx.is_array)`),
    so an optimiser state built from the whole model, as Equinox's examples build it,
    matches it on every step:

    !!! Example

        ```python
        opt_state = opt.init(eqx.filter(model, eqx.is_array))

        grads = eqx.filter_grad(loss_fn)(model, batch)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        model = fp8ax.apply_updates(model, updates, overwrite)
        ```

    The optimiser keeps moments for the FP8 state, all zero: 12,300 bytes per layer and
    moment with the default history length (bench/optimizer_state.py). An optimiser
    state built from
    `partition_for_grad_overwrite(model)[1]`, as earlier versions of these docs did, has
    the same structure.
    """
    overwrite = jtu.tree_map(lambda x: x if _is_owg(x) else None, tree, is_leaf=_is_owg)
    rest = jtu.tree_map(lambda x: _untrained(x) if _is_owg(x) else x, tree, is_leaf=_is_owg)
    return overwrite, rest


def _untrained(module):
    """The zero gradient of an FP8 module's state: its arrays as zeros, and None for what
    is not an array (the program switch `calibrating`), as `eqx.filter_grad` gives."""
    return jtu.tree_map(lambda v: jnp.zeros_like(v) if eqx.is_array(v) else None, module)


def apply_updates(model: T, updates: T, overwrite: T) -> T:
    """Applies optimiser updates to the parameters and writes the new FP8 state.

    A `jax.tree_util.tree_map`-broadcasted version of

    ```python
    if overwrite is not None:   # an FP8 module: its "gradient" is its new state
        return old_state_where_unused(model, overwrite)
    if is_fp8_module(model):    # the optimiser's update of its zero gradient
        return model
    if update is None:
        return model
    return (model + update).astype(model.dtype)
    ```

    An FP8 layer that the step did not use gets a zero "gradient"; its state is kept as it
    was instead of being overwritten with zeros. Parameters keep their dtype (a bf16
    parameter plus a float32 update stays bf16).

    A layer whose state is written leaves first-call calibration behind: its
    `calibrating` leaf becomes 0.0 (`dg.settled`), a value the next call of a step
    under `eqx.filter_jit` compiles once more for, to the program of
    `dg.program_recipe` (for `DelayedScaling`, without `calibrate_first_call`), which
    casts every tensor with the scale its history gives and never waits for the tensor's
    own amax (XLA:GPU turns the first step's small conditional into a `select` that
    would). The pytree structure stays the same, so an optimiser state built from the
    whole model stays valid. A training loop inside `lax.scan` traces that leaf if the
    model is in the carry, and then runs the first-call program on every step (right
    for a written state too, but slower on a GPU): run [`fp8ax.calibrate`][] (or one
    step) before it and keep the model's non-array leaves out of the carry
    (`eqx.partition(model, eqx.is_array)`).

    **Arguments:**

    - `model`: the model being trained.
    - `updates`: the optimiser's updates for the ordinary parameters (the second output of
      [`fp8ax.partition_for_grad_overwrite`][] after `opt.update`), or `None` to write
      the FP8 state only. What it holds for the FP8 state is ignored.
    - `overwrite`: the first output of [`fp8ax.partition_for_grad_overwrite`][]; `None`
      only for a model without FP8 layers.

    **Returns:**

    The updated model.

    **Raises:**

    `ValueError` if `overwrite` is `None` for a model with FP8 layers, or if `overwrite`
    holds values for ordinary parameters (the gradient tree was passed as `overwrite`,
    which would replace weights by their gradients).
    """

    if overwrite is None:
        fp8 = [jtu.keystr(path) for path, x in jtu.tree_leaves_with_path(model, is_leaf=_is_owg) if _is_owg(x)]
        if fp8:
            raise ValueError(
                f"`overwrite` is None, but the model has FP8 layers ({', '.join(fp8[:3])}"
                f"{', ...' if len(fp8) > 3 else ''}) whose new state it must carry. Pass the first output of "
                "`overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)` (and give `grads` to the optimiser). "
                "A model without FP8 layers can use `eqx.apply_updates`."
            )
        overwrite = jtu.tree_map(lambda _: None, model)
    else:
        record_state_write()  # the early warning for a dropped state looks for this call
    if updates is None:
        updates = jtu.tree_map(lambda _: None, model, is_leaf=_is_owg)

    def _apply(path, m, u, o):
        if _is_owg(m):
            # `u` is what the optimiser made of the state's zero gradient (zero, or weight
            # decay): the state is written by `overwrite` alone.
            if o is None:
                return m
            merge = getattr(m, "_overwritten_by", None)
            return o if merge is None else merge(o)
        if o is not None:
            raise ValueError(
                f"`overwrite` holds a value for the ordinary parameter at `{jtu.keystr(path)}`. `overwrite` must be "
                "the first output of `fp8ax.partition_for_grad_overwrite(grads)`; passing the gradients there would "
                "replace the weights by their gradients."
            )
        if u is None or m is None:
            return m
        if not eqx.is_array(m):
            return m
        with jax.numpy_dtype_promotion("standard"):
            return (m + u).astype(m.dtype)

    def is_leaf(x):
        return x is None or _is_owg(x)

    return jtu.tree_map_with_path(_apply, model, updates, overwrite, is_leaf=is_leaf)
