from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import equinox as eqx
import jax.tree_util as jtu

from ._model import Fp8DotGeneral
from ._update import apply_updates, check_state, partition_for_grad_overwrite

T = TypeVar("T")


def _is_dg(x: Any) -> bool:
    return isinstance(x, Fp8DotGeneral)


def calibrate(model: T, loss_fn: Callable[..., Any], batches: Iterable[Any]) -> T:
    """Fills the delayed-scaling histories of a converted model from a few batches,
    without changing any weight.

    For each batch it runs `eqx.filter_grad(loss_fn)(model, *batch)` under
    `eqx.filter_jit` and writes the new FP8 state only (as
    [`fp8ax.apply_updates`][]`(model, None, overwrite)`); the parameter gradients are
    discarded. Run before training, it gives the first training step delayed scales
    from real amaxes (a fresh layer's first step otherwise uses scale 1, with the
    default `DelayedScaling(calibrate_first_call=False)`), in a program of its own, so
    the training step carries no cost of it; it also serves post-training quantization
    ([`fp8ax.to_serving`][] needs filled histories). Layers the batches did not reach
    keep their state.

    **Arguments:**

    - `model`: a model converted by [`fp8ax.fp8_linear_layers`][].
    - `loss_fn`: `loss_fn(model, *batch) -> scalar`, e.g. the training loss. Only its
      gradient's FP8 part is used (the output-gradient histories record its gradients).
    - `batches`: an iterable of batches; each is a tuple of arguments for `loss_fn`
      after the model, or one argument.

    **Returns:**

    The model with filled FP8 state; every weight is the same array as before.

    **Raises:**

    `ValueError` if `batches` is empty or `model` has no FP8 layer with state.

    !!! Example

        ```python
        model = fp8ax.fp8_linear_layers(model)
        model = fp8ax.calibrate(model, loss_fn, [(x1, y1), (x2, y2)])
        opt = fp8ax.skip_fp8_state(optax.adam(1e-3))
        opt_state = opt.init(eqx.filter(model, eqx.is_array))
        ```
    """
    if not callable(loss_fn):
        raise TypeError(
            f"`loss_fn` must be a callable `loss_fn(model, *batch) -> scalar`, got {type(loss_fn).__name__}."
        )
    stateful = [dg for dg in jtu.tree_leaves(model, is_leaf=_is_dg) if _is_dg(dg) and dg.state is not None]
    if not stateful:
        raise ValueError(
            "`model` has no FP8 layer with state to calibrate: convert it with `fp8ax.fp8_linear_layers` and a "
            "stateful recipe (`fp8ax.DelayedScaling`, the default) first."
        )

    check_state(model)  # refuses a state that went through an optimizer
    grad_fn = eqx.filter_jit(eqx.filter_grad(loss_fn))
    n = 0
    for batch in batches:
        grads = grad_fn(model, *(batch if isinstance(batch, tuple) else (batch,)))
        overwrite, _ = partition_for_grad_overwrite(grads)
        model = apply_updates(model, None, overwrite)  # eager: the weights stay the same arrays
        n += 1
    if n == 0:
        raise ValueError("`batches` is empty: give at least one batch to calibrate on.")
    return model
