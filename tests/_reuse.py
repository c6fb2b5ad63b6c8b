"""The reuse matrix: a layer used several times in one step records one merged observation.

The definition of the cases, shared by tests/test_reuse_matrix.py (one device) and the
8-device subprocess it starts for `jax.shard_map` (`python tests/_reuse.py OUT.json`).

A case is an entry point (how a user calls an FP8 layer), a boundary (the transformation
the user puts around each use), a use pattern (how the uses add up to one step) and a
starting state (fresh: the first step calibrates; trained: delayed scaling). It computes
the FP8 state the step returns and checks it against an independent reference:

- **The merge.** Every use, run alone at the top level on the same inputs and output
  gradients, gives the state that use would record; the step must return their
  elementwise max, bit for bit (docs/state.md: "the scale is the one a single call on
  both inputs would use"; the per-use states are monotone in what they observe and start
  from one old state). A sum, the regression this matrix exists for, doubles amaxes and
  scales. For entry points with one FP8 layer the max is also, bit for bit, the state
  of one use on the concatenated inputs (`check_concatenation`). With several layers
  that is not a promise: each use of a fresh model calibrates on its own data, so the
  inner layers see other values.
- **An unused layer keeps its state.** Every model carries a spare layer that no use
  touches: its "gradient" is zero and `fp8ax.apply_updates` leaves it bit for bit as it
  was. Branches not taken (`cond`, `switch`) use the layer on 100x the input; their
  observation must not show.
- **NaN never enters the state.** The same step with a NaN in the first use's input: the
  state is finite and equals the merge of the per-use states (the NaN use observes
  nothing for the tensors it poisons).

Inputs and output gradients are arguments of the jitted step, so the NaN pass reuses the
compiled program. The inputs the second use of a chain sees, and the output gradient of
the first, are read from the step itself (an aux output and a zero probe added to the
first use's output), so the reference sees exactly the values the step saw.
"""

import dataclasses
import functools
import json
import sys
import traceback
import warnings
from collections.abc import Callable

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import fp8ax

N = 16  # rows per use: two per device under `jax.shard_map` on 8 devices (a scan inside halves them)
D = 16  # features in and out (chains feed a use's output to the next use)
H = 32  # hidden features of multi-layer entry points
DIMS = (((1,), (0,)), ((), ()))


# ----------------------------------------------------------------------------------------
# Entry points: how a user calls an FP8 layer. `make(key)` builds the converted layer,
# `use(layer, x)` maps an (N, D) array to an (N, D) array.


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    make: Callable
    use: Callable
    one_layer: bool  # a single FP8 layer: the merge is also one use on the concatenation
    haliax: bool  # calls `hax.dot` (skipped where Haliax's named-axis dot is broken)


def _axes(n):
    return hax.Axis("batch", n), hax.Axis("embed", D), hax.Axis("mid", H)


def _named(x):
    Batch, Embed, _ = _axes(x.shape[0])
    return hax.named(x, (Batch, Embed))


class _DotGeneral(eqx.Module):
    dg: fp8ax.Fp8DotGeneral
    w: jax.Array


def _make_dot_general(key):
    return _DotGeneral(fp8ax.Fp8DotGeneral.init(), jax.random.normal(key, (D, D)))


def _use_dot_general(layer, x):
    return layer.dg(x, layer.w, DIMS)


def _make_eqx_linear(key):
    return fp8ax.fp8_linear_layers(eqx.nn.Linear(D, D, key=key))


def _use_eqx(layer, x):
    return jax.vmap(layer)(x)  # Equinox layers act on one example


def _make_eqx_mlp(key):
    return fp8ax.fp8_linear_layers(eqx.nn.MLP(D, D, H, 2, key=key))


def _make_hax_linear(key):
    _, Embed, _ = _axes(1)
    return fp8ax.fp8_linear_layers(hax.nn.Linear.init(Embed, Embed.alias("out"), key=key))


def _use_hax_linear(layer, x):
    return layer(_named(x)).array


class _HaxDot(eqx.Module):
    dg: fp8ax.Fp8DotGeneral
    w: hax.NamedArray


def _make_hax_dot(key):
    _, Embed, _ = _axes(1)
    return _HaxDot(fp8ax.Fp8DotGeneral.init(), hax.random.normal(key, (Embed, Embed.alias("out"))))


def _use_hax_dot(layer, x):
    _, Embed, _ = _axes(1)
    return hax.dot(_named(x), layer.w, axis=Embed, dot_general=layer.dg).array


class _Block(eqx.Module):
    up: hax.nn.Linear
    down: hax.nn.Linear

    @staticmethod
    def init(*, key):
        _, Embed, Mid = _axes(1)
        k1, k2 = jax.random.split(key)
        return _Block(hax.nn.Linear.init(Embed, Mid, key=k1), hax.nn.Linear.init(Mid, Embed, key=k2))

    def __call__(self, x):
        return x + self.down(hax.nn.relu(self.up(x)))


Layers = hax.Axis("layers", 2)


def _make_stacked(key):
    return fp8ax.fp8_linear_layers(hax.nn.Stacked.init(Layers, _Block)(key=jax.random.split(key, Layers.size)))


def _make_blockseq(key):
    return fp8ax.fp8_linear_layers(hax.nn.BlockSeq.init(Layers, _Block)(key=jax.random.split(key, Layers.size)))


def _use_blocks(layer, x):
    return layer.fold(_named(x)).array


# Grouped GEMMs (mixture of experts): 3 experts over the rows of a use, one of them empty
# (per-expert weight state: that expert records nothing). Half the rows go to each of the
# other two, so that every split of a batch (scan halves, a shard of 2 rows) uses the same
# experts as the whole: the reference's uses, run on whole inputs, then observe the same
# experts. (Uneven groups: tests/test_ragged.py.)
EXPERTS = 3


def _group_sizes(n):
    return jnp.array([n // 2, 0, n - n // 2], jnp.int32)


class _Ragged(eqx.Module):
    op: fp8ax.Fp8RaggedDot
    w: jax.Array


def _make_ragged(key):
    return _Ragged(fp8ax.Fp8RaggedDot.init(num_experts=EXPERTS), jax.random.normal(key, (EXPERTS, D, D)))


def _use_ragged(layer, x):
    return layer.op(x, layer.w, _group_sizes(x.shape[0]))


def _make_hax_moe(key):
    _, Embed, _ = _axes(1)
    return fp8ax.fp8_linear_layers(
        hax.nn.MoELinear.init(hax.Axis("experts", EXPERTS), Embed, Embed.alias("out"), key=key)
    )


def _use_hax_moe(layer, x):
    sizes = hax.named(_group_sizes(x.shape[0]), hax.Axis("experts", EXPERTS))
    return layer(_named(x), sizes).array


ENTRIES = {
    e.name: e
    for e in [
        Entry("dot_general", _make_dot_general, _use_dot_general, one_layer=True, haliax=False),
        Entry("eqx_linear", _make_eqx_linear, _use_eqx, one_layer=True, haliax=False),
        Entry("eqx_mlp", _make_eqx_mlp, _use_eqx, one_layer=False, haliax=False),
        Entry("hax_linear", _make_hax_linear, _use_hax_linear, one_layer=True, haliax=True),
        Entry("hax_dot", _make_hax_dot, _use_hax_dot, one_layer=True, haliax=True),
        Entry("stacked", _make_stacked, _use_blocks, one_layer=False, haliax=True),
        Entry("blockseq", _make_blockseq, _use_blocks, one_layer=False, haliax=True),
        # The groups of a use depend on its rows, so one use on the concatenation is not
        # the two uses: the merge is checked, not the concatenation.
        Entry("ragged_dot", _make_ragged, _use_ragged, one_layer=False, haliax=False),
        Entry("hax_moe", _make_hax_moe, _use_hax_moe, one_layer=False, haliax=False),
    ]
}


# ----------------------------------------------------------------------------------------
# Boundaries: what a user puts around one use. Each maps `f(layer, x)` to a function with
# the same signature that calls `f` inside the boundary. JAX's own transformations take
# the layer as users pass an Equinox module to them: its arrays (`eqx.partition`), the
# rest closed over. `parts`: how many real uses one call makes (a scan over the two
# halves of the input makes two; the reference counts each). `error`: the message of the
# error fp8ax must raise instead (a combination that cannot be made right).


@dataclasses.dataclass(frozen=True)
class Boundary:
    wrap: Callable
    parts: int = 1
    interleaved: bool = False  # the parts are every device's first rows, then its second rows
    error: str | None = None


def _jax_style(transform):
    def wrap(f):
        def g(layer, x):
            dyn, static = eqx.partition(layer, eqx.is_array)
            return transform(lambda d, x: f(eqx.combine(d, static), x))(dyn, x)

        return g

    return wrap


def _halves(x):
    return x.reshape(2, x.shape[0] // 2, *x.shape[1:])


def _scan(f, *, remat=False, policy=None):
    # The layer closed over by the body (an RNN cell's way); the body runs on the two
    # halves of x: two uses, merged inside the scan.
    def g(layer, x):
        def body(carry, xi):
            return carry, f(layer, xi)

        body = jax.checkpoint(body, policy=policy) if remat else body
        _, ys = lax.scan(body, None, _halves(x))
        return ys.reshape(x.shape[0], *ys.shape[2:])

    return g


def _vmap(vmap):
    # A data axis: the input is mapped (two halves), the layer is not. One observation.
    def wrap(f):
        def g(layer, x):
            if vmap is jax.vmap:
                dyn, static = eqx.partition(layer, eqx.is_array)
                ys = jax.vmap(lambda d, xi: f(eqx.combine(d, static), xi), in_axes=(None, 0))(dyn, _halves(x))
            else:
                ys = eqx.filter_vmap(f, in_axes=(None, 0))(layer, _halves(x))
            return ys.reshape(x.shape[0], *ys.shape[2:])

        return g

    return wrap


def _true(value):
    # Data-dependent (so the conditional stays one), true for every value here (NaN too).
    return lax.ne(jnp.sum(value), jnp.float32(jnp.inf))


def _cond(f):
    # The layer passed as an operand; the predicate comes from the input (so under `vmap`
    # it differs per example). The branch not taken uses the layer on 100x the input.
    def g(layer, x):
        dyn, static = eqx.partition(layer, eqx.is_array)
        taken = lambda d, x: f(eqx.combine(d, static), x)  # noqa: E731
        not_taken = lambda d, x: f(eqx.combine(d, static), 100 * x)  # noqa: E731
        return lax.cond(_true(x), taken, not_taken, dyn, x)

    return g


def _switch(f):
    # The layer closed over by the branches; the index comes from the layer's arrays (one
    # for the whole batch under `vmap`), and branch 1 runs.
    def g(layer, x):
        branches = [lambda x: f(layer, 100 * x), lambda x: f(layer, x), lambda x: f(layer, -100 * x)]
        first = jtu.tree_leaves(eqx.filter(layer, eqx.is_array))[0]
        return lax.switch(lax.convert_element_type(_true(first), jnp.int32), branches, x)

    return g


@functools.cache
def _mesh():
    return Mesh(np.array(jax.devices()), ("data",))


def _shard_map(check_vma: bool):
    # The batch split over the devices, the layer replicated: one observation (fp8ax
    # merges the shards' amaxes with `pmax`).
    def wrap(f):
        def g(layer, x):
            dyn, static = eqx.partition(layer, eqx.is_array)
            body = lambda d, x: f(eqx.combine(d, static), x)  # noqa: E731
            return jax.shard_map(
                body, mesh=_mesh(), in_specs=(P(), P("data")), out_specs=P("data"), check_vma=check_vma
            )(dyn, x)

        return g

    return wrap


def _policy(policy):
    # A policy that saves residuals: JAX rounds each saved floating-point residual to the
    # format of its dtype (src/fp8ax/_gemm/residuals.py). Every other policy is run for
    # every recipe by tests/test_remat.py.
    return lambda f: jax.checkpoint(f, policy=policy)


BOUNDARIES: dict[str, Boundary] = {
    "none": Boundary(lambda f: f),
    "jax.jit": Boundary(_jax_style(jax.jit)),
    "eqx.filter_jit": Boundary(eqx.filter_jit),
    "jax.checkpoint": Boundary(_jax_style(jax.checkpoint)),
    "jax.checkpoint(everything_saveable)": Boundary(_jax_style(_policy(jax.checkpoint_policies.everything_saveable))),
    "eqx.filter_checkpoint": Boundary(eqx.filter_checkpoint),
    "lax.scan": Boundary(_scan, parts=2),
    "lax.scan(checkpoint)": Boundary(functools.partial(_scan, remat=True), parts=2),
    # Haliax's `Stacked(gradient_checkpointing="save_all")`: a scan whose checkpointed body
    # saves its internals.
    "lax.scan(checkpoint(save_anything_except_these_names))": Boundary(
        functools.partial(_scan, remat=True, policy=jax.checkpoint_policies.save_anything_except_these_names()),
        parts=2,
    ),
    "jax.vmap": Boundary(_vmap(jax.vmap)),
    "eqx.filter_vmap": Boundary(_vmap(eqx.filter_vmap)),
    "lax.cond": Boundary(_cond),
    "lax.switch": Boundary(_switch),
    "jax.shard_map": Boundary(_shard_map(True)),
    "jax.shard_map(check_vma=False)": Boundary(_shard_map(False), error="check_vma=False"),
}

# Two boundaries nested (outer, inner), and the error fp8ax must raise, if any.
NESTED = [
    ("jax.jit", "jax.checkpoint", None),
    ("eqx.filter_checkpoint", "eqx.filter_jit", None),
    ("eqx.filter_jit", "lax.scan", None),
    ("lax.scan", "eqx.filter_jit", None),
    ("jax.vmap", "jax.checkpoint", None),
    ("eqx.filter_checkpoint", "jax.vmap", None),
    ("lax.cond", "eqx.filter_checkpoint", None),
    ("lax.scan", "lax.cond", None),
    ("jax.vmap", "lax.switch", None),
    # A per-example predicate: JAX runs every branch on a copy of the state per example
    # and sums the copies (see `fp8ax._boundaries`).
    ("jax.vmap", "lax.cond", "predicate differs per example"),
    ("jax.shard_map", "eqx.filter_checkpoint", None),
    ("jax.shard_map", "lax.scan", None),
]
for _outer, _inner, _error in NESTED:
    _o, _i = BOUNDARIES[_outer], BOUNDARIES[_inner]
    BOUNDARIES[f"{_outer}/{_inner}"] = Boundary(
        (lambda o, i: lambda f: o.wrap(i.wrap(f)))(_o, _i),
        parts=_o.parts * _i.parts,
        error=_error,
        # A scan inside shard_map halves each device's rows, not the batch.
        interleaved=_outer.startswith("jax.shard_map") and _i.parts > 1,
    )

MULTIDEVICE = {name for name in BOUNDARIES if "shard_map" in name}


# ----------------------------------------------------------------------------------------
# Use patterns: how the uses make up one step. `build(use)` (with `use` the entry point's
# use wrapped in the boundary) gives `step(model, data) -> (gradient, uses)`: the step's
# gradient, and the `(x, output gradient)` of every use, from which the reference is
# built. The model is `{"used": ..., "spare": ...}`; nothing uses the spare.


@dataclasses.dataclass(frozen=True)
class Pattern:
    name: str
    build: Callable
    wrap_model: Callable = lambda entry_name, layer: layer  # the "used" part of the model
    used_layer: Callable = lambda used: used  # the FP8 layer inside the "used" part


def _pairs(d):
    return [(d["x1"], d["g1"]), (d["x2"], d["g2"])]


def _twice(f):
    @eqx.filter_jit
    def step(m, d):
        loss = lambda m: sum(jnp.sum(f(m["used"], x) * g) for x, g in _pairs(d))  # noqa: E731
        return eqx.filter_grad(loss)(m), _pairs(d)

    return step


def _chained(f):
    # y = use(use(x)): the second use sees the first's output. Its input, and the first
    # use's output gradient (through a zero probe), come from the step itself.
    @eqx.filter_jit
    def step(m, d):
        def loss(mp):
            m, probe = mp
            y1 = f(m["used"], d["x1"]) + probe
            return jnp.sum(f(m["used"], y1) * d["g2"]), y1

        (grads, g_y1), y1 = eqx.filter_grad(loss, has_aux=True)((m, jnp.zeros_like(d["x1"])))
        return grads, [(d["x1"], g_y1), (y1, d["g2"])]

    return step


def _tied(f):
    # Two modules tied with `eqx.nn.Shared`: the second is the first.
    @eqx.filter_jit
    def step(m, d):
        def loss(m):
            first, second = m["used"]()
            (x1, g1), (x2, g2) = _pairs(d)
            return jnp.sum(f(first, x1) * g1) + jnp.sum(f(second, x2) * g2)

        return eqx.filter_grad(loss)(m), _pairs(d)

    return step


def _first(pair):
    return pair[0]


def _second(pair):
    return pair[1]


@functools.cache
def _shared(entry_name: str):
    layer = _model(entry_name, False)["used"]
    twin = jtu.tree_map(lambda x: x, layer)  # same structure, a distinct node to replace
    return eqx.nn.Shared((layer, twin), where=_second, get=_first)


def _tie(entry_name: str, layer):
    # One `Shared` per entry point with `layer` put in: its `SharedNode` placeholder
    # compares by identity, so a new `Shared` would compile the step again.
    return eqx.tree_at(lambda s: _first(s.pytree), _shared(entry_name), layer)


def _loop(f):
    # `lax.fori_loop` over the uses (a scan: reverse-differentiable), the layer closed over.
    @eqx.filter_jit
    def step(m, d):
        xs, gs = (jnp.stack(t) for t in zip(*_pairs(d)))

        def loss(m):
            return lax.fori_loop(0, 2, lambda i, acc: acc + jnp.sum(f(m["used"], xs[i]) * gs[i]), jnp.float32(0))

        return eqx.filter_grad(loss)(m), _pairs(d)

    return step


def _carried(f):
    # The layer's arrays as the carry of a `lax.scan` over the uses, returned unchanged.
    @eqx.filter_jit
    def step(m, d):
        xs, gs = (jnp.stack(t) for t in zip(*_pairs(d)))

        def loss(m):
            dyn, static = eqx.partition(m["used"], eqx.is_array)

            def body(carry, xg):
                dyn_c, total = carry
                return (dyn_c, total + jnp.sum(f(eqx.combine(dyn_c, static), xg[0]) * xg[1])), None

            return lax.scan(body, (dyn, jnp.float32(0)), (xs, gs))[0][1]

        return eqx.filter_grad(loss)(m), _pairs(d)

    return step


def _one_use_loss(f):
    def loss(m, x, g):
        return jnp.sum(f(m["used"], x) * g)

    return loss


def _microbatched(f):
    # `fp8ax.microbatched`: one `filter_grad` per microbatch inside a scan, merged.
    grad_fn = eqx.filter_jit(fp8ax.microbatched(eqx.filter_grad(_one_use_loss(f)), 2))

    def step(m, d):
        x, g = (jnp.concatenate(t) for t in zip(*_pairs(d)))
        return grad_fn(m, x, g), _pairs(d)

    return step


def _accumulated(f):
    # `fp8ax.accumulate_gradients` over separately computed microbatch gradients.
    grad_fn = eqx.filter_jit(eqx.filter_grad(_one_use_loss(f)))

    def step(m, d):
        acc = None
        for x, g in _pairs(d):
            acc = fp8ax.accumulate_gradients(acc, grad_fn(m, x, g))
        return acc, _pairs(d)

    return step


PATTERNS = {
    p.name: p
    for p in [
        Pattern("twice", _twice),
        Pattern("chained", _chained),
        Pattern("tied", _tied, wrap_model=_tie, used_layer=lambda shared: _first(shared.pytree)),
        Pattern("loop", _loop),
        Pattern("carried", _carried),
        Pattern("microbatched", _microbatched),
        Pattern("accumulate_gradients", _accumulated),
    ]
}


@functools.cache
def _step(entry_name: str, boundary: str, pattern_name: str):
    """The case's step, built once: fresh and trained models, clean and NaN data share
    its compiled program (they are arguments)."""
    return PATTERNS[pattern_name].build(BOUNDARIES[boundary].wrap(ENTRIES[entry_name].use))


# ----------------------------------------------------------------------------------------
# Data, models and the reference.


def data_for(seed: int, nan: bool = False) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    # The second input is larger (it sets the lhs amax), the first gradient is larger
    # (it sets the grad amax): the max is neither "the last use" nor "the first".
    d = {
        "x1": jax.random.normal(k[0], (N, D)),
        "x2": 5 * jax.random.normal(k[1], (N, D)),
        "g1": 3 * jax.random.normal(k[2], (N, D)),
        "g2": jax.random.normal(k[3], (N, D)),
    }
    if nan:
        # One NaN in each part of every split a boundary makes (the two halves of the batch
        # for scan and vmap; every device's first and second row for a scan inside
        # shard_map), so the use observes nothing for its input, as one use would.
        d["x1"] = d["x1"].at[0, 0].set(jnp.nan).at[N // 2 + 1, 3].set(jnp.nan)
    return d


def _fp8(tree):
    """The FP8 part of a gradient tree or model: {path: array} of every state leaf."""
    overwrite, _ = fp8ax.partition_for_grad_overwrite(tree)
    return {jtu.keystr(p): np.asarray(v) for p, v in jtu.tree_leaves_with_path(eqx.filter(overwrite, eqx.is_array))}


@functools.cache
def _model(entry_name: str, trained: bool):
    """`{"used": layer, "spare": layer}`; trained: one step on other data, so the
    histories are filled and the step's scales come from them."""
    entry = ENTRIES[entry_name]
    k1, k2, k3, k4 = jax.random.split(jax.random.key(7), 4)
    model = {"used": entry.make(k1), "spare": entry.make(k2)}
    if trained:
        x0 = 2 * jax.random.normal(k3, (N, D))
        g0 = jax.random.normal(k4, (N, D))

        def loss(m):
            return jnp.sum(entry.use(m["used"], x0) * g0) + jnp.sum(entry.use(m["spare"], -x0) * g0)

        overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_jit(eqx.filter_grad(loss))(model))
        model = fp8ax.apply_updates(model, None, overwrite)
    return model


@functools.cache
def _single_use_grad(entry_name: str):
    entry = ENTRIES[entry_name]

    @eqx.filter_jit
    def grad(model, x, g):
        return eqx.filter_grad(lambda m: jnp.sum(entry.use(m["used"], x) * g))(model)

    return grad


def _split(uses, b: Boundary):
    """Each `(x, g)` use as the `b.parts` uses boundary `b` makes of it: the halves of the
    batch, or (`b.interleaved`) each device's first rows and its second rows."""

    def parts(a):
        if b.interleaved:
            local = a.reshape(len(jax.devices()), b.parts, -1, *a.shape[1:])
            return [local[:, i].reshape(-1, *a.shape[1:]) for i in range(b.parts)]
        return jnp.split(a, b.parts)

    return [pair for x, g in uses for pair in zip(parts(x), parts(g))]


def merged_reference(entry_name: str, model, uses) -> dict:
    """The elementwise max of the states each use records alone, at the top level."""
    states = [_fp8(_single_use_grad(entry_name)(model, x, g)) for x, g in uses]
    return {k: functools.reduce(np.maximum, [s[k] for s in states]) for k in states[0]}


def concatenated_reference(entry_name: str, model, uses) -> dict:
    """The state of one use on all the inputs at once."""
    x = jnp.concatenate([x for x, _ in uses])
    g = jnp.concatenate([g for _, g in uses])
    return _fp8(_single_use_grad(entry_name)(model, x, g))


def _assert_equal(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=f"{what}: {k}")


def _spare(key: str) -> bool:
    return key.startswith("['spare']")


def run_case(entry_name: str, boundary: str, pattern_name: str, trained: bool, nan: bool = False) -> None:
    """Runs one case; raises AssertionError (naming what differs) if it fails."""
    entry, pattern, b = ENTRIES[entry_name], PATTERNS[pattern_name], BOUNDARIES[boundary]
    plain = _model(entry_name, trained)
    model = {"used": pattern.wrap_model(entry_name, plain["used"]), "spare": plain["spare"]}
    data = data_for(0, nan)
    step = _step(entry_name, boundary, pattern_name)
    if b.error is not None:
        try:
            step(model, data)
        except ValueError as e:
            assert b.error in str(e) and str(e).startswith("fp8ax: "), f"another error: {e}"
            return
        raise AssertionError(f"no error for {boundary}: fp8ax must refuse it ({b.error!r})")
    grads, uses = step(model, data)
    # The case's trees in the plain model's shape (a tied model holds its layer once).
    as_plain = lambda t: {"used": pattern.used_layer(t["used"]), "spare": t["spare"]}  # noqa: E731

    got = _fp8(as_plain(grads))
    for k, v in got.items():
        assert np.all(np.isfinite(v)), f"non-finite FP8 state at {k}: {v}"
        assert not (_spare(k) and np.any(v)), f"the unused layer's state gradient is not zero at {k}"
    if not nan:  # (a NaN input gives NaN gradients, as without FP8)
        _, real = fp8ax.partition_for_grad_overwrite(grads)
        for leaf in jtu.tree_leaves(eqx.filter(real, eqx.is_array)):
            assert np.all(np.isfinite(np.asarray(leaf))), "a non-finite parameter gradient"
    want = merged_reference(entry_name, plain, _split(uses, b))
    _assert_equal(got, want, "new state vs the max of the uses alone")
    if entry.one_layer and not nan:
        _assert_equal(want, concatenated_reference(entry_name, plain, uses), "max of the uses vs one use of them all")

    # After the update: the used layer holds the merged state, the spare its old one.
    overwrite, _ = fp8ax.partition_for_grad_overwrite(grads)
    updated = _fp8(as_plain(_apply(model, overwrite)))
    want_tree = jtu.tree_unflatten(jtu.tree_structure(_fp8_tree(plain)), [jnp.asarray(want[k]) for k in want])
    _assert_equal(updated, _fp8(_apply(plain, want_tree)), "state after fp8ax.apply_updates")
    before = _fp8(plain)
    for k in before:
        if _spare(k):
            np.testing.assert_array_equal(updated[k], before[k], err_msg=f"the unused layer's state changed at {k}")


@eqx.filter_jit
def _apply(model, overwrite):
    return fp8ax.apply_updates(model, None, overwrite)


def _fp8_tree(model):
    overwrite, _ = fp8ax.partition_for_grad_overwrite(model)
    return eqx.filter(overwrite, eqx.is_array)


# ----------------------------------------------------------------------------------------
# Which cases run.


def cases(multidevice: bool) -> list[tuple[str, str, str]]:
    """`(entry point, boundary, pattern)` of every case:

    - every single boundary with every entry point for pattern "twice", and with every
      pattern for the direct entry point (`dot_general`), except where a similar
      boundary makes that sweep (`TWICE_ONLY`);
    - every nested pair with pattern "twice", for `dot_general` and `hax_linear` (the
      entry point of the regression this matrix exists for);
    - every pattern with every entry point under `eqx.filter_checkpoint` (remat, which
      every large model uses, around a `filter_jit`-like trace of its own), except
      `hax_moe`, whose op `ragged_dot` makes that sweep.

    A boundary that must raise is checked with pattern "twice". (The selection keeps the
    two CI runs inside their time budget; every axis is covered in full at least once.)"""
    out = []
    for boundary, b in BOUNDARIES.items():
        if (boundary in MULTIDEVICE) != multidevice:
            continue
        nested = "/" in boundary
        for entry in ENTRIES:
            for pattern in PATTERNS:
                if nested:
                    keep = pattern == "twice" and entry in NESTED_ENTRIES
                else:
                    full = (entry == "dot_general" and boundary not in TWICE_ONLY) or (
                        boundary in FULL_BOUNDARIES and entry != "hax_moe"  # ragged_dot's sweep covers its op
                    )
                    keep = pattern == "twice" or (full and b.error is None)
                if keep:
                    out.append((entry, boundary, pattern))
    return out


FULL_BOUNDARIES = ("eqx.filter_checkpoint",)
NESTED_ENTRIES = ("dot_general", "hax_linear")
# Boundaries whose every-pattern sweep another one already makes (eqx.filter_jit: jax.jit;
# eqx.filter_vmap: jax.vmap; lax.switch: lax.cond; the policy and the checkpointed scan
# bodies: jax.checkpoint and lax.scan): pattern "twice" only.
TWICE_ONLY = (
    "eqx.filter_jit",
    "eqx.filter_vmap",
    "lax.switch",
    "jax.checkpoint(everything_saveable)",
    "lax.scan(checkpoint)",
    "lax.scan(checkpoint(save_anything_except_these_names))",
)


def case_id(case) -> str:
    return "-".join(case)


def run_all(entry_name: str, boundary: str, pattern_name: str) -> None:
    """One case from a fresh model (the step calibrates) and a trained one (delayed
    scaling), each with clean inputs and with a NaN in the first use's input."""
    for trained in (False, True):
        for nan in (False, True):
            try:
                run_case(entry_name, boundary, pattern_name, trained, nan)
            except AssertionError as e:
                raise AssertionError(
                    f"{'trained' if trained else 'fresh'} model{', NaN input' if nan else ''}: {e}"
                ) from e
            if BOUNDARIES[boundary].error is not None:
                return  # the error does not depend on the data


def main(out_path: str, chunk: int = 0, chunks: int = 1) -> None:
    """Runs one chunk of the multi-device cases (8 CPU devices) and writes
    `{case id: "ok" | "skipped: ..." | traceback}`."""
    from conftest import hax_dot_failure

    assert len(jax.devices()) == 8, jax.devices()
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    warnings.filterwarnings("ignore", "fp8ax. the same FP8 layer has found its amax history empty")
    results = {}
    for case in cases(multidevice=True)[chunk::chunks]:
        if ENTRIES[case[0]].haliax and (why := hax_dot_failure()) is not None:
            results[case_id(case)] = f"skipped: named-axis hax.dot fails here ({why})"
            continue
        try:
            run_all(*case)
            results[case_id(case)] = "ok"
        except Exception:  # noqa: BLE001 (reported per case)
            results[case_id(case)] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
