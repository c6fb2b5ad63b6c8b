"""Layer kinds as plug-ins: every registered kind, the built-in ones and one defined
outside fp8ax (`tests/outside_kind.py`, registered through the public interface), goes
through the same checks: conversion and the report, a training step against the plain
layer, reuse (the state of two calls in one step is the max of their observations, not
their sum), `strip_fp8`, a checkpoint round trip, `scaling_stats`, the unused-layer
warning, and serving (the built-in kinds bit for bit; the outside kind is refused with a
message that names it).

Tolerances: a converted layer's output against the plain one within 0.1 of its norm
(E4M3's 3 mantissa bits: about 2**-4 per value, averaged over the contraction); the new
amax history's head equals the max of the two inputs' amaxes exactly (a max is exact).
"""

import dataclasses
import io
import warnings
from collections.abc import Callable

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from outside_kind import KIND, TransposedLinear

In, Out, Batch, Layers = hax.Axis("embed", 32), hax.Axis("mlp", 48), hax.Axis("batch", 8), hax.Axis("layers", 2)
Experts = hax.Axis("experts", 4)
SIZES = hax.named(jnp.array([2, 3, 1, 2], jnp.int32), Experts)  # tokens per expert (8 in all)


@dataclasses.dataclass(frozen=True)
class KindCase:
    make: Callable  # key -> a model holding one layer of the kind at `path`
    path: str  # the layer's dotted path
    x: Callable  # key -> an input
    call: Callable  # (model, x) -> output array
    report_name: str
    features: tuple[int, int]
    stacked: tuple[int, ...] = ()
    observed: bool = True  # by `scaling_stats` (grouped GEMMs are not: their operands are ragged)


class _Holder(eqx.Module):
    layer: eqx.Module

    def __call__(self, x):
        return self.layer(x)


def _eqx_call(m, x):
    return jax.vmap(m)(x)


def _hax_x(key):
    return hax.random.normal(key, (Batch, In))


def _stacked_make(key):
    class Block(eqx.Module):
        proj: hax.nn.Linear

        @staticmethod
        def init(*, key):
            return Block(hax.nn.Linear.init(In, In.alias("embed2"), key=key))

        def __call__(self, x):
            return x + self.proj(x).rename({"embed2": "embed"})

    return _Holder(hax.nn.Stacked.init(Layers, Block)(key=jax.random.split(key, Layers.size)))


def _stacked_call(m, x):
    return m.layer.fold(x).array


CASES = {
    "eqx-linear": KindCase(
        lambda k: _Holder(eqx.nn.Linear(In.size, Out.size, key=k)),
        "layer",
        lambda k: jax.random.normal(k, (Batch.size, In.size)),
        _eqx_call,
        "eqx.nn.Linear",
        (In.size, Out.size),
    ),
    "hax-linear": KindCase(
        lambda k: _Holder(hax.nn.Linear.init(In, Out, key=k)),
        "layer",
        _hax_x,
        lambda m, x: m(x).array,
        "hax.nn.Linear",
        (In.size, Out.size),
    ),
    "hax-stacked": KindCase(
        _stacked_make,
        "layer.stacked.proj",
        _hax_x,
        _stacked_call,
        "hax.nn.Linear",
        (In.size, In.size),
        stacked=(Layers.size,),
    ),
    "hax-moe": KindCase(
        lambda k: _Holder(hax.nn.MoELinear.init(Experts, In, Out, key=k)),
        "layer",
        _hax_x,
        lambda m, x: m.layer(x, SIZES).array,
        "hax.nn.MoELinear",
        (In.size, Out.size),
        observed=False,
    ),
    "outside": KindCase(
        lambda k: _Holder(TransposedLinear(In.size, Out.size, key=k)),
        "layer",
        lambda k: jax.random.normal(k, (Batch.size, In.size)),
        lambda m, x: m(x),
        "TransposedLinear",
        (In.size, Out.size),
    ),
}
NAMES = list(CASES)


def _converted(case: KindCase, getkey, config=None):
    plain = case.make(getkey())
    return plain, fp8ax.fp8_linear_layers(plain, config)


def _at(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _step(model, loss):
    grads = eqx.filter_grad(loss)(model)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates = jax.tree.map(lambda g: -1e-3 * g, grads)
    return fp8ax.apply_updates(model, updates, overwrite)


def test_outside_kind_is_registered_once():
    assert fp8ax.register_layer_kind(type(KIND)()) is not KIND  # an equal kind: nothing added
    from fp8ax._model import layer_kinds

    assert [k for k in layer_kinds() if k == KIND] == [KIND]
    with pytest.raises(TypeError, match=r"`kind` must be an `fp8ax.LayerKind` instance, got str"):
        fp8ax.register_layer_kind("TransposedLinear")


@pytest.mark.parametrize("name", NAMES)
def test_conversion_and_report(name, getkey):
    """Converted, listed in the report with its kind, features and stacked shape; skipped
    by `min_features` and `targets`; kept when converted twice; `strip_fp8` gives the
    plain model back, the same arrays."""
    case = CASES[name]
    plain, fp8 = _converted(case, getkey)
    layer = _at(fp8, case.path)
    report = fp8ax.conversion_report(plain)
    (row,) = [r for r in report.layers if r.path == case.path]
    assert (row.kind, (row.in_features, row.out_features), row.stacked, row.action) == (
        case.report_name,
        case.features,
        case.stacked,
        "convert",
    )
    assert fp8ax.conversion_report(plain, fp8ax.Fp8Config(min_features=1000)).skipped == [case.path]
    assert fp8ax.conversion_report(fp8).paths("keep") == [case.path]
    again = fp8ax.fp8_linear_layers(fp8)
    assert eqx.tree_equal(again, fp8)
    assert (layer.ragged if name == "hax-moe" else layer.dot_general).lhs is not None  # the default recipe's state
    stripped = fp8ax.strip_fp8(fp8)
    assert jax.tree.structure(stripped) == jax.tree.structure(plain)
    assert eqx.tree_equal(stripped, plain)


@pytest.mark.parametrize("name", NAMES)
def test_train_step_and_reuse(name, getkey):
    """One step: the output is the plain layer's within 0.1 of its norm, and the state
    of a layer called twice holds the max of the two inputs' amaxes (not their sum)."""
    case = CASES[name]
    plain, fp8 = _converted(case, getkey)
    x1, x2 = case.x(getkey()), case.x(getkey())
    x2 = x2 * 3
    want, got = case.call(plain, x1), case.call(fp8, x1)
    assert np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want)) < 0.1
    new = eqx.filter_jit(_step)(fp8, lambda m: jnp.sum(case.call(m, x1)) + jnp.sum(case.call(m, x2)))
    op = fp8ax.Fp8DotGeneral if name != "hax-moe" else None
    layer = _at(new, case.path)
    history = np.asarray((layer.dot_general if op else layer.ragged).lhs.amax_history)
    head = history[..., 0]
    arr = lambda x: np.asarray(x.array if isinstance(x, hax.NamedArray) else x)  # noqa: E731
    if case.stacked:  # the second block sees the first block's output: its amax is at least x's
        assert np.all(head >= np.abs(arr(x2)).max())
    else:
        assert head == max(np.abs(arr(x1)).max(), np.abs(arr(x2)).max())


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_stats_and_unused_warning(name, getkey):
    """A checkpoint round trip (`fp8ax.tree_deserialise_leaves`), `scaling_stats` by the
    layer's path, and `UnusedLayerWarning` naming the layer a step did not call."""
    case = CASES[name]
    _, fp8 = _converted(case, getkey)
    x = case.x(getkey())
    trained = eqx.filter_jit(_step)(fp8, lambda m: jnp.sum(case.call(m, x)))
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, trained)
    buf.seek(0)
    loaded = fp8ax.tree_deserialise_leaves(buf, fp8)
    assert eqx.tree_equal(loaded, trained)
    # Each kind's checkpoint told apart from another kind's, the layer named.
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, fp8ax.strip_fp8(trained))
    for like, want in ((fp8, "an FP8 training layer"), (fp8ax.to_serving(trained), "a serving layer")):
        buf.seek(0)
        with pytest.raises(
            ValueError, match=rf"at layer `{case.path}`: `like` has {want}.*The checkpoint holds a plain"
        ):
            fp8ax.tree_deserialise_leaves(buf, like)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, trained)
    buf.seek(0)
    # The layer is the last: its state is left over, one array (three for a grouped GEMM's).
    more = 3 if name == "hax-moe" else 1
    with pytest.raises(ValueError, match=rf"{more} more follow.*FP8 state after its last layer"):
        fp8ax.tree_deserialise_leaves(buf, fp8ax.strip_fp8(fp8))
    buf.seek(0)
    with pytest.raises(ValueError, match=rf"`{case.path}`: `like` has a serving layer.*holds an FP8 training layer"):
        fp8ax.tree_deserialise_leaves(buf, fp8ax.to_serving(trained))
    stats = fp8ax.scaling_stats(trained, lambda m: case.call(m, x))
    # Observed: a saturation fraction per stacked layer, under the layer's path.
    observed = [k for k in stats if k.startswith(case.path) and k.endswith("/lhs/saturation")]
    assert len(observed) == (max(1, int(np.prod(case.stacked))) if case.observed else 0), list(stats)
    # A step that calls one copy of the layer and not the other (under a path no earlier
    # trace called: the warning is for a layer no step ever calls).
    never = f"never_{name.replace('-', '_')}"
    pair = fp8ax.fp8_linear_layers({"used": case.make(getkey()), never: case.make(getkey())})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eqx.filter_grad(lambda m: jnp.sum(case.call(m["used"], x)))(pair)
    unused = [str(w.message) for w in caught if issubclass(w.category, fp8ax.UnusedLayerWarning)]
    assert len(unused) == 1 and f"`{never}.{case.path}` is never called" in unused[0], unused


@pytest.mark.parametrize("name", NAMES)
def test_serving(name, getkey):
    """`to_serving` through the kind: the weight stored in one byte per value, the output
    the training model's bit for bit; the template has its structure; converting again is
    refused."""
    case = CASES[name]
    _, fp8 = _converted(case, getkey)
    x = case.x(getkey())
    trained = eqx.filter_jit(_step)(fp8, lambda m: jnp.sum(case.call(m, x)))
    serving = fp8ax.to_serving(trained)
    want = eqx.filter_jit(case.call)(trained, x)
    got = eqx.filter_jit(case.call)(serving, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    weight = _at(serving, case.path).weight
    assert np.dtype((weight.array if isinstance(weight, hax.NamedArray) else weight).dtype).itemsize == 1
    shapes = lambda t: [(a.shape, a.dtype) for a in jax.tree.leaves(t)]  # noqa: E731
    assert shapes(fp8ax.serving_template(fp8)) == shapes(serving)
    with pytest.raises(ValueError, match=rf"Layer `{case.path}` is already a serving layer"):
        fp8ax.to_serving(serving)


class _Unserved(TransposedLinear):
    """A subclass whose kind does not say how to serve it."""


class _UnservedKind(type(KIND)):
    name = "Unserved"

    def is_plain(self, x):
        return isinstance(x, _Unserved) and super().is_plain(x)

    def is_converted(self, x):
        return isinstance(x, _Unserved) and super().is_converted(x)

    def is_serving(self, x):
        return False

    to_serving = fp8ax.LayerKind.to_serving


def test_a_kind_that_does_not_serve_is_refused_by_name(getkey):
    fp8ax.register_layer_kind(_UnservedKind())
    layer = object.__new__(_Unserved)
    for f, v in vars(TransposedLinear(In.size, Out.size, key=getkey())).items():
        object.__setattr__(layer, f, v)
    model = fp8ax.fp8_linear_layers({"head": layer})
    assert fp8ax.conversion_report(model).layers[0].kind == "Unserved"
    with pytest.raises(ValueError, match=r"Layer `head` is a converted Unserved .*does not say how to serve it"):
        fp8ax.to_serving(model)


def test_serving_freezer_names_bad_arguments(getkey):
    """`ServingFreezer`'s methods name the argument that is wrong."""
    from fp8ax import ServingFreezer

    layer = fp8ax.fp8_linear_layers(eqx.nn.Linear(4, 3, key=getkey()))
    freeze, op, w = ServingFreezer("head"), layer.dot_general, layer.weight
    with pytest.raises(
        TypeError, match=r"`ServingFreezer.dense`: `op` must be an `fp8ax.Fp8DotGeneral`, got Fp8Linear"
    ):
        freeze.dense(layer, w, (1,))
    with pytest.raises(TypeError, match=r"`weight` must be an array, got list"):
        freeze.dense(op, [[1.0]], (1,))
    with pytest.raises(ValueError, match=r"`n_batch` must be an int from 0 to 0 .*got 1"):
        freeze.dense(op, w, (1,), n_batch=1)
    with pytest.raises(ValueError, match=r"`contracting` must be a non-empty tuple .*\[0, 2\)\), got \(2,\)"):
        freeze.dense(op, w, (2,))
    with pytest.raises(TypeError, match=r"`ServingFreezer.grouped`: `op` must be an `fp8ax.Fp8RaggedDot`"):
        freeze.grouped(op, w)
