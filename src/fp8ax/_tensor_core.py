"""Emulation of a tensor core's FP8 GEMM accumulation on any backend.

An FP8 tensor core does not add products in IEEE float32. Per step it takes a group of
products and the running partial sum, aligns them all to the largest exponent among
them, drops the bits below a fixed number of fraction bits of that exponent (round
toward zero), and adds what is left exactly; the partial sum it keeps has that many
fraction bits too. Hopper's FP8 path keeps about 14 significant bits (DeepSeek-V3, §3.3:
"limited to retaining around 14 bits"; measurements of H100s find an e8m13
accumulator). Kernels that need float32 accuracy "promote": every N elements of the
contraction they add the tensor core's partial sum into a float32 register on the CUDA
cores and start the next partial sum from zero (DeepSeek-V3 uses N = 128).

`EmulatedAccumulation` describes such an accumulator; `emulated_dot_general` computes a
GEMM as it would. Every step is exact in float32, so the result does not depend on the
order XLA adds things in:

- the products of two values with at most 12 significant bits each (FP8, FP6, FP4 and
  MX values) are exact in float32;
- truncation to a multiple of a power of two clears mantissa bits (bit operations);
- a step's sum has at most `products_per_add + 1` terms, each a multiple of the step's
  lowest kept bit and below `2 ** (mantissa_bits + 1)` of it, so with
  `(products_per_add + 1) * 2 ** (mantissa_bits + 1) <= 2 ** 24` (checked when the
  setting is built) the float32 sum is exact;
- only the promotions are float32 additions (round to nearest), in the contraction's
  order, as the CUDA cores do them.

Values below float32's normal range count as zero (XLA:CPU flushes them anyway); the
products of FP8 values are at least `2 ** -32`, far above it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array


def _positive_int(value, argname: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"`{argname}` must be an int >= 1, got {value!r}.")
    return int(value)


class EmulatedAccumulation(eqx.Module):
    """An FP8 GEMM's accumulation as a tensor core does it, for
    [`fp8ax.GemmSettings`][]'s `accumulation` argument: limited-precision partial sums,
    promoted to float32 every `promote_every` elements of the contraction.

    With it, every GEMM of the layer whose two operands are quantized to a floating-point
    format (forward and both backward GEMMs) computes what the hardware's accumulator
    would, on any backend: a CPU run shows the error the GPU kernel makes. It is an
    analysis tool and slow (it materialises every product). GEMMs with an operand in high
    precision and int8 GEMMs (exact in int32) are computed as without it.

    Immutable; checked when built.
    """

    mantissa_bits: int = eqx.field(static=True)
    products_per_add: int = eqx.field(static=True)
    promote_every: int | None = eqx.field(static=True)

    def __init__(self, mantissa_bits: int = 13, products_per_add: int = 32, promote_every: int | None = None):
        """**Arguments:**

        - `mantissa_bits`: fraction bits the accumulator keeps (its significand is one
          more). The default, 13, is the e8m13 accumulator measured on Hopper's FP8
          tensor cores, DeepSeek-V3's "around 14 bits". At most 22.
        - `products_per_add`: how many products are aligned and added to the partial sum
          in one step (the width of the tensor core's adder tree). With the defaults the
          emulation equals an H100's cuBLASLt FP8 GEMM with fast accumulation bit for bit
          on 99.99% of the outputs of a (1024, 4096) x (4096, 1024) product of
          same-signed values (docs/recipes.md); with 16, on 10%.
        - `promote_every`: the promotion interval, in elements of the contraction: every
          so many, the partial sum is added to a float32 accumulator and restarts from
          zero. A positive multiple of `products_per_add`, or `None` (default): never,
          the whole contraction stays in the tensor core (what a kernel with FP8 "fast
          accumulation" does). DeepSeek-V3 promotes every 128.

        **Raises:**

        `ValueError` for a value out of range, or a `products_per_add` too large for
        `mantissa_bits` (a step's sum must stay exact in float32).
        """
        mantissa_bits = _positive_int(mantissa_bits, "mantissa_bits")
        products_per_add = _positive_int(products_per_add, "products_per_add")
        if mantissa_bits > 22:
            raise ValueError(f"`mantissa_bits` must be at most 22 (float32 keeps 23), got {mantissa_bits}.")
        if (products_per_add + 1) * 2 ** (mantissa_bits + 1) > 2**24:
            most = 2 ** (23 - mantissa_bits) - 1
            raise ValueError(
                f"`products_per_add` must be at most {most} with `mantissa_bits={mantissa_bits}`, got "
                f"{products_per_add}: a step's sum must stay exact in float32."
            )
        if promote_every is not None:
            promote_every = _positive_int(promote_every, "promote_every")
            if promote_every % products_per_add:
                raise ValueError(
                    f"`promote_every` must be a multiple of `products_per_add` ({products_per_add}), got "
                    f"{promote_every}."
                )
        self.mantissa_bits = mantissa_bits
        self.products_per_add = products_per_add
        self.promote_every = promote_every


_NO_EXPONENT = -(2**20)  # the "exponent" of zero (and of flushed subnormals)


def _exponent(x: Array) -> Array:
    """`floor(log2(|x|))` of float32 `x` from its bits; `_NO_EXPONENT` for zero and
    subnormals."""
    field = (lax.bitcast_convert_type(x, jnp.int32) >> 23) & 0xFF
    return jnp.where(field == 0, _NO_EXPONENT, field - 127)


def _truncate(x: Array, lowest: Array) -> Array:
    """`x` rounded toward zero to a multiple of `2 ** lowest` (bit operations, exact)."""
    e = _exponent(x)
    cleared = jnp.clip(23 - (e - lowest), 0, 23).astype(jnp.uint32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    kept = bits & ~((jnp.uint32(1) << cleared) - jnp.uint32(1))
    out = lax.bitcast_convert_type(kept, jnp.float32)
    return jnp.where(e < lowest, jnp.zeros_like(x), out)


def _step(acc: Array, terms: Array, mantissa_bits: int) -> Array:
    """One adder step: `acc` (M, N) plus the products `terms` (M, g, N), aligned to
    their largest exponent with `mantissa_bits` fraction bits, added exactly, and the
    sum kept with `mantissa_bits` fraction bits."""
    top = jnp.maximum(_exponent(acc), jnp.max(_exponent(terms), axis=-2))
    lowest = top - mantissa_bits
    total = _truncate(acc, lowest) + jnp.sum(_truncate(terms, lowest[..., None, :]), axis=-2)  # exact
    return _truncate(total, _exponent(total) - mantissa_bits)


def _accumulate(a: Array, b: Array, setting: EmulatedAccumulation) -> Array:
    """`a @ b` for float32 `a` (M, K) and `b` (K, N) with the emulated accumulator."""
    g = setting.products_per_add
    k = a.shape[1]
    per_promotion = setting.promote_every or -(-k // g) * g
    k_padded = -(-k // per_promotion) * per_promotion
    if k_padded != k:  # zero products change no sum and no step's largest exponent
        a = jnp.pad(a, ((0, 0), (0, k_padded - k)))
        b = jnp.pad(b, ((0, k_padded - k), (0, 0)))
    m, n = a.shape[0], b.shape[1]
    promotions, groups = k_padded // per_promotion, per_promotion // g
    # (promotion, group, M, g) and (promotion, group, g, N)
    a = jnp.transpose(a.reshape(m, promotions, groups, g), (1, 2, 0, 3))
    b = b.reshape(promotions, groups, g, n)

    def add_group(acc, ab):
        ag, bg = ab
        return _step(acc, ag[:, :, None] * bg[None, :, :], setting.mantissa_bits), None

    def promote(total, ab):
        partial, _ = lax.scan(add_group, jnp.zeros((m, n), jnp.float32), ab)
        return total + partial, None

    total, _ = lax.scan(promote, jnp.zeros((m, n), jnp.float32), (a, b))
    return total


def emulated_dot_general(a: Array, b: Array, dimension_numbers, setting: EmulatedAccumulation) -> Array:
    """`lax.dot_general(a, b, dimension_numbers)` in float32, accumulated as `setting`
    describes. `a` and `b` hold values with at most 12 significant bits (FP8, FP6 or FP4
    values, possibly times powers of two); the output is laid out as `dot_general`'s."""
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
    a_free = [d for d in range(a.ndim) if d not in lc and d not in lb]
    b_free = [d for d in range(b.ndim) if d not in rc and d not in rb]
    batch_shape = tuple(a.shape[d] for d in lb)
    a_free_shape = tuple(a.shape[d] for d in a_free)
    b_free_shape = tuple(b.shape[d] for d in b_free)
    k = int(np.prod([a.shape[d] for d in lc], dtype=np.int64))
    nb = int(np.prod(batch_shape, dtype=np.int64))
    a2 = jnp.transpose(a.astype(jnp.float32), lb + tuple(a_free) + lc).reshape(nb, -1, k)
    b2 = jnp.transpose(b.astype(jnp.float32), rb + rc + tuple(b_free)).reshape(nb, k, -1)
    out = jax.vmap(lambda x, y: _accumulate(x, y, setting))(a2, b2)
    return out.reshape(batch_shape + a_free_shape + b_free_shape)
