import warnings
from typing import TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
import optax

from ._state import AbstractState, is_owg

T = TypeVar("T")


class OptimizerStateWarning(UserWarning):
    """The optimizer keeps state for the FP8 state: it was built from the whole model
    without [`fp8ax.skip_fp8_state`][], so it keeps moments for the FP8 state (Adam,
    momentum, ...) and updates them every step, for nothing. Raised once per process,
    while [`fp8ax.apply_updates`][] is traced (or first called). A stateless update
    written by hand (`jax.tree.map(lambda g: -lr * g, grads)`) does not raise it."""


_WARNED_OPTIMIZER: list[bool] = []  # (once per process)


class StateNotWrittenWarning(UserWarning):
    """A training step gave [`fp8ax.skip_fp8_state`][]'s optimizer the gradients with the
    FP8 layers' new state still in them: nothing split it off
    ([`fp8ax.partition_for_grad_overwrite`][]), so nothing writes it back
    ([`fp8ax.apply_updates`][]), and every step then casts with the state the model
    started with (a fresh model's: scale 1, which clips activations above 448 and flushes
    small gradients to zero). Raised once per process, while the optimizer's `update` is
    traced (or first called)."""


_WARNED_UNWRITTEN: list[bool] = []  # (once per process)


def _warn_unwritten(updates) -> None:
    """Warns (`StateNotWrittenWarning`) if `updates` holds an FP8 module's new state:
    JAX arrays, where `partition_for_grad_overwrite` leaves NumPy zeros and Haliax's
    partition leaves None."""
    if _WARNED_UNWRITTEN:
        return
    held = [
        jtu.keystr(path)
        for path, m in jtu.tree_leaves_with_path(updates, is_leaf=is_owg)
        if is_owg(m) and any(isinstance(v, jax.Array) for v in jtu.tree_leaves(m))
    ]
    if not held:
        return
    _WARNED_UNWRITTEN.append(True)
    warnings.warn(
        f"fp8ax: the gradients given to the optimizer hold the new FP8 state of {len(held)} "
        f"layer{'s' if len(held) != 1 else ''} "
        f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): nothing split it off, so nothing writes it "
        "back, and every step casts with the state the model started with (a fresh model's: scale 1, which "
        "clips activations above 448 and flushes small gradients to zero). Split it off before the optimizer "
        "and write it with the updates: `overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)`, "
        "`opt.update(grads, ...)`, `model = fp8ax.apply_updates(model, updates, overwrite)`. "
        "(Raised once per process.)",
        StateNotWrittenWarning,
        stacklevel=3,
    )


def _warn_optimizer(arrays: list) -> None:
    """`arrays`: the optimizer's updates of FP8 state seen by one `apply_updates`."""
    if _WARNED_OPTIMIZER or not arrays:
        return
    _WARNED_OPTIMIZER.append(True)
    size = sum(int(np.size(v)) * 4 for v in arrays)
    warnings.warn(
        f"fp8ax: the optimizer keeps state for the FP8 state ({len(arrays)} arrays, {size:,} bytes each time): it "
        "was built from the whole model (`opt.init(eqx.filter(model, eqx.is_array))`), so it keeps moments for "
        "the state's zero gradients (Adam: two copies) and updates them every step, about two small kernels per "
        "state array, for updates `fp8ax.apply_updates` ignores: a cost GPUs feel most in small and medium "
        "layers. Build it with `opt = fp8ax.skip_fp8_state(optax.adam(...))`: the same `init` and `update` "
        "calls, no moments and no kernels for the state. (Raised once per process.)",
        OptimizerStateWarning,
        stacklevel=3,
    )


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
    gradient is zero. Give `rest` to the optimizer and `overwrite` to
    [`fp8ax.apply_updates`][], which ignores whatever the optimizer makes of those zeros.

    `rest` has the structure of the model's arrays (`eqx.filter(model, eqx.is_array)`),
    so an optimizer state built from the whole model, as Equinox's examples build it,
    matches it on every step. Wrap the optimizer in [`fp8ax.skip_fp8_state`][], so that
    it keeps no moments for the FP8 state and spends no kernels on those zeros:

    !!! Example

        ```python
        opt = fp8ax.skip_fp8_state(optax.adam(1e-3))
        opt_state = opt.init(eqx.filter(model, eqx.is_array))

        grads = eqx.filter_grad(loss_fn)(model, batch)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        model = fp8ax.apply_updates(model, updates, overwrite)
        ```

    Without the wrapper, the optimizer keeps moments for the FP8 state, all zero, and
    updates them every step; [`fp8ax.apply_updates`][] then warns once
    ([`fp8ax.OptimizerStateWarning`][]). Given gradients that still hold the new FP8
    state (nothing split it off, so nothing will write it), the wrapper's `update`
    warns once ([`fp8ax.StateNotWrittenWarning`][]).
    """
    overwrite = jtu.tree_map(lambda x: x if is_owg(x) else None, tree, is_leaf=is_owg)
    rest = jtu.tree_map(lambda x: _untrained(x) if is_owg(x) else x, tree, is_leaf=is_owg)
    return overwrite, rest


def _untrained(module):
    """The zero gradient of an FP8 module's state: its arrays as zeros (and None for
    anything that is not an array, as `eqx.filter_grad` gives). NumPy zeros, constants
    of the program: what a stateless update makes of them (`-lr * g`) stays NumPy, while
    an optimizer that keeps moments for the state gives JAX arrays, which is how
    `apply_updates` tells the two apart (`OptimizerStateWarning`)."""

    def zeros(v):
        if isinstance(v, AbstractState):
            # Built from the state's own values: flattening it inside a trace would make a
            # float32 view of each, for nothing (see `_state._view`).
            return v._with_values(tuple(np.zeros(np.shape(x), np.float32) for x in v._raw()))
        return np.zeros(np.shape(v), v.dtype) if eqx.is_array(v) else None

    return jtu.tree_map(zeros, module, is_leaf=lambda v: isinstance(v, AbstractState))


def apply_updates(model: T, updates: T | None, overwrite: T | None) -> T:
    """Applies optimizer updates to the parameters and writes the new FP8 state.

    A `jax.tree_util.tree_map`-broadcasted version of

    ```python
    if overwrite is not None:   # an FP8 module: its "gradient" is its new state
        return old_state_where_unused(model, overwrite)
    if is_fp8_module(model):    # the optimizer's update of its zero gradient
        return model
    if update is None:
        return model
    return (model + update).astype(model.dtype)
    ```

    An FP8 layer that the step did not use gets a zero "gradient"; its state is kept as it
    was instead of being overwritten with zeros. Parameters keep their dtype (a bf16
    parameter plus a float32 update stays bf16).

    Every step, the first included, runs the same program (see
    [`fp8ax.DelayedScaling`][]'s `calibrate_first_call`): writing the state changes
    array values only, never the pytree's structure or the type of a leaf, so a jitted
    step compiles once, a training loop can run inside `lax.scan` with the model in the
    carry, and an optimizer state built from the whole model stays valid.

    **Arguments:**

    - `model`: the model being trained.
    - `updates`: the optimizer's updates for the ordinary parameters (the second output of
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
        fp8 = [jtu.keystr(path) for path, x in jtu.tree_leaves_with_path(model, is_leaf=is_owg) if is_owg(x)]
        if fp8:
            raise ValueError(
                f"`overwrite` is None, but the model has FP8 layers ({', '.join(fp8[:3])}"
                f"{', ...' if len(fp8) > 3 else ''}) whose new state it must carry. Pass the first output of "
                "`overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)` (and give `grads` to the optimizer). "
                "A model without FP8 layers can use `eqx.apply_updates`."
            )
        overwrite = jtu.tree_map(lambda _: None, model)
    if updates is None:
        updates = jtu.tree_map(lambda _: None, model, is_leaf=is_owg)

    def _apply(path, m, u, o):
        if is_owg(m):
            # `u` is what the optimizer made of the state's zero gradient (zero, or weight
            # decay): the state is written by `overwrite` alone.
            if u is not None:
                # JAX arrays where `partition_for_grad_overwrite` put NumPy zeros: an
                # optimizer computed them from its own state (see `_untrained`).
                optimized.extend(v for v in jtu.tree_leaves(u) if isinstance(v, jax.Array))
            if o is None:
                return m
            # (Through the class: an Equinox module's bound method flattens the module.)
            merge = getattr(type(m), "_overwritten_by", None)
            return o if merge is None else merge(m, o)
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
        return x is None or is_owg(x)

    optimized: list = []
    out = jtu.tree_map_with_path(_apply, model, updates, overwrite, is_leaf=is_leaf)
    _warn_optimizer(optimized)
    return out


def check_state(model, *, written: bool = False) -> None:
    """Checks the FP8 state of a converted model, reading its values (call it outside
    `jax.jit`: at a checkpoint, a log step, or after the first steps of a run).

    A training step cannot raise on the device without a host callback, which would keep
    JAX's persistent compilation cache from storing the step; so a step that meets a
    corrupt state calibrates on it (the training stays right, scaled as current scaling
    would), and this function is where the mistake is reported. fp8ax also raises the
    same error in an eager call of a layer, [`fp8ax.calibrate`][], [`fp8ax.to_serving`][]
    and [`fp8ax.scaling_stats`][] (all of which read the state's values).

    **Arguments:**

    - `model`: a model converted by [`fp8ax.fp8_linear_layers`][] (or any pytree holding
      [`fp8ax.Fp8DotGeneral`][] modules).
    - `written`: also require every state to have observed something: after a few
      training steps, a layer whose history is still empty was never run, or its new
      state was dropped (`eqx.apply_updates` instead of [`fp8ax.apply_updates`][] after
      [`fp8ax.partition_for_grad_overwrite`][]). (Keyword only argument.)

    **Raises:**

    `ValueError`, naming the layers and the cause, if a state holds values no fp8ax
    update writes (negative, NaN or inf: it went through an optimizer), or with
    `written=True` if a state is empty. `TypeError` if `model` holds no FP8 layer with
    state.

    !!! Example

        ```python
        for i in range(steps):
            model, opt_state = step(model, opt_state, x, y)
            if i == 2:
                fp8ax.check_state(model, written=True)
        ```
    """
    from ._model import Fp8DotGeneral
    from ._state import CORRUPT_STATE

    if not isinstance(written, bool):
        raise TypeError(f"`written` must be a bool, got {written!r}.")
    layers = [
        (jtu.keystr(path), m)
        for path, m in jtu.tree_leaves_with_path(model, is_leaf=lambda x: isinstance(x, Fp8DotGeneral))
        if isinstance(m, Fp8DotGeneral) and m.state is not None
    ]
    if not layers:
        raise TypeError(
            "`model` holds no FP8 layer with state: convert it with `fp8ax.fp8_linear_layers` (with a stateful recipe, "
            "`fp8ax.DelayedScaling`, the default) first."
        )
    corrupt, empty = [], []
    for path, m in layers:
        for role, problem in m._state_problems():
            (corrupt if problem == "corrupt" else empty).append(f"model{path}.{role}")
    if corrupt:
        raise ValueError(f"FP8 state {_listed(corrupt)}: {CORRUPT_STATE}")
    if written and empty:
        raise ValueError(
            f"FP8 state {_listed(empty)} has observed nothing: its amax history is empty. Either the layer never ran "
            "in the steps so far, or the training step dropped its new state. A layer the training step never "
            "calls (fp8ax warns with `fp8ax.UnusedLayerWarning` when it traces such a step) trains its weight, if "
            "at all, in high precision: Levanter's language models, for one, take `lm_head`'s weight into their "
            "own loss and never call the layer; leave such a layer out of the conversion "
            '(`fp8ax.Fp8Config(targets=lambda path, layer: path != "lm_head")`). A dropped state: '
            "`eqx.apply_updates(model, updates)` after `fp8ax.partition_for_grad_overwrite` leaves the state as it "
            "was; write it with `model = fp8ax.apply_updates(model, updates, overwrite)`. (A step on an empty state "
            "calibrates on the tensor's own amax, so the training itself is right, but it never uses delayed "
            "scaling.)"
        )


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def skip_fp8_state(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer`, keeping no state for the FP8 state of a converted model.

    An optimizer built from the whole model (`opt.init(eqx.filter(model, eqx.is_array))`)
    keeps moments for every FP8 state array, all zero, and updates them on every step:
    with Adam two elementwise kernels per state array (one per FP8 layer),
    each too small to keep a GPU busy (on an H200 the decoder layer of docs/gpu.md spent
    about 3.5 ms more per step idle than Haliax's FP8, whose optimizer never sees the
    state). The wrapped optimizer takes the same arguments and returns updates of the same
    structure, but hands `optimizer` only the ordinary parameters: the FP8 modules get no
    moments, and `None` as their update (which [`fp8ax.apply_updates`][] ignores, as it
    ignores any update of the FP8 state).

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation` (Adam, a chain, `optax.MultiSteps`'s
      `gradient_transformation()`, ...).

    **Returns:**

    An `optax.GradientTransformation`. Its `init` takes the model or its arrays, as
    `optimizer.init` would; its `update` takes the gradients from
    [`fp8ax.partition_for_grad_overwrite`][] (and `params`, if `optimizer` needs them).

    !!! Example

        ```python
        opt = fp8ax.skip_fp8_state(optax.adamw(1e-3))
        opt_state = opt.init(eqx.filter(model, eqx.is_array))
        ...
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        model = fp8ax.apply_updates(model, updates, overwrite)
        ```
    """
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"`optimizer` must be an `optax.GradientTransformation` (with `init` and `update`), got "
            f"{type(optimizer).__name__}."
        )

    def parameters(tree):
        # The tree with None in place of each FP8 module (and of anything not an array);
        # None stays None (a pytree without leaves).
        return eqx.filter(jtu.tree_map(lambda x: None if is_owg(x) else x, tree, is_leaf=is_owg), eqx.is_array)

    def init_fn(params):
        return optimizer.init(parameters(params))

    def update_fn(updates, state, params=None, **extra):
        _warn_unwritten(updates)
        return optimizer.update(parameters(updates), state, parameters(params), **extra)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
