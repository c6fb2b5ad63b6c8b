# The forward and backward passes of the custom VJPs (dense and grouped), each traced once
# per signature.
#
# A model calls the same layer shape many times (16 unrolled blocks of three linears; a
# decoder's layers unrolled by a user, or by Levanter's `Stacked(unroll=...)`), and JAX
# traces a custom VJP's `fwd` at every call, and under Haliax's `hax.dot` (which runs the
# `dot_general` inside a `jit` of its own) twice: once for the primal of the inner `jit`,
# once when that `jit` is linearised. Delayed scaling's pass is a few hundred JAX
# primitives (the state's checks and its next value, per operand), so tracing and lowering
# grew with depth at about four times the rate of Haliax's FP8 (bench/state_cost.py).
#
# Each pass is therefore a `jax.jit` of the pass, with the call's static part (`Call`,
# `RaggedCall`: hashable) as a static argument. JAX caches the traced pass on the function,
# the static argument and the argument types, so every later call of the same signature
# costs one `pjit` equation, and the lowering emits the pass once as a function that each
# call site calls. XLA inlines those calls before it optimizes (the kernels of a step are
# the same: tests/test_remat.py, bench/state_cost.py), and JAX's transformations of a `pjit`
# (`vmap`, `checkpoint` with any policy, `shard_map`, linearisation) apply to its body as
# they would to the inlined equations.
#
# What a pass reads besides its arguments is part of the key: JAX's own context (meshes,
# `shard_map` axes, config) is in `jax.jit`'s, and Haliax's axis mapping, which lays out the
# FP8 weight for its all-gather (`GemmSettings.fp8_all_gather_axes`), is added (`_context`).
# jax 0.10's key holds the abstract mesh as set: none for the primal of `hax.dot`'s `jit`,
# an empty one when that `jit` is linearised. The two mean the same (no mesh), but the
# second trace missed the cache, and each layer shape traced its forward pass twice (on
# bench/state_cost.py's MLP block, a third of the step's trace: 0.098 s against 0.064).
# Where there is no mesh, a pass therefore runs with the empty mesh set.
#
# What stays outside: the state's representation. A state arrives in the forward pass in
# the max-accumulating dtype where the layer is differentiated (an extended dtype,
# `_maxgrad.MAXF32`), and leaves the backward pass in it; the passes see and return float32
# (an extended dtype cannot cross a `jit` boundary as a plain array). Python checks that
# read the caller's frames (`_boundaries.in_unchecked_shard_map_transpose`) run before the
# cached pass, on every call.

import jax

from .. import _haliax
from .._maxgrad import as_f32, raw_to_max


def once_per_signature(name: str):
    """Decorator: `pass_fn(call, *args)` (`call`: a `Call` or a `RaggedCall`), traced once
    per call, argument types and context. `name` names the `jit` in JAX's op names (the
    layer's named scope stays outside a shared function: `fp8ax.gemm_report` finds a
    layer's GEMMs by this name)."""

    def wrap(pass_fn):
        def run_pass(call, context, *args):
            return pass_fn(call, *args)

        run_pass.__name__ = run_pass.__qualname__ = name
        traced = jax.jit(run_pass, static_argnums=(0, 1))

        def run(call, *args):
            mesh = jax.sharding.get_abstract_mesh()
            if not mesh.empty:
                return traced(call, _context(call), *args)
            # No mesh: one context whether none is set or an empty one is (see above).
            with jax.sharding.use_abstract_mesh(mesh):
                return traced(call, _context(call), *args)

        return run

    return wrap


def _context(call):
    """What a pass reads from outside JAX (see above): Haliax's axis mapping, where the
    pass lays out a weight by it, as a hashable tuple."""
    settings = call.call.settings if hasattr(call, "call") else call.settings
    if settings.fp8_all_gather_axes is None:
        return None
    mapping = _haliax.current_axis_mapping()
    if mapping is None:
        return None
    return tuple(sorted((name, v if isinstance(v, str) or v is None else tuple(v)) for name, v in mapping.items()))


def state_in(raw) -> tuple:
    """The raw state arrays a custom VJP receives, as float32 (see above)."""
    return tuple(as_f32(v) for v in raw)


def state_out(new, state_is_max) -> tuple:
    """The new state arrays (float32) a backward pass returns as cotangents, each in the
    max-accumulating dtype where the state arrived in it."""
    return tuple(raw_to_max(v) if m else v for v, m in zip(new, state_is_max, strict=True))
