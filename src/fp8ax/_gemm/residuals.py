# The residuals the custom VJPs keep for the backward pass, in a form rematerialisation
# cannot change.
#
# When `jax.checkpoint` runs with a policy that saves residuals (`everything_saveable`,
# `save_anything_except_these_names`, `offload_dot_with_no_batch_dims`, Haliax's
# `Stacked(gradient_checkpointing="save_all")`, ...), JAX's partial evaluation of the
# remat inserts `lax.reduce_precision(r, exponent_bits=finfo.nexp,
# mantissa_bits=finfo.nmant)` after the producer of every saved floating-point residual
# `r` (jax/_src/ad_checkpoint.py, `_insert_reduce_precision`, jax 0.10 to 0.12). XLA's
# reduce-precision rounds to an IEEE-style format of those widths, with infinities, NaNs
# and no subnormals, which is the identity for float16, bfloat16, float32 and float64 but
# not for the formats FP8 training stores: for `float8_e4m3fn` (largest value 448) every
# value of 256 or more becomes NaN, and the subnormals of the E4M3 and E2M1 formats become
# zero (docs/faq.md has the JAX-only repro; tests/test_remat.py checks every dtype).
#
# So every low-precision floating-point leaf of the residuals (quantized values, E4M3 or
# E8M0 block scales) crosses the remat boundary as its bit pattern: an unsigned integer of
# the same width, which `_insert_reduce_precision` skips (it rounds inexact dtypes only).
# A bitcast of equal width moves no data; XLA removes the pair where no remat separates
# them.

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._boundaries import vma
from .._quantized import QuantizedArray

# Floating-point dtypes narrower than 16 bits, carried as the unsigned integer of their
# width: every one the rounding above changes (all but E5M2, which is carried as bits all
# the same; tests/test_remat.py checks the list against JAX's `reduce_precision`).
_BITS = {8: jnp.uint8, 4: jnp.uint4}


def bits_dtype(dtype):
    """The unsigned integer dtype a residual of `dtype` is carried as, or None if it is
    carried as it is."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    return _BITS.get(jnp.finfo(dtype).bits)


class _Bits(eqx.Module):
    """A low-precision floating-point array carried as its bit pattern."""

    bits: jax.Array
    dtype: np.dtype = eqx.field(static=True)


def protect(residuals):
    """`residuals` with each low-precision floating-point array replaced by its bits."""

    def one(x):
        if not isinstance(x, jax.Array | np.ndarray):
            return x
        to = bits_dtype(x.dtype)
        return x if to is None else _Bits(lax.bitcast_convert_type(x, to), np.dtype(x.dtype))

    return jax.tree.map(one, residuals)


def restore(residuals):
    """The inverse of `protect`."""

    def one(x):
        return lax.bitcast_convert_type(x.bits, x.dtype) if isinstance(x, _Bits) else x

    return jax.tree.map(one, residuals, is_leaf=lambda x: isinstance(x, _Bits))


# Small float32 residuals in one vector.
#
# Inside `lax.scan` (`haliax.nn.Stacked`, Levanter's layers) every residual a custom VJP
# keeps becomes a stacked output of the forward loop, and XLA writes each one with a
# `dynamic-update-slice` kernel of its own per iteration. A layer with delayed scaling
# keeps 9 or 10 small ones (the scales its forward casts used, the new lhs and rhs
# states, the gradient's state, the scalars of its plan and the flag "calibrates"): as
# many kernels per layer per step on a GPU, for a few dozen bytes (a Stacked decoder's H100 compile:
# docs/state.md). `pack` puts every float32 or bool residual of rank 0 or 1 into one
# float32 vector per set of `jax.shard_map` axes it varies over, and `unpack` slices them
# back out in the backward pass (slices XLA fuses into their consumers); `keep` packs what
# the forward pass observed apart from what the state alone decides, two kernels per
# layer. Operands and batched states (rank 2 and above) stay as they are, with their
# layouts and shardings.


class _Packed(eqx.Module):
    """Residuals with their small float32 leaves packed into `vectors` (see `pack`)."""

    vectors: tuple
    rest: tuple  # the leaves not packed, None in the place of a packed one
    treedef: object = eqx.field(static=True)
    slots: tuple = eqx.field(static=True)  # per packed leaf: (leaf index, vector, start, shape, is bool)


def _packable(x) -> bool:
    return isinstance(x, jax.Array) and x.dtype in (np.float32, np.bool_) and x.ndim <= 1


def pack(residuals) -> _Packed:
    """`residuals` (a pytree; None and static leaves allowed) with their float32 and bool
    arrays of rank 0 and 1 in one float32 vector per set of manual axes (a bool as 0 or
    1); `unpack` inverts it exactly."""
    leaves, treedef = jax.tree.flatten(residuals)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        if _packable(x):
            groups.setdefault(vma(x), []).append(i)
    vectors, slots, rest = [], [], list(leaves)
    for g, idx in enumerate(groups.values()):
        start = 0
        for i in idx:
            slots.append((i, g, start, tuple(leaves[i].shape), leaves[i].dtype == np.bool_))
            start += leaves[i].size
            rest[i] = None
        pieces = [lax.convert_element_type(lax.reshape(leaves[i], (leaves[i].size,)), np.float32) for i in idx]
        vectors.append(pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, 0))
    return _Packed(tuple(vectors), tuple(rest), treedef, tuple(slots))


def unpack(packed: _Packed):
    """The residuals `pack` was given."""
    leaves = list(packed.rest)
    for i, g, start, shape, is_bool in packed.slots:
        piece = lax.reshape(lax.slice_in_dim(packed.vectors[g], start, start + math.prod(shape)), shape)
        leaves[i] = lax.ne(piece, np.float32(0)) if is_bool else piece
    return jax.tree.unflatten(packed.treedef, leaves)


def keep(operands: tuple, observed, planned, with_state: tuple[bool, ...]) -> tuple:
    """A custom VJP's residuals, protected and packed: `operands` (arrays or
    `QuantizedArray`s), `observed` (what the forward pass observed: new states) and
    `planned` (what a stateful recipe decides before it reads a tensor: the gradient's
    state and plan). The scale of each `QuantizedArray` operand quantized with its state
    (`with_state`) is packed with `planned`; the others stay with their operands.

    Packed apart, each vector is decided by one kind of input: nothing the state alone
    decides depends on a forward amax through a vector it shares (XLA sees through such
    slices; a data-flow check and a loop's residual do not), and under `jax.vmap` a
    per-example value (a current scale of a per-example call) never makes a shared one
    (the state's, the weight's) look per example to the rules that fold the examples
    into one GEMM (`dense._batchable_drhs`)."""
    take = tuple(isinstance(q, QuantizedArray) and w for q, w in zip(operands, with_state, strict=True))
    scales = tuple(q.scale if t else None for q, t in zip(operands, take))
    bare = tuple(eqx.tree_at(lambda q: q.scale, q, None) if t else q for q, t in zip(operands, take))
    return protect((bare, pack(observed), pack((scales, planned))))


def kept(residuals) -> tuple:
    """`(operands, observed, planned)` from the residuals `keep` made."""
    bare, observed, planned = restore(residuals)
    scales, planned = unpack(planned)
    operands = tuple(
        q if s is None else eqx.tree_at(lambda q: q.scale, q, s, is_leaf=lambda x: x is None)
        for q, s in zip(bare, scales)
    )
    return operands, unpack(observed), planned
