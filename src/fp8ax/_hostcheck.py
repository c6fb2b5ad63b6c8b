# A host callback that an ahead-of-time compile for another machine leaves out.
#
# The first-call branch of delayed scaling calls back to the host (`_recipes._StaleWatch`:
# the error for a state that went through an optimiser, the warning for a state that is
# never written). A host callback needs the runtime of the platform it is compiled for:
# `jax.debug.callback` lowered for a GPU on a machine without one (a "deviceless" compile,
# how teams compile for their clusters on CPU hosts) fails with "Unknown backend: 'gpu'",
# and with it the whole train step. So the check is a primitive of its own, which behaves
# as `jax.debug.callback` wherever the compiled program can run in this process and lowers
# to nothing, with a warning, where it cannot (also when lowered for another
# platform than this process runs, `jax.jit(f).trace(...).lower(lowering_platforms=...)`,
# as `jax.export` does). The compiled program then runs as it
# would with the callback, less the two host checks.
#
# Rules: the effect is JAX's debug-callback effect (allowed under `cond`, `scan`, `remat`
# and custom derivatives); the value has no outputs and no derivative; `vmap` calls back
# once with the batched arguments; under `remat` the check runs in the forward pass only.

import logging
import sys
import warnings

import jax
from jax._src import debugging as _debugging
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe


class HostCheckError(ValueError):
    """The error of a failed host check. It reaches the caller inside JAX's runtime error
    ("INTERNAL: CpuCallback error calling callback: Traceback ...", with fp8ax's message
    at its end), so its message is also written to stderr first, as the first line the
    user reads, and JAX's log of the failed callback (a second traceback) is left out."""


class _NoLogOfFailedChecks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], HostCheckError))


# `jax.debug.callback` logs every exception of a callback with its traceback.
logging.getLogger("jax._src.debugging").addFilter(_NoLogOfFailedChecks())


def _checked(fn, *args) -> None:
    try:
        fn(*args)
    except HostCheckError as e:
        sys.stderr.write(f"{e}\n")
        sys.stderr.flush()
        raise


_host_check_p = Primitive("fp8ax_host_check")
_host_check_p.multiple_results = True


def host_check(fn, *args) -> None:
    """Calls `fn(*args)` on the host whenever the traced computation runs, like
    `jax.debug.callback`; in a program compiled for a platform this process has no runtime
    for (ahead of time), nothing. `fn` must be hashable (it is a static parameter)."""
    flat, tree = jax.tree.flatten(args)
    _host_check_p.bind(*flat, fn=fn, tree=tree)


def _impl(*flat, fn, tree):
    fn(*jax.tree.unflatten(tree, flat))
    return []


def _abstract_eval(*avals, fn, tree):
    return [], {_debugging.debug_effect}


AOT_WARNING = (
    "fp8ax: this program is compiled for {platforms}, which this process cannot run (an ahead-of-time "
    "compile). Its FP8 layers' host checks (the error for a scaling state that went through an optimiser, "
    "the warning for a state that is never written) are left out of it; the computation is unchanged."
)


def _lowering(ctx, *flat, fn, tree):
    try:
        ctx.module_context.get_backend()
    except (RuntimeError, ValueError):  # no runtime for the platform here, or lowered for another one
        # Once per compile (Python shows a warning from one place once, unless told otherwise).
        warnings.warn(AOT_WARNING.format(platforms=", ".join(ctx.module_context.platforms)), stacklevel=2)
        return []

    def call(*flat):
        jax.debug.callback(lambda *a: _checked(fn, *jax.tree.unflatten(tree, a)), *flat)
        return []

    return mlir.lower_fun(call, multiple_results=True)(ctx, *flat)


def _batching(args, dims, *, fn, tree):
    return _host_check_p.bind(*args, fn=fn, tree=tree), []


def _jvp(primals, tangents, *, fn, tree):
    return _host_check_p.bind(*primals, fn=fn, tree=tree), []


def _transpose(cts, *args, fn, tree):
    return [None] * len(args)


def _partial_eval_custom(saveable, unks_in, inst_in, eqn):
    # Under `remat` (and `grad`'s partial evaluation): run where the inputs are known,
    # once, in the forward pass; stage it only if an input is not known until later.
    if any(unks_in):
        residuals = [v for v, inst in zip(eqn.invars, inst_in) if not inst]
        return None, eqn, [], [], residuals
    return eqn, None, [], [], []


_host_check_p.def_impl(_impl)
_host_check_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(_host_check_p, _lowering, cacheable=False)
batching.primitive_batchers[_host_check_p] = _batching
ad.primitive_jvps[_host_check_p] = _jvp
ad.primitive_transposes[_host_check_p] = _transpose
pe.partial_eval_jaxpr_custom_rules[_host_check_p] = _partial_eval_custom
