"""A linear-like layer and its `fp8ax.LayerKind`, written against fp8ax's public interface
only, as a user would write them: the proof that a kind of layer is a plug-in (issue 46).
Nothing in fp8ax names them.

`TransposedLinear` stores its weight as `(in, out)` (the transpose of
`equinox.nn.Linear`'s), multiplies its output by a learnt `gain`, and calls its matmul
through a `dot_general` field, so fp8ax can swap it for an `fp8ax.Fp8DotGeneral`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

import fp8ax


class TransposedLinear(eqx.Module):
    weight: jax.Array  # (..., in, out)
    gain: jax.Array  # (..., out)
    dot_general: object  # `lax.dot_general`, or the `fp8ax.Fp8DotGeneral` (with its state) once converted

    def __init__(self, in_size: int, out_size: int, *, key, dot_general=lax.dot_general):
        self.weight = jax.random.normal(key, (in_size, out_size), jnp.float32) / in_size**0.5
        self.gain = jnp.ones((out_size,), jnp.float32)
        self.dot_general = dot_general

    def __call__(self, x):
        y = self.dot_general(x, self.weight, (((x.ndim - 1,), (0,)), ((), ())))
        return y * jnp.broadcast_to(self.gain, y.shape)


class TransposedLinearKind(fp8ax.LayerKind):
    name = "TransposedLinear"

    def is_plain(self, x):
        return isinstance(x, TransposedLinear) and x.dot_general is lax.dot_general

    def is_converted(self, x):
        return isinstance(x, TransposedLinear) and isinstance(x.dot_general, fp8ax.Fp8DotGeneral)

    def is_serving(self, x):
        return isinstance(x, TransposedLinear) and isinstance(x.dot_general, fp8ax.ServingDotGeneral)

    def features(self, layer):
        return layer.weight.shape[-2], layer.weight.shape[-1]

    def convert(self, layer, config):
        return _with_dot_general(layer, config.make_dot_general(self.stacked_shape(layer)))

    def op(self, layer):
        return layer.dot_general

    def with_op(self, layer, op):
        return _with_dot_general(layer, op)

    def strip(self, layer):
        return _with_dot_general(layer, lax.dot_general)

    def to_serving(self, layer, freeze):
        # The call contracts the input with the weight's axis 0; the served layer holds
        # the stored weight and calls the serving op with it, as it called its own op.
        stored, op = freeze.dense(layer.dot_general, layer.weight, (0,))
        return _with_dot_general(eqx.tree_at(lambda m: m.weight, layer, stored), op)


def _with_dot_general(layer, dot_general):
    # (The layer has an `__init__` of its own, so `dataclasses.replace` would not do; the
    # op is one node to `tree_at`, not its leaves.)
    is_op = lambda x: isinstance(x, fp8ax.Fp8DotGeneral | fp8ax.ServingDotGeneral)  # noqa: E731
    return eqx.tree_at(lambda m: m.dot_general, layer, dot_general, is_leaf=is_op)


KIND = fp8ax.register_layer_kind(TransposedLinearKind())
