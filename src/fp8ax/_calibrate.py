import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from ._dot_general import Fp8DotGeneral
from ._update import apply_updates, partition_for_grad_overwrite

T = TypeVar("T")


def _is_dg(x: Any) -> bool:
    return isinstance(x, Fp8DotGeneral)


def calibrate(model: T, loss_fn: Callable[..., Any], batches: Iterable[Any], *, keep_first_call: bool = False) -> T:
    """Fills the delayed-scaling histories of a converted model from a few batches,
    without changing any weight.

    For each batch it runs `eqx.filter_grad(loss_fn)(model, *batch)` under
    `eqx.filter_jit` and writes the new FP8 state only (as
    [`fp8ax.apply_updates`][]`(model, None, overwrite)`); the parameter gradients are
    discarded. Writing the state switches every layer the batches reached to its settled
    program (`dg.settled`; for `DelayedScaling`, without `calibrate_first_call`), as the
    first training step would (see [`fp8ax.apply_updates`][]), so the training step
    compiles once, straight to
    the program of delayed scaling: each tensor is cast with the scale its history
    gives, with no conditional and nothing that waits on the tensor's amax (see the
    "How it works" page). Layers the batches did not reach keep their settings.

    The switch changes each layer's `calibrating` leaf (a Python float), so a jitted step
    compiles once more; the pytree structure stays the same, and an optimiser state
    built from the model before or after calibrating works either way.

    **Arguments:**

    - `model`: a model converted by [`fp8ax.fp8_linear_layers`][].
    - `loss_fn`: `loss_fn(model, *batch) -> scalar`, e.g. the training loss. Only its
      gradient's FP8 part is used (the output-gradient histories record its gradients).
    - `batches`: an iterable of batches; each is a tuple of arguments for `loss_fn`
      after the model, or one argument.
    - `keep_first_call`: keep every layer's program as it was (its `calibrating` leaf;
      only fill the histories). (Keyword only argument.)

    **Returns:**

    The model with filled FP8 state; every weight is the same array as before.

    **Raises:**

    `ValueError` if `batches` is empty or `model` has no FP8 layer with state.

    !!! Example

        ```python
        model = fp8ax.fp8_linear_layers(model)
        model = fp8ax.calibrate(model, loss_fn, [(x1, y1), (x2, y2)])
        opt_state = opt.init(eqx.filter(model, eqx.is_array))
        ```
    """
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a callable `loss_fn(model, *batch) -> scalar`, got {type(loss_fn).__name__}."
        )
    if not isinstance(keep_first_call, bool):
        raise TypeError(f"`keep_first_call` must be a bool, got {keep_first_call!r}.")
    stateful = [dg for dg in jtu.tree_leaves(model, is_leaf=_is_dg) if _is_dg(dg) and dg.lhs is not None]
    if not stateful:
        raise ValueError(
            "`model` has no FP8 layer with state to calibrate: convert it with `fp8ax.fp8_linear_layers` and a "
            "stateful recipe (`fp8ax.DelayedScaling`, the default) first."
        )

    grad_fn = eqx.filter_jit(eqx.filter_grad(loss_fn))
    original = model
    n = 0
    for batch in batches:
        grads = grad_fn(model, *(batch if isinstance(batch, tuple) else (batch,)))
        overwrite, _ = partition_for_grad_overwrite(grads)
        model = apply_updates(model, None, overwrite)  # eager: the weights stay the same arrays
        n += 1
    if n == 0:
        raise ValueError("`batches` is empty: give at least one batch to calibrate on.")
    if not keep_first_call:
        return model  # `apply_updates` has switched every layer the batches reached

    def keep(before, after):
        if _is_dg(after) and _is_dg(before):
            return dataclasses.replace(after, calibrating=before.calibrating)
        return after

    return jtu.tree_map(keep, original, model, is_leaf=_is_dg)
