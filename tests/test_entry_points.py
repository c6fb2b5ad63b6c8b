"""Every way a user hands a converted model to JAX trains it as the plain loop does.

Beside the reuse matrix (test_reuse_matrix.py: a layer used several times behind a
boundary), this is the matrix of what happens to the *model* between steps: placed on
devices, carried through `lax.scan`, saved and restored, mapped, split over an ensemble or
passed into `jax.shard_map`. Each turns every Python scalar of a pytree into an array, so
a converted model must have no leaf that is not an array (a regression once made
`Fp8DotGeneral` hold a Python float that these turned into an array, and the README's
step then failed inside optax). Each case builds the optimizer state as the README does,
`opt.init(eqx.filter(model, eqx.is_array))`, trains three steps of the README's step
through the entry point, and compares every leaf of the model and the optimizer state
with three steps of a plain Python loop: bit for bit where both run the same program,
else to the tolerance written at the case.
"""

import functools
import io

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fp8ax

Batch, In, Mid, Out = hax.Axis("batch", 64), hax.Axis("in", 32), hax.Axis("mid", 128), hax.Axis("out", 8)
STEPS = 3


class HaliaxMLP(eqx.Module):  # the README's model
    up_proj: hax.nn.Linear
    down_proj: hax.nn.Linear

    def __call__(self, x):
        return self.down_proj(hax.nn.relu(self.up_proj(x)))


class EquinoxMLP(eqx.Module):  # no function leaf (eqx.nn.MLP holds its activation), so it can be a carry
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda r: self.down_proj(jax.nn.relu(self.up_proj(r))))(x)


def _task(kind, key):
    k_up, k_down, k_x, k_y = jax.random.split(key, 4)
    if kind == "haliax":
        model = HaliaxMLP(hax.nn.Linear.init(In, Mid, key=k_up), hax.nn.Linear.init(Mid, Out, key=k_down))
        xs = hax.random.normal(k_x, (hax.Axis("step", STEPS), Batch, In))
        ys = hax.random.normal(k_y, (hax.Axis("step", STEPS), Batch, Out))

        def loss_fn(model, x, y):
            return hax.mean((model(x) - y) ** 2).scalar()

        batch = lambda i: (xs["step", i], ys["step", i])  # noqa: E731
    else:
        model = EquinoxMLP(eqx.nn.Linear(In.size, Mid.size, key=k_up), eqx.nn.Linear(Mid.size, Out.size, key=k_down))
        xs = jax.random.normal(k_x, (STEPS, Batch.size, In.size))
        ys = jax.random.normal(k_y, (STEPS, Batch.size, Out.size))

        def loss_fn(model, x, y):
            return jnp.mean((model(x) - y) ** 2)

        batch = lambda i: (xs[i], ys[i])  # noqa: E731
    return fp8ax.fp8_linear_layers(model), loss_fn, xs, ys, batch


OPT = optax.adam(1e-3)


def _step_fn(loss_fn, reduce=None):
    def step(model, opt_state, x, y):  # the README's step
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        if reduce is not None:
            grads = reduce(grads)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
            updates, opt_state = OPT.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    return step


def _init(model):
    with jax.numpy_dtype_promotion("standard"):
        return OPT.init(eqx.filter(model, eqx.is_array))


@functools.cache
def _jitted_step(loss_fn):
    # One compiled step per task, shared by the loop and the entry points that run it.
    return eqx.filter_jit(_step_fn(loss_fn))


def _loop(model, opt_state, loss_fn, batch, start=0, stop=STEPS):
    step = _jitted_step(loss_fn)
    for i in range(start, stop):
        model, opt_state = step(model, opt_state, *batch(i))
    return model, opt_state


def _assert_same(got, want, rtol=0.0):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        if rtol:
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.max(np.abs(b), initial=0)))
        else:
            np.testing.assert_array_equal(a, b)


def _fp8_written(model):
    fp8ax.check_state(model, written=True)  # every layer's state was written, none corrupt


def _device_put(model, opt_state, loss_fn, xs, ys, batch):
    return _loop(*jax.device_put((model, opt_state)), loss_fn, batch)


def _tree_map_asarray(model, opt_state, loss_fn, xs, ys, batch):
    model = jax.tree.map(jnp.asarray, model)
    opt_state = jax.tree.map(jnp.asarray, opt_state)
    return _loop(model, opt_state, loss_fn, batch)


def _scan_carry(model, opt_state, loss_fn, xs, ys, batch):
    step = _step_fn(loss_fn)
    is_named = isinstance(xs, hax.NamedArray)

    @jax.jit
    def scanned(model, opt_state, xs, ys):
        def body(carry, xy):
            x, y = xy
            if is_named:  # scan over the raw arrays, named again in the body
                x, y = hax.named(x, (Batch, In)), hax.named(y, (Batch, Out))
            return step(*carry, x, y), None

        return jax.lax.scan(body, (model, opt_state), (xs, ys))[0]

    if is_named:
        xs, ys = xs.array, ys.array
    return scanned(model, opt_state, xs, ys)


def _serialise_and_continue(model, opt_state, loss_fn, xs, ys, batch, *, fresh):
    model, opt_state = _loop(model, opt_state, loss_fn, batch, 0, 1)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, (model, opt_state))
    buf.seek(0)
    template = (fresh, _init(fresh))
    model, opt_state = eqx.tree_deserialise_leaves(buf, template)
    return _loop(model, opt_state, loss_fn, batch, 1, STEPS)


def _orbax_and_continue(model, opt_state, loss_fn, xs, ys, batch, *, fresh, path):
    import orbax.checkpoint as ocp

    model, opt_state = _loop(model, opt_state, loss_fn, batch, 0, 1)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, {"model": eqx.filter(model, eqx.is_array), "opt_state": opt_state})
    ckptr.wait_until_finished()
    fresh_opt = _init(fresh)
    abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), t)  # noqa: E731
    like = {"model": abstract(eqx.filter(fresh, eqx.is_array)), "opt_state": abstract(fresh_opt)}
    fp8ax.check_checkpoint_metadata(ckptr.metadata(path).item_metadata, like)
    restored = ckptr.restore(path, like)
    model = eqx.combine(restored["model"], fresh)
    return _loop(model, restored["opt_state"], loss_fn, batch, 1, STEPS)


def _shard_map(model, opt_state, loss_fn, xs, ys, batch):
    # The model and the optimizer state are arguments of `jax.shard_map`, replicated; the
    # batch is split over every device there is (one in the main test run: the entry
    # point is the same, and test_reuse_matrix.py's 8-device cases cover the collectives).
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    step = _step_fn(loss_fn, reduce=lambda g: fp8ax.pmean_gradients(g, "data"))
    is_named = isinstance(xs, hax.NamedArray)

    def sharded_step(model, opt_state, x, y):
        if is_named:
            x, y = hax.named(x, (Batch, In)), hax.named(y, (Batch, Out))
        return step(model, opt_state, x, y)

    run = jax.jit(
        jax.shard_map(sharded_step, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P()))
    )
    for i in range(STEPS):
        x, y = batch(i)
        if is_named:
            x, y = x.array, y.array
        model, opt_state = run(model, opt_state, x, y)
    return model, opt_state


# Where the entry point runs the very step the loop compiles (or the scan body compiles
# to the same bits, checked here). `shard_map` compiles another program (its `pmean`
# included), which XLA:CPU may sum in another order: measured differences of 1 ulp in
# the weights (rtol 1.2e-6), none in the FP8 state.
SAME_PROGRAM = ("device_put", "tree_map_asarray", "scan_carry", "tree_deserialise_leaves", "orbax_restore")

ENTRY_POINTS = {
    "device_put": _device_put,
    "tree_map_asarray": _tree_map_asarray,
    "scan_carry": _scan_carry,
    "tree_deserialise_leaves": _serialise_and_continue,
    "orbax_restore": _orbax_and_continue,
    "shard_map": _shard_map,
}


def _params(kind):
    marks = [pytest.mark.needs_hax_dot] if kind == "haliax" else []
    return [pytest.param(kind, name, id=f"{kind}-{name}", marks=marks) for name in ENTRY_POINTS]


@functools.cache
def _reference(kind):
    """The task of `kind` and three steps of the plain loop on it (shared by the cases of
    one process: the loop's compile is most of a case's time)."""
    key = jax.random.key(0)
    model, loss_fn, xs, ys, batch = _task(kind, key)
    opt_state = _init(model)
    return key, model, opt_state, loss_fn, xs, ys, batch, _loop(model, opt_state, loss_fn, batch)


@pytest.mark.parametrize("kind, entry", _params("haliax") + _params("equinox"))
def test_the_readme_step_trains_through_every_entry_point(kind, entry, tmp_path):
    key, model, opt_state, loss_fn, xs, ys, batch, want = _reference(kind)
    # Nothing in a converted model is anything but an array (static fields aside).
    assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(model))
    kwargs = {}
    if entry in ("tree_deserialise_leaves", "orbax_restore"):
        kwargs["fresh"] = _task(kind, jax.random.fold_in(key, 1))[0]  # another initialization as the template
    if entry == "orbax_restore":
        kwargs["path"] = tmp_path / "ckpt"
    got = ENTRY_POINTS[entry](model, opt_state, loss_fn, xs, ys, batch, **kwargs)
    _fp8_written(got[0])
    if entry in SAME_PROGRAM:
        _assert_same(got, want)
    else:  # another program: the FP8 state bit for bit, the rest to float32 rounding
        (fp8_got, rest_got), (fp8_want, rest_want) = (fp8ax.partition_for_grad_overwrite(t) for t in (got, want))
        _assert_same(fp8_got, fp8_want)
        _assert_same(rest_got, rest_want, rtol=1e-5)


def test_an_ensemble_under_filter_vmap_trains_as_its_members_alone(getkey):
    # `eqx.filter_vmap` over an ensemble turns each member's leaves into one batched
    # array. The ensemble's step (one optimizer over all members) equals each member's own
    # step: the FP8 state bit for bit; weights and Adam moments to float32 rounding
    # (rtol 1e-6: vmap batches the GEMMs, which XLA:CPU may sum in another order).
    n = 3
    keys = jax.random.split(getkey(), n)
    data_key = getkey()
    members = [_task("equinox", k)[0] for k in keys]
    _, loss_fn, xs, ys, _ = _task("equinox", data_key)
    ens = jax.tree.map(lambda *a: jnp.stack(a), *members)
    assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(ens))

    def ens_loss(ens, x, y):
        return jnp.sum(eqx.filter_vmap(loss_fn, in_axes=(eqx.if_array(0), None, None))(ens, x, y))

    opt_state = _init(ens)
    step = eqx.filter_jit(_step_fn(ens_loss))
    for i in range(STEPS):
        ens, opt_state = step(ens, opt_state, xs[i], ys[i])
    _fp8_written(ens)
    for j, member in enumerate(members):
        want, _ = _loop(member, _init(member), loss_fn, lambda i: (xs[i], ys[i]))
        got = jax.tree.map(lambda a: a[j], ens)
        fp8_got, params_got = fp8ax.partition_for_grad_overwrite(got)
        fp8_want, params_want = fp8ax.partition_for_grad_overwrite(want)
        _assert_same(fp8_got, fp8_want)
        _assert_same(params_got, params_want, rtol=1e-6)
