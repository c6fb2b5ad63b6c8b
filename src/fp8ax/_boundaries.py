# The two JAX transformation rules that would *sum* the FP8 state of a layer inside them,
# recognised while they run, so that fp8ax raises instead of returning a wrong state.
#
# Everywhere else, several uses of a layer merge by max because every fan-out of a state
# value happens in the max-accumulating dtype (see `_state.py`, `_maxgrad.py` and
# docs/how-it-works.md). Two rules of JAX fan the state out in a way no dtype can steer,
# and then sum the copies' cotangents with a JAX-internal `reduce_sum` or `psum`:
#
# - `jax.vmap` of `lax.cond` / `lax.switch` whose predicate differs per example. JAX turns
#   the conditional into a `select` of every branch, run on every example, after
#   broadcasting *every* operand, the layer's state included, to one copy per example
#   (`_cond_batching_rule`). The backward pass sums the copies' new states (for a state
#   passed as an operand, in float32, silently; for a closed-over one, JAX's `reduce_sum`
#   rejects the dtype with a TypeError that says nothing useful).
# - The transpose of `jax.shard_map(..., check_vma=False)` differentiated from outside: JAX
#   `psum`s the cotangent of every replicated input over the mesh (`_shard_map_transpose`),
#   which is right for a parameter's gradient and wrong for a state (summed in float32 for
#   a state passed as an argument, a TypeError for a closed-over one). Inside, without
#   `check_vma`, fp8ax cannot tell a sharded tensor from a replicated one either.
#
# A third rule cannot hold the state at all: un-jitted `jax.shard_map(..., check_vma=False)`
# (`_run_shmap`) stacks per-device values in a way JAX does not support for extended
# dtypes, and fails with an internal assertion. Under `jax.jit` the same shard_map works.
#
# Neither sum happens in code fp8ax runs, so neither can be steered to a max; both are
# recognised from the Python stack while JAX's rule runs (the rules are module functions
# of `jax._src`, found by name at import; the JAX range is pinned and the tests check that
# both errors are raised on every JAX the tests run on). The checks sit where fp8ax code
# runs inside those rules whatever JAX has cached: the vmap rule of the state conversions
# (`_maxgrad.py`), which JAX runs when it batches a branch that rebuilds or flattens a
# layer, and whose "refusing" twin raises only if the step is differentiated; and the
# transposes of the conversions and the custom VJP's backward pass (`_gemm.dense._bwd`) for
# `shard_map`. A check is a walk of the stack, made only in those rules (a conversion
# batched under `vmap`, a backward pass being transposed), never on a plain step.
#
# What they miss: a layer rebuilt only inside a jitted function whose batched jaxpr JAX
# cached from an earlier `vmap` that mapped the state too (an ensemble), then reused
# inside a per-example `cond`. JAX's caches give fp8ax no hook there.

import importlib.util
import sys

import jax

try:
    from jax._src import shard_map as _shard_map_module
    from jax._src.lax.control_flow import conditionals as _conditionals
except ImportError:  # pragma: no cover (a JAX that moved them: the tests of the errors fail)
    _shard_map_module = _conditionals = None


def vma(x) -> frozenset:
    """The `jax.shard_map` axes a value varies over (empty outside `shard_map`)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases call it `vma`
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", None) or ())


def lowers_for_cpu_only() -> bool:
    """Whether this process can compile for its CPU only: JAX made no backend but the CPU,
    and no plugin that compiles for another platform without its device is installed
    (JAX's CUDA or ROCm plugin, libtpu). False if JAX's registry cannot be read. Decided
    once per process, at the first call (which makes JAX's backends, as the first `jit`
    would)."""
    global _CPU_ONLY
    if _CPU_ONLY is None:
        try:
            from jax._src import xla_bridge  # (read here, as the rules above)

            platforms = {jax.default_backend(), *xla_bridge.backends()}  # (registers the plugins)
            # JAX registers these factories whatever is installed: "tpu" makes a backend
            # only with libtpu, "proxy" only for a remote it is told to reach.
            factories = set(xla_bridge._backend_factories)
            _CPU_ONLY = (
                platforms == {"cpu"}
                and factories <= {"cpu", "tpu", "proxy"}
                and importlib.util.find_spec("libtpu") is None
            )
        except Exception:  # a JAX without this registry: both branches, as before
            _CPU_ONLY = False
    return _CPU_ONLY


_CPU_ONLY: bool | None = None


def _codes(module, *names):
    """The code objects of the functions `names` of `module` that exist (JAX renames them
    between releases: jax 0.12 calls the shard_map transpose `_shard_map_transpose_fancy`)."""
    codes = (getattr(getattr(module, name, None), "__code__", None) for name in names)
    return tuple(code for code in codes if code is not None)


_COND_BATCHING = _codes(_conditionals, "_cond_batching_rule")
_SHARD_MAP_TRANSPOSE = _codes(_shard_map_module, "_shard_map_transpose", "_shard_map_transpose_fancy")
_EAGER_SHARD_MAP = _codes(_shard_map_module, "_run_shmap", "_run_shmap_lu")


def _frames():
    frame = sys._getframe(2)
    while frame is not None:
        yield frame
        frame = frame.f_back


def in_per_example_cond() -> bool:
    """Whether JAX is running the branches of a `lax.cond`/`lax.switch` under `vmap` with a
    per-example predicate (as a `select` of every branch on broadcast operands)."""
    return any(f.f_code in _COND_BATCHING and f.f_locals.get("index_dim") is not None for f in _frames())


def in_unchecked_shard_map_transpose() -> bool:
    """Whether JAX is transposing a `jax.shard_map(..., check_vma=False)`."""
    return any(f.f_code in _SHARD_MAP_TRANSPOSE and f.f_locals.get("check_vma") is False for f in _frames())


def check_eager_shard_map() -> None:
    """Raises the clear error for FP8 state inside an un-jitted `jax.shard_map(...,
    check_vma=False)`. Cheap outside `shard_map` (one read of the abstract mesh)."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return
    if any(f.f_code in _EAGER_SHARD_MAP and f.f_locals.get("check_vma") is False for f in _frames()):
        raise ValueError(EAGER_UNCHECKED_SHARD_MAP)


PER_EXAMPLE_COND = (
    "fp8ax: an FP8 layer with delayed-scaling state is differentiated inside `lax.cond` or "
    "`lax.switch` under `jax.vmap`, and the predicate differs per example. JAX then runs every "
    "branch on every example (a `select`) on one copy of the layer's state per example, and "
    "*sums* the copies' new states in the backward pass: the scales would be off by up to the "
    "batch size. fp8ax cannot merge them by max there, so it refuses. Use one predicate for the "
    "whole batch (computed outside `jax.vmap`), compute both branches and pick with `jnp.where` "
    "(both then count as uses of the layer), or a stateless recipe (`fp8ax.CurrentScaling`)."
)

UNCHECKED_SHARD_MAP = (
    "fp8ax: an FP8 layer with delayed-scaling state is differentiated through "
    "`jax.shard_map(..., check_vma=False)` from outside it. JAX sums the gradient of every "
    "replicated input over the devices, which for the FP8 state would add up the devices' new "
    "states (and without `check_vma` fp8ax cannot tell which tensors inside are sharded, so "
    "their amax would not be global). Use `check_vma=True` (JAX's default), under which fp8ax "
    "merges the devices' observations with `pmax`; or take the gradient inside the "
    "`shard_map` and reduce it with `fp8ax.pmean_gradients(grads, axis_name)`."
)

EAGER_UNCHECKED_SHARD_MAP = (
    "fp8ax: FP8 delayed-scaling state is used inside an un-jitted "
    "`jax.shard_map(..., check_vma=False)`. JAX runs such a shard_map op by op and cannot hold "
    "fp8ax's state dtype there. Wrap the call in `jax.jit` (or `eqx.filter_jit`), or use "
    "`check_vma=True` (JAX's default)."
)
