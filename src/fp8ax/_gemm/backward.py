# The backward pass both custom VJPs share (the dense `dot_general` and the grouped ragged
# dot): the output gradient's rounding keys; the gradient quantized once for both GEMMs
# where its recipe allows (a tensor-wise, round-to-nearest recipe, whose stateful kind then
# observes it once); the input gradient and the weight gradient, each computed by the
# path's own GEMMs; both reduced over the `jax.shard_map` axes their operand does not vary
# over; and the three new states.

from collections.abc import Callable
from typing import Any, cast

import jax.numpy as jnp
from jax import lax

from .call import Call, grad_once, gradient_keys, stacked_by_role
from .kernels import fp8_pair
from .operands import reduce_to

# `gradient(g, shared_g, key)`: one backward GEMM's result, given the output gradient,
# the gradient quantized once for both GEMMs (None where it is not), and the key that
# rounds the gradient where this GEMM quantizes it itself.
Gradient = Callable[[Any, Any, Any], Any]


def backward_precision(precision, qa, qb):
    """A backward GEMM's precision. On two FP8 operands the default is `HIGHEST`: XLA:GPU
    then accumulates in full precision, not with cuBLASLt's fast FP8 accumulation, which
    loses accuracy over the long contractions of the weight gradient (TransformerEngine,
    torchao and DeepSeek-V3 make the same choice). Any other precision is kept."""
    if precision in (None, lax.Precision.DEFAULT) and fp8_pair(qa, qb):
        return lax.Precision.HIGHEST
    return precision


def three_gemm_backward(
    call: Call, g, new_operand_states: tuple, quantize_grad_once: Callable, dlhs: Gradient, drhs: Gradient
) -> tuple:
    """`(dlhs, drhs)`, and with state the new lhs, rhs and grad states' arrays (float32:
    one state's, with a role axis, or three states' one after the other; see
    `stacked_by_role`). `quantize_grad_once(g)` gives the gradient quantized for both
    GEMMs and its new state; `new_operand_states` the forward's new lhs and rhs states."""
    keys = gradient_keys(call.settings.operand_recipe("grad"), g)
    shared_g, new_g = quantize_grad_once(g) if grad_once(call) else (None, None)
    # Inside `jax.shard_map` the cotangent of an operand that does not vary over a manual
    # axis (a replicated weight) is summed over it, as JAX's own `dot_general` does.
    d_lhs = reduce_to(dlhs(g, shared_g, keys[0]), call.lhs_vma, lax.psum)
    d_rhs = reduce_to(drhs(g, shared_g, keys[1]), call.rhs_vma, lax.psum)
    if not call.state_is_max:
        return d_lhs, d_rhs
    # With state, each operand was quantized with its state (the gradient once, shared by
    # both GEMMs), so all three new states are set.
    new_states = cast(tuple[tuple, tuple, tuple], (*new_operand_states, new_g))
    new_states = tuple(tuple(v.astype(jnp.float32) for v in state) for state in new_states)
    return (d_lhs, d_rhs, *stacked_by_role(new_states, call.state_role_axes))
