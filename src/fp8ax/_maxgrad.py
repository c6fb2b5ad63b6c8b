# A float32 "max-accumulating" dtype for FP8 scaling state.
#
# Why this exists (the full argument is in docs/state.md):
#
# fp8ax returns the *new* scaling state as the "gradient" of the state leaves. JAX adds
# the cotangents of a value that is used more than once (a layer called twice, a layer
# closed over by `lax.scan`, a layer under `vmap` with a batched input). Adding two
# "new states" is meaningless: it doubles amaxes and scales. What we want is the state
# that one merged observation would give, and for amax histories and scales that is the
# elementwise maximum (see `_model/dot_general.py`: every per-use new state is monotone in the
# use's amax, and all uses see the same old state).
#
# JAX picks the accumulation by dtype. For ordinary dtypes it is `+`; for an *extended*
# dtype it is the dtype's `add` rule. So inside a differentiated function the state is
# held in `MAXF32`, a float32 whose cotangents accumulate with `max`. The conversion
# f32 -> MAXF32 must happen *before* the value fans out to its uses: converting inside
# each call would sum again across calls. `_scaling_state.ScalingState` therefore converts when
# it is unflattened from traced leaves, which is where `jax.grad`/`eqx.filter_grad`
# rebuild the model, i.e. once, above every use. Its pytree leaves are always float32, so
# `eqx.filter_grad`, optimizers, serialisation and users only ever see float32.
#
# Three JAX gaps are bridged here, all covered by tests:
# - the builtin transpose of an extended-dtype conversion reads `.dtype` from an
#   `UndefinedPrimal` in the backward pass (jax 0.10 through 0.12), so both conversions
#   are small primitives whose transposes are each other;
# - a `vmap`ped use whose input is batched but whose state is not would have its state
#   cotangents reduce-*summed* over the batch (and extended dtypes have no `sum`), so
#   `merged_amax` reduces observed amaxes with `max` over such axes first (see there);
# - with `jax_debug_nans`/`jax_debug_infs` on, JAX reads `addressable_shards` of eager
#   results, which `EArray` does not implement, so concrete MAXF32 arrays are a small
#   `EArray` subclass that does (`_MaxF32Array`).
#
# This module touches `jax._src`: the extended-dtype protocol (`dtypes.extended`,
# `dtypes.ExtendedDType` with a `_rules` class, `earray.EArray`). It is checked at import
# (`_require_extended_dtypes`), and the JAX range the tests run on is pinned in
# pyproject.toml. The rules below are the ones jax 0.10 through 0.12 call; `_rules`
# attributes that JAX no longer reads are left out on purpose.

import builtins
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive as _Primitive
from jax.interpreters import ad as _ad, batching as _batching, mlir as _mlir

from . import _boundaries

_SUPPORTED_JAX = "jax>=0.10,<0.13"


def _require_extended_dtypes():
    """Import JAX's extended-dtype internals, or fail with an error that names the versions."""
    try:
        from jax._src import ad_util, core, dtypes, earray, tree_util
        from jax._src.interpreters import pxla

        for module, name in [
            (dtypes, "extended"),
            (dtypes, "ExtendedDType"),
            (earray, "EArray"),
            (core, "ShapedArray"),
            (core, "physical_aval"),
            (core, "pytype_aval_mappings"),
            (pxla, "global_result_handlers"),
            (pxla, "shard_arg_handlers"),
            (dtypes, "register_canonicalize_value_handler"),
            (tree_util, "dispatch_registry"),
            (ad_util, "raw_jaxval_adders"),
            (ad_util, "add_jaxvals"),
        ]:
            if not hasattr(module, name):
                raise ImportError(f"{module.__name__}.{name} does not exist")
        # jax._src.earray registers EArray with these; `_MaxF32Array` copies the entries.
        for name, registry in [
            ("interpreters.pxla.shard_arg_handlers", pxla.shard_arg_handlers),
            ("core.pytype_aval_mappings", core.pytype_aval_mappings),
        ]:
            if earray.EArray not in registry:
                raise ImportError(f"EArray is not in jax._src.{name}")
    except ImportError as e:
        raise ImportError(
            f"fp8ax needs JAX's extended-dtype machinery (jax._src.dtypes.extended, "
            f"ExtendedDType, jax._src.earray.EArray), which the installed jax "
            f"{jax.__version__} does not provide ({e}). fp8ax supports {_SUPPORTED_JAX}: "
            f'install a JAX in that range, e.g. pip install "{_SUPPORTED_JAX}".'
        ) from e
    return ad_util, core, dtypes, earray, pxla, tree_util


_ad_util, _core, _dtypes, _earray, _pxla, _tree_util = _require_extended_dtypes()


class _MaxF32Rules:
    # Physical representation: a plain float32 per element.
    @staticmethod
    def physical_element_aval(dtype):
        return _core.ShapedArray((), np.dtype(np.float32))

    # `lax.convert_element_type` may convert to and from MAXF32; JAX itself only allows
    # the physical dtype (float32) on the other side.
    allow_conversion = True

    # Cotangent accumulation: max instead of +.
    @staticmethod
    def add(dtype, x, y):
        return _raw_to_max(lax.max(_raw_to_f32(x), _raw_to_f32(y)))

    # Every state value is >= 0 (scales > 0, amaxes >= 0), so 0 is the identity of max,
    # and an unused layer's cotangent reads as 0 whether or not JAX instantiates it here.
    @staticmethod
    def zero(dtype):
        return _raw_to_max(np.array(0.0, np.float32))

    @staticmethod
    def tangent_dtype(dtype):
        return dtype

    @staticmethod
    def full(shape, fill_value, dtype):
        fill = lax.convert_element_type(fill_value, np.float32)
        return _raw_to_max(lax.full(shape, fill, np.float32))

    # Wraps the physical float32 results of a computation as `_MaxF32Array`s. Built with
    # the physical handler's `wrap`, so it stays a JAX result handler: with
    # `jax_debug_nans` or `jax_debug_infs` on, JAX calls its `pre_wrap` to check the float32
    # buffers. The physical shape is the logical one, so the sharding carries over unchanged.
    @staticmethod
    def global_sharded_result_handler(aval, out_sharding, committed):
        phys_aval = _core.physical_aval(aval)
        phys_handler = _pxla.global_result_handlers[_core.ShapedArray](phys_aval, out_sharding, committed)
        return phys_handler.wrap(lambda phys: _MaxF32Array(aval, phys))


class maxf32(_dtypes.extended):
    """Scalar type of `MAXF32` arrays."""


@dataclasses.dataclass(frozen=True)
class _MaxF32DType(_dtypes.ExtendedDType):
    _rules: type = _MaxF32Rules
    type: builtins.type = maxf32  # (`builtins.`: the field's own name shadows `type` here)

    @property
    def name(self) -> str:
        return "maxf32"

    def __repr__(self) -> str:
        return "maxf32"


MAXF32 = _MaxF32DType()


class _MaxF32Array(_earray.EArray):
    """A concrete MAXF32 array: JAX's `EArray` plus `addressable_shards`.

    With `jax_debug_nans`/`jax_debug_infs` on, JAX checks the `addressable_shards` of every
    output of an eager (dispatched) op, and `EArray.addressable_shards` raises
    `NotImplementedError`. Here they are the shards of the float32 buffer, which is what
    the check should read. JAX dispatches on the exact type of an array, so the subclass is
    registered everywhere `EArray` is.
    """

    __slots__ = ()

    @property
    def addressable_shards(self):
        return self._data.addressable_shards


_pxla.shard_arg_handlers[_MaxF32Array] = _pxla.shard_arg_handlers[_earray.EArray]
_core.pytype_aval_mappings[_MaxF32Array] = _core.pytype_aval_mappings[_earray.EArray]
_dtypes.register_canonicalize_value_handler(_MaxF32Array, None)
_tree_util.dispatch_registry.register_node(
    _MaxF32Array, lambda x: ((x._data,), x.aval), lambda aval, xs: _MaxF32Array(aval, xs[0])
)

# Eager (un-jitted) accumulation of two concrete MAXF32 arrays. JAX looks the adder up by
# the Python type (EArray for every extended dtype), so route both types through a jitted
# add, whose lowering applies the dtype's `add` rule above. An adder already registered
# (by JAX or another library) is left alone: for EArray it dispatches on the dtype's rules.
_eager_add = jax.jit(_ad_util.add_jaxvals)
for _t in (_earray.EArray, _MaxF32Array):
    _ad_util.raw_jaxval_adders.setdefault(_t, _eager_add)


def _raw_to_max(x):
    return lax.convert_element_type(x, MAXF32)


def _raw_to_f32(x):
    return lax.convert_element_type(x, np.float32)


def _conversion(name, dtype, raw):
    # A primitive of its own rather than a `custom_vjp` around the conversion: a state is
    # converted at every rebuild of the model inside a traced step (each jit boundary
    # rebuilds it), and a `custom_vjp` call costs some 350 Python calls to trace against
    # a bind's few dozen. Rules: the value is a plain conversion (impl and lowering), it
    # is linear (its JVP is itself), it maps elementwise (vmap), and its abstract value
    # keeps shape, sharding and varying manual axes.
    #
    # Each conversion has a twin, "refusing", that JAX's `vmap` puts in its place inside
    # the branches of a `lax.cond`/`lax.switch` whose predicate differs per example: the
    # same conversion, whose derivative raises fp8ax's error (`_boundaries.py`: JAX sums
    # the per-example copies of the state there). The twin is made while the branch is
    # batched, where the rule can be recognised, and refuses only if the step is then
    # differentiated (an FP8 layer in such a branch is fine for inference).
    #
    # A conversion may carry a `label` (the layer's name): the views a differentiated
    # function makes of a layer's state, whose transposes tell that the layer was used
    # (see "Which layers a differentiated step never calls" below). It changes nothing
    # else.
    prim, refusing = _Primitive(name), _Primitive(name + "_refusing")
    for p in (prim, refusing):
        p.def_impl(lambda x, **_: raw(x))
        p.def_abstract_eval(lambda aval, **_: aval.update(dtype=dtype, weak_type=False))
        _mlir.register_lowering(p, _mlir.lower_fun(lambda x, **_: raw(x), multiple_results=False))

    def batch(args, dims, **params):
        (x,), (d,) = args, dims
        return (refusing if _boundaries.in_per_example_cond() else prim).bind(x, **params), d

    _batching.primitive_batchers[prim] = _batching.primitive_batchers[refusing] = batch
    _ad.primitive_jvps[refusing] = _refuse
    return prim


def _refuse(*_, **__):
    raise ValueError(_boundaries.PER_EXAMPLE_COND)


def _transpose(prim_of_ct):
    def rule(ct, x, *, label=None):
        # The one place besides `_gemm.dense._bwd` that runs while JAX transposes a
        # `shard_map`: where a state rebuilt inside the body is converted.
        if _boundaries.in_unchecked_shard_map_transpose():
            raise ValueError(_boundaries.UNCHECKED_SHARD_MAP)
        if label is not None:
            # A view of a layer's state with a cotangent: something the differentiated
            # function called used the state (JAX transposes only with a nonzero one).
            _CALLED.add(label)
        return [prim_of_ct().bind(ct)]

    return rule


_to_max_p = _conversion("fp8ax_to_maxf32", MAXF32, _raw_to_max)
_to_f32_p = _conversion("fp8ax_to_float32", np.dtype(np.float32), _raw_to_f32)
# The transpose of one conversion is the other (the builtin rule of
# `convert_element_type` cannot be used: see the top of this file).
_ad.deflinear2(_to_max_p, _transpose(lambda: _to_f32_p))
_ad.deflinear2(_to_f32_p, _transpose(lambda: _to_max_p))


def _linearization_protocol() -> int | None:
    """How many values JAX's linearisation expects from a primitive's rule: 4 (jax
    0.10), 5 (jax 0.11 and 0.12: a structured residual too), or None where this JAX's
    `LinearizeTrace` is neither (then no rule is registered, and JAX linearises through
    the JVP rules, as it would without them)."""
    try:
        from jax._src.interpreters import ad

        names = ad.LinearizeTrace.process_primitive.__code__.co_varnames
        ad.primitive_linearizations  # noqa: B018 (it must exist)
    except (ImportError, AttributeError):
        return None
    if "linearized" not in names or "residuals" not in names:
        return None
    return 5 if "structured_res" in names else 4


def _def_linear_linearization(prim, primal=None, on_call=None) -> None:
    """Registers how `jax.grad` (`jax.linearize`, `jax.vjp`) linearises a unary linear
    primitive: its output is `primal(x)` (default: the primitive applied to `x`), its
    tangent the primitive applied to the input's. JAX's fallback gets there through the
    JVP rule by tracing it into a jaxpr of its own at every use, and every flatten of a
    traced state converts (docs/how-it-works.md): on a 48-layer stack the fallback was a
    fifth of the step's trace. `on_call(**params)` runs where the JVP rule would."""
    protocol = _linearization_protocol()
    if protocol is None:
        return
    from jax._src.interpreters import ad

    def rule(_is_vjp, nonzeros, x, **params):
        if on_call is not None:
            on_call(**params)
        out = prim.bind(x, **params) if primal is None else primal(x)
        # (JAX calls a rule only when the input's tangent is nonzero.)
        if protocol == 4:
            return out, nonzeros[0], (), lambda _res, t: prim.bind(t, **params)
        return out, nonzeros[0], (), None, lambda _res, _structured, t: prim.bind(t, **params)

    ad.primitive_linearizations[prim] = rule


_def_linear_linearization(_to_max_p)
# (A view's label goes to its tangent, which is what JAX transposes.)
_def_linear_linearization(_to_f32_p, primal=lambda x: _to_f32_p.bind(x))


class UnusedLayerWarning(UserWarning):
    """An FP8 layer's state got no cotangent from the function being differentiated: the
    training step never called the layer (see `watch_use`)."""


def _warn_unused(label: str) -> None:
    # Once per layer and process, by Python's default warning filter (the message names
    # the layer).
    import warnings

    warnings.warn(
        f"fp8ax: the FP8 layer `{label}` is never called by the function being differentiated, so "
        "its FP8 state is never written, and whatever trains its weight does so in high precision. "
        "If the model uses the layer's weight another way (Levanter's language models take "
        "`lm_head`'s weight into their own loss and never call the layer), leave the layer out of "
        f'the conversion: `fp8ax.Fp8Config(targets=lambda path, layer: path != "{label}")`. If only '
        "some steps call it, nothing is wrong: `fp8ax.apply_updates` keeps its state.",
        UnusedLayerWarning,
        stacklevel=2,
    )


# Which layers a differentiated step never calls. JAX leaves no trace of an unused input
# in the backward pass (its cotangent is a zero it never computes), so fp8ax keeps two
# sets while a step is traced: the labelled states rebuilt from the inputs `jax.grad`
# differentiates (`watch_use`, whose JVP rule runs for each), and the layers that were
# used. A layer is used when its `__call__` runs at the differentiated level
# (`note_called`), or when a view of its state that the differentiated function handed to
# a boundary (`hax.dot`'s or any `jit`, `lax.scan`, `lax.cond`, `jax.checkpoint`) gets a
# cotangent: such a view carries the layer's name (`to_f32`'s `label`), and JAX
# transposes it only with a nonzero cotangent. The second way holds when the boundary's
# body was traced for another layer and is reused from JAX's cache, which runs no
# `__call__`: state names do not enter a pytree's structure (`_state.LayerName`), so
# layers alike share one trace of `hax.dot`'s `jit`. Those views come after the watched
# values in the forward pass, so they are transposed before them: at the first transpose
# of a watched value, every watched layer that was not used gets the warning. All of it
# runs while the step is traced (its first call): nothing at run time, and the
# primitives lower to a conversion and to nothing. A layer that any earlier trace of the
# process used is not reported: the warning is for a layer no step ever calls.
_WATCHED: set[str] = set()
_CALLED: set[str] = set()


def note_called(label: str | None) -> None:
    """Records that the layer named `label` was called (see `watch_use`)."""
    if label is not None:
        _CALLED.add(label)


def _watch_jvp(primals, tangents, *, label):
    _WATCHED.add(label)
    (x,), (t,) = primals, tangents
    return x, t if type(t) is _ad.Zero else _watch_p.bind(t, label=label)


def _watch_transpose(ct, x, *, label):
    del x, label
    unused = sorted(_WATCHED - _CALLED)
    _WATCHED.clear()
    for name in unused:
        _warn_unused(name)
    return [ct]  # an identity: the input's cotangent is the output's


_watch_p = _Primitive("fp8ax_watch_use")
_watch_p.def_impl(lambda x, *, label: x)
_watch_p.def_abstract_eval(lambda aval, *, label: aval)
_mlir.register_lowering(_watch_p, _mlir.lower_fun(lambda x, *, label: x, multiple_results=False))
_batching.primitive_batchers[_watch_p] = lambda args, dims, *, label: (_watch_p.bind(args[0], label=label), dims[0])
_ad.primitive_jvps[_watch_p] = _watch_jvp
_ad.primitive_transposes[_watch_p] = _watch_transpose
# As `_watch_jvp`: the primal passes through, the tangent is watched.
_def_linear_linearization(_watch_p, primal=lambda x: x, on_call=lambda *, label: _WATCHED.add(label))


def watch_use(x, label: str):
    """`x` (a state value entering a differentiated function), watched for a step that
    never calls its layer, named `label`."""
    return _watch_p.bind(x, label=label)


def to_max(x):
    """float32 -> MAXF32; the cotangent goes back to float32."""
    return _to_max_p.bind(x)


def to_f32(x, label: str | None = None):
    """MAXF32 -> float32; the cotangent goes back to MAXF32. With `label`, the view of the
    state of the layer so named that a differentiated function hands to a boundary (see
    `_state._view`): its transpose records that the layer was used."""
    return _to_f32_p.bind(x) if label is None else _to_f32_p.bind(x, label=label)


def is_max(x) -> bool:
    return getattr(x, "dtype", None) == MAXF32


def as_f32(x):
    """float32 view of a state value held in either representation (no autodiff link)."""
    return _raw_to_f32(x) if is_max(x) else x


def raw_to_max(value):
    """float32 -> MAXF32 with no autodiff link (for cotangents built in a custom VJP)."""
    return _raw_to_max(value)


@custom_vmap
def merged_amax(amax, state):
    """The amax of one observation, merged with `max` over data axes.

    `state` only tells which `vmap` axes are *data* axes: an axis that maps the input
    but not the state (per-example `eqx.nn.Linear` under `jax.vmap`) is part of one
    observation, so its amaxes are reduced with max. An axis that maps the state too
    (stacked layers, `eqx.filter_vmap` ensembles) holds independent copies and stays.
    `amax` may be a pytree of values of one observation, each merged by that rule (one
    call costs less to trace than one per value).
    """
    del state
    return amax


@merged_amax.def_vmap
def _merged_amax_vmap(axis_size, in_batched, amax, state):
    amax_batched, state_batched = in_batched
    leaves, tree = jax.tree.flatten(amax)
    out, out_batched, reduced = [], [], False
    for value, batched in zip(leaves, jax.tree.leaves(amax_batched)):
        if batched and not state_batched:
            value, batched, reduced = jnp.max(value, axis=0), False, True
        elif not batched and state_batched:
            value, batched = jnp.broadcast_to(value, (axis_size, *jnp.shape(value))), True
        out.append(value)
        out_batched.append(batched)
    out = tree.unflatten(out)
    if reduced:
        # Recurse so an enclosing vmap applies the same rule to its own axis.
        out = merged_amax(out, state)
    return out, tree.unflatten(out_batched)
