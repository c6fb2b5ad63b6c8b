"""Sharded FP8 training on 8 CPU devices, checked against one device.

Run by tests/test_sharding.py in a subprocess, because the device count must be set
before JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_multidevice.py OUT.json

Each case runs the same training on one device and sharded, and compares. Tolerances
(float32 rounding; the sharded program sums partial products in another order):
losses rtol 1e-5, parameters rtol 1e-5 / atol 1e-6, FP8 state rtol 1e-6. amaxes are
maxima, which do not depend on the order, so the state usually matches bit for bit.
Results go to OUT.json as {case: "ok" | traceback}.
"""

import glob
import json
import os
import re
import sys
import traceback

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import fp8ax  # noqa: E402
from helpers import Deep, In, Layers, Mid, Out  # noqa: E402
from recipe_registry import REGISTRY  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

N = 64
Batch = hax.Axis("Batch", N)
DUMP = os.environ.get("FP8AX_HLO_DUMP")  # XLA dumps the partitioned HLO of `*gather_probe*` here
STEPS = 3
LR = 0.1


def _data(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = hax.random.normal(k1, (Batch, In))
    y = hax.random.normal(k2, (Batch, Out))
    return x, y


def _loss(model, x, y):
    return hax.mean((model(x) - y) ** 2).scalar()


def _step(model, x, y):
    loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    return loss, fp8ax.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads), overwrite)


def _model(config=None):
    return fp8ax.fp8_linear_layers(Deep.init(key=jax.random.key(42)), config)


def _train_single(model, x, y):
    step = eqx.filter_jit(_step)
    losses = []
    for _ in range(STEPS):
        loss, model = step(model, x, y)
        losses.append(float(loss))
    return losses, model


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))


# Haliax axis mappings: (compute, parameters). The compute mapping lays out activations
# and the weights as the GEMMs use them; the parameter mapping is how weights are stored.
LAYOUTS = {
    "data_parallel": ({"Batch": "data"}, {}),
    "fsdp": ({"Batch": "data"}, {"Mid": "data"}),
    "tensor_parallel": ({"Batch": "data", "Mid": "model"}, {"Mid": "model"}),
    "fsdp_tp": ({"Batch": "data", "Mid": "model"}, {"In": "data", "Mid": "model"}),
}


def _train_sharded(model, x, y, compute, params, name="step"):
    with hax.partitioning.set_mesh(_mesh()):
        model = hax.shard(model, params)
        x, y = hax.shard(x, compute), hax.shard(y, compute)

        def fn(model, x, y):
            return _step(model, x, y)

        fn.__name__ = name  # names the jitted module (the HLO dump filter matches on it)
        step = hax.named_jit(fn, axis_resources=compute, out_axis_resources=params)
        losses = []
        for _ in range(STEPS):
            loss, model = step(model, x, y)
            losses.append(float(loss))
        hlo = step.lower(model, x, y).compile().as_text()
    return losses, model, hlo


def _states(model):
    overwrite, _ = fp8ax.partition_for_grad_overwrite(model)
    return jax.tree_util.tree_leaves_with_path(eqx.filter(overwrite, eqx.is_array))


def _compare(single, sharded):
    (l1, m1), (l2, m2) = single, sharded
    np.testing.assert_allclose(l2, l1, rtol=1e-5)
    s1, p1 = fp8ax.partition_for_grad_overwrite(m1)
    s2, p2 = fp8ax.partition_for_grad_overwrite(m2)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p2), jax.tree.leaves(p1), strict=True):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(s2), jax.tree.leaves(s1), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=jax.tree_util.keystr(path))


def _collectives(hlo: str) -> list[tuple[str, str]]:
    out = []
    for line in hlo.splitlines():
        m = re.search(
            r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line
        )
        if m:
            out.append((m.group(2), m.group(1)))
    return out


def _layout_case(name):
    def case():
        x, y = _data()
        compute, params = LAYOUTS[name]
        single = _train_single(_model(), x, y)
        losses, model, hlo = _train_sharded(_model(), x, y, compute, params)
        _compare(single, (losses, model))
        # The parameters really are laid out as asked.
        w = model.blocks.stacked.mlp.up_proj.weight
        spec = w.array.sharding.spec
        want = tuple(params.get(ax.name) for ax in w.axes)
        assert tuple(spec) + (None,) * (len(want) - len(spec)) == want, (spec, want)
        # FP8 state: replicated, and never gathered. The only collectives on state-sized
        # values are scalar all-reduce(max)es of amaxes (plus XLA's combined tuples).
        for path, leaf in _states(model):
            assert leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path)
        hist_shapes = {f"f32[{Layers.size},1024]", "f32[1024]"}
        for kind, shape in _collectives(hlo):
            if kind == "all-gather":
                assert not any(s in shape for s in hist_shapes), (kind, shape)
        return {"losses": losses, "collectives": _collectives(hlo)}

    return case


def case_global_amax():
    # The max lives on one shard only (the last 8 rows of the batch go to the last
    # data shard): the recorded amax is still the global one, on every device.
    x, y = _data(1)
    x = hax.NamedArray(x.array.at[N - 3, 5].set(50.0), x.axes)
    compute, params = LAYOUTS["fsdp_tp"]
    _, model, _ = _train_sharded(_model(), x, y, compute, params)
    state = model.blocks.stacked.mlp.up_proj.dot_general.lhs
    assert float(state.amax_history[0, 0]) == 50.0, float(state.amax_history[0, 0])
    data = jax.tree.leaves(state)[0]  # the stored array, as the step left it on the devices
    for shard in data.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(data))
    single = _train_single(_model(), x, y)[1].blocks.stacked.mlp.up_proj.dot_general.lhs
    np.testing.assert_array_equal(np.asarray(data), np.asarray(jax.tree.leaves(single)[0]))


def _gathers_after_partitioning(name):
    files = sorted(glob.glob(os.path.join(DUMP, f"*{name}*after_spmd-partitioning*.txt")))
    assert files, f"no partitioned HLO dumped for {name} in {DUMP}"
    gathers = []
    for line in open(files[-1]):
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", line)
        if m:
            gathers.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)))
    return gathers


_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4}


def case_fp8_all_gather():
    # FSDP with bf16 weights, in "qdq" mode (which would gather the dequantized bf16
    # weight) and "direct" mode, with and without `fp8_all_gather`. The partitioned HLO
    # (before XLA:CPU widens FP8 collectives to f16, its runtime having none) shows the
    # dtype each weight all-gather moves.
    x, y = _data(2)
    compute, params = LAYOUTS["fsdp"]
    weight_shapes = {
        (Layers.size, Mid.size, In.size),
        (Layers.size, In.size, Mid.size),
        (Mid.size, In.size),
        (In.size, Mid.size),
    }
    report = {}
    losses = {}
    for mode in ("qdq", "direct"):
        for flag in (False, True):
            name = f"{mode}_{'fp8' if flag else 'plain'}_gather_probe"
            cfg = fp8ax.Fp8Config(mode=mode, fp8_all_gather=flag)
            model = fp8ax.cast_floating(_model(cfg), jnp.bfloat16)
            xb, yb = x.astype(jnp.bfloat16), y.astype(jnp.bfloat16)
            losses[name], _, _ = _train_sharded(model, xb, yb, compute, params, name=name)
            gathers = [
                (dt, shape)
                for dt, shape in _gathers_after_partitioning(name)
                if shape[-2:] in {s[-2:] for s in weight_shapes}
            ]
            assert gathers, name
            dtypes = {dt for dt, _ in gathers}
            nbytes = sum(_BYTES[dt] * int(np.prod(shape)) for dt, shape in gathers)
            report[name] = {"dtypes": sorted(dtypes), "gathered_weight_bytes_per_device": nbytes}
            if flag or mode == "direct":
                assert dtypes == {"f8e4m3fn"}, (name, gathers)
            else:
                assert dtypes == {"bf16"}, (name, gathers)
        # The flag changes where the weight is gathered, not what is computed.
        np.testing.assert_allclose(losses[f"{mode}_fp8_gather_probe"], losses[f"{mode}_plain_gather_probe"], rtol=1e-6)
        # At least half the bytes: 1 byte per element instead of 2, and the FP8 weight
        # gathered for the forward GEMM is kept for the backward one.
        plain, fp8 = (report[f"{mode}_{k}_gather_probe"]["gathered_weight_bytes_per_device"] for k in ("plain", "fp8"))
        assert fp8 * 2 <= plain, report
    return report


def _eqx_model():
    return fp8ax.fp8_linear_layers(eqx.nn.MLP(16, 8, 32, 1, key=jax.random.key(7)))


def _eqx_loss(model, x, y):
    h = jax.nn.relu(model.layers[0](x))
    return jnp.mean((model.layers[1](h) - y) ** 2)


def _eqx_loss_x8(model, x, y):
    # A device's mean loss, seen from one device holding the whole batch: with 8 devices
    # each output gradient of a per-device mean loss is 8x the whole-batch mean's.
    return 8 * _eqx_loss(model, x, y)


def _shard_map_grads(check_vma: bool, reduce, trained: bool = False):
    mesh = jax.make_mesh((8,), ("data",))
    model = _eqx_model()
    k1, k2 = jax.random.split(jax.random.key(3))
    x = jax.random.normal(k1, (N, 16)).at[N - 2, 4].set(30.0)  # the max on the last shard
    y = jax.random.normal(k2, (N, 8))
    if trained:  # one step first, so the scales come from the history
        overwrite, _ = fp8ax.partition_for_grad_overwrite(eqx.filter_grad(_eqx_loss_x8)(model, 0.5 * x, y))
        model = fp8ax.apply_updates(model, None, overwrite)
    params, static = eqx.partition(model, eqx.is_array)

    def per_device(p, x, y):
        grads = eqx.filter_grad(_eqx_loss)(eqx.combine(p, static), x, y)
        return eqx.filter(reduce(grads), eqx.is_array)

    fn = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=check_vma)
    )
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    got = fn(put(params, P()), put(x, P("data")), put(y, P("data")))
    return model, x, y, eqx.combine(got, static)


def _shard_map_case(check_vma, trained):
    # With check_vma, fp8ax sees that the batch is split and takes the global amax even
    # for a fresh model's first-step calibration. Without it, each device would calibrate
    # its first step on its own shard; from the second step on the scales come from the
    # merged history, so that case starts from a trained model.
    def case():
        model, x, y, got = _shard_map_grads(check_vma, lambda g: fp8ax.pmean_gradients(g, "data"), trained)
        # Independent expectation: one device with the whole batch. Gradients: those of
        # the whole-batch mean loss (= the 8x loss's / 8, exactly: a power of two).
        # State: what the backward GEMMs quantized, the gradients of a per-device mean
        # loss, i.e. the 8x loss's.
        ref = eqx.filter(eqx.filter_grad(_eqx_loss_x8)(model, x, y), eqx.is_array)
        g_state, g_rest = fp8ax.partition_for_grad_overwrite(eqx.filter(got, eqx.is_array))
        r_state, r_rest = fp8ax.partition_for_grad_overwrite(ref)
        for a, b in zip(jax.tree.leaves(g_rest), jax.tree.leaves(r_rest), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b) / 8, rtol=1e-5, atol=1e-6)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_state), jax.tree.leaves(r_state), strict=True):
            where = jax.tree_util.keystr(path)
            if ".rhs." in where or where.startswith(".layers[0].dot_general.lhs"):
                # The weights and the model input: exactly the whole batch's (the global
                # max of x lives on one shard).
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
            else:
                # Tensors computed by a GEMM: per-device GEMMs round differently.
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=where)
        assert float(g_state.layers[0].dot_general.lhs.amax_history[0]) == 30.0

    return case


def case_shard_map_pmean_or_psum_of_state_is_wrong():
    # Regression: reducing the whole tree (state included) the way ordinary gradients
    # are reduced. Without check_vma nothing merges the state for you.
    def reduce_with(op):
        return lambda g: jax.tree.map(lambda a: op(a, "data"), g)

    model, x, y, mean = _shard_map_grads(False, reduce_with(jax.lax.pmean))
    _, _, _, summed = _shard_map_grads(False, reduce_with(jax.lax.psum))
    _, _, _, ours = _shard_map_grads(False, lambda g: fp8ax.pmean_gradients(g, "data"))
    amax = lambda g: float(g.layers[0].dot_general.lhs.amax_history[0])  # noqa: E731
    scale = lambda g: float(g.layers[0].dot_general.rhs.scale)  # noqa: E731
    unit = lambda g: float(g.layers[0].dot_general.rhs.unit)  # noqa: E731
    assert amax(ours) == 30.0
    assert amax(mean) < 30.0  # the mean of the shard maxima
    # A psum adds the state's units too (8 devices): the state reads as the mean of the
    # shards' states, so the weight's (the same on every shard) is right, and an
    # activation's amax is the mean of the shard maxima, below the global max.
    assert unit(summed) == 8.0 and unit(ours) == 1.0
    np.testing.assert_allclose(scale(summed), scale(ours), rtol=1e-6)
    assert amax(summed) < 30.0
    return {
        "global_amax": amax(ours),
        "pmean_amax": amax(mean),
        "psum_amax": amax(summed),
    }


def case_eager_shard_map_no_check_vma_refuses():
    # Un-jitted `shard_map(..., check_vma=False)` runs op by op, where JAX cannot hold the
    # state's dtype: fp8ax's error, not JAX's internal assertion. Under jit it works
    # (`shard_map_no_check_vma`).
    mesh = Mesh(np.array(jax.devices()), ("data",))
    model = _eqx_model()
    params, static = eqx.partition(model, eqx.is_array)
    x, y = jnp.ones((N, 16)), jnp.ones((N, 8))

    def per_device(p, x, y):
        return eqx.filter(eqx.filter_grad(_eqx_loss)(eqx.combine(p, static), x, y), eqx.is_array)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=False)
    try:
        fn(params, x, y)
    except ValueError as e:
        assert str(e).startswith("fp8ax: ") and "un-jitted" in str(e), e
        return {"error": str(e).split(".")[0]}
    raise AssertionError("no error for an un-jitted shard_map(check_vma=False)")


def _recipe_case(name):
    """A recipe of the registry (tests/recipe_registry.py), trained with data, FSDP and
    tensor parallelism on 8 devices against one device."""

    def case():
        x, y = _data()
        config = fp8ax.Fp8Config(recipe=REGISTRY[name].recipe)
        single = _train_single(_model(config), x, y)
        losses, model, _ = _train_sharded(_model(config), x, y, *LAYOUTS["fsdp_tp"], name=f"step_{name}")
        if config.settings.recipe.stochastic("grad"):
            # Stochastic rounding draws its key from the gradient's bits, which a sharded
            # reduction changes in the last place: another draw, the same distribution.
            np.testing.assert_allclose(losses, single[0], rtol=2e-2)
        else:
            _compare(single, (losses, model))
        return {"losses": losses}

    return case


# A mixture-of-experts block (two `haliax.nn.MoELinear`, per-expert FP8 weight state),
# expert parallel: the experts' weights sharded over "model", the tokens over "data".
Tok, Experts, Hid = hax.Axis("Tok", 64), hax.Axis("Experts", 8), hax.Axis("Hid", 32)
EXPERT_SIZES = (12, 0, 4, 8, 16, 1, 15, 8)  # uneven, one expert without tokens


class _Moe(eqx.Module):
    up: hax.nn.MoELinear
    down: hax.nn.MoELinear

    def __call__(self, x):
        sizes = hax.named(jnp.array(EXPERT_SIZES, jnp.int32), Experts)
        return self.down(hax.nn.relu(self.up(x, sizes)), sizes)


def _moe_model():
    k1, k2 = jax.random.split(jax.random.key(7))
    plain = _Moe(hax.nn.MoELinear.init(Experts, In, Hid, key=k1), hax.nn.MoELinear.init(Experts, Hid, Out, key=k2))
    return fp8ax.fp8_linear_layers(plain)


def case_moe_expert_parallel():
    k1, k2 = jax.random.split(jax.random.key(3))
    x, y = hax.random.normal(k1, (Tok, In)), hax.random.normal(k2, (Tok, Out))

    def loss(model, x, y):
        return hax.mean((model(x) - y) ** 2).scalar()

    def step(model, x, y):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        return value, fp8ax.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads), overwrite)

    single, losses = _moe_model(), []
    jitted = eqx.filter_jit(step)
    for _ in range(STEPS):
        value, single = jitted(single, x, y)
        losses.append(float(value))
    compute, params = {"Tok": "data", "Experts": "model"}, {"Experts": "model"}
    with hax.partitioning.set_mesh(_mesh()):
        model = hax.shard(_moe_model(), params)
        xs, ys = hax.shard(x, compute), hax.shard(y, compute)
        sharded_step = hax.named_jit(step, axis_resources=compute, out_axis_resources=params)
        sharded = []
        for _ in range(STEPS):
            value, model = sharded_step(model, xs, ys)
            sharded.append(float(value))
    _compare((losses, single), (sharded, model))
    spec = model.up.weight.array.sharding.spec
    assert spec[0] == "model", spec  # the experts' weights stay sharded over "model"
    unused = np.asarray(model.up.ragged.rhs.amax_history[1])
    assert np.all(unused == 0), unused  # the expert without tokens observed nothing
    return {"losses": sharded}


def case_explicit_sharding():
    """Explicit mesh axes (JAX's sharding in types), as marin-haliax uses them when it
    passes `out_sharding`: a tensor-wise layer's value, gradients and new state equal the
    same step on one device (loss and gradients to rtol 1e-5, atol 1e-6: the sharded
    GEMMs sum in another order; the state bit for bit: a max is exact), the result has the
    sharding asked for or the operands imply, each gradient its operand's sharding; other
    recipes and the ragged dot are refused in fp8ax's words."""
    from jax.sharding import AxisType

    dims = (((1,), (0,)), ((), ()))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    k = jax.random.split(jax.random.key(11), 3)
    x0, w0, g0 = jax.random.normal(k[0], (16, 32)), jax.random.normal(k[1], (32, 8)), jax.random.normal(k[2], (16, 8))
    layouts = [  # (x, w, out_sharding, the result's spec)
        (P("data", None), P(None, "model"), None, P("data", "model")),
        (P("data", None), P(), P("data", "model"), P("data", "model")),
        # The contraction sharded on both sides (what JAX cannot decide alone).
        (P(None, "model"), P("model", None), P(), P(None, None)),
        (P("data", "model"), P("model", None), None, P("data", None)),
    ]

    def loss(dg, x, w, out_sharding=None):
        return jnp.sum(dg(x, w, dims, out_sharding=out_sharding) * g0)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    for recipe in (fp8ax.DelayedScaling(), fp8ax.CurrentScaling()):
        dg = fp8ax.Fp8DotGeneral.init(recipe)
        want = jax.jit(grad)(dg, x0, w0)
        for xs, ws, out_sharding, out_spec in layouts:
            where = f"{type(recipe).__name__} x {xs} w {ws} out_sharding {out_sharding}"
            with jax.set_mesh(mesh):
                x, w = jax.device_put(x0, NamedSharding(mesh, xs)), jax.device_put(w0, NamedSharding(mesh, ws))
                got = jax.jit(lambda d, x, w: grad(d, x, w, out_sharding))(dg, x, w)  # noqa: B023
                out = jax.jit(lambda d, x, w: d(x, w, dims, out_sharding=out_sharding))(dg, x, w)  # noqa: B023
            assert out.sharding.spec == out_spec, (where, out.sharding.spec)
            (_, (g_dg, g_x, g_w)) = got
            padded = lambda a: tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))  # noqa: E731
            assert (padded(g_x), padded(g_w)) == (padded(x), padded(w)), (where, g_x.sharding, g_w.sharding)
            g_state, g_rest = fp8ax.partition_for_grad_overwrite((got[0], g_dg, g_x, g_w))
            w_state, w_rest = fp8ax.partition_for_grad_overwrite((want[0], *want[1]))
            for a, b in zip(jax.tree.leaves(g_rest), jax.tree.leaves(w_rest), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=where)
            for a, b in zip(jax.tree.leaves(g_state), jax.tree.leaves(w_state), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)
    refused = {
        "row-wise recipe": lambda x, w: fp8ax.Fp8DotGeneral.init(fp8ax.CurrentScaling("row"))(x, w, dims),
        "ragged dot": lambda x, w: fp8ax.Fp8RaggedDot.init()(x, w[None], jnp.array([16], jnp.int32)),
    }
    for what, call in refused.items():
        with jax.set_mesh(mesh):
            x, w = (
                jax.device_put(x0, NamedSharding(mesh, P("data", None))),
                jax.device_put(w0, NamedSharding(mesh, P())),
            )
            try:
                jax.jit(call)(x, w)
            except NotImplementedError as e:
                assert str(e).startswith("fp8ax: ") and "AxisType.Auto" in str(e), (what, e)
            else:
                raise AssertionError(f"{what}: no error under explicit sharding")
    return {}


CASES = {
    **{name: _layout_case(name) for name in LAYOUTS},
    **{f"recipe:{name}": _recipe_case(name) for name in REGISTRY},
    "global_amax": case_global_amax,
    "moe_expert_parallel": case_moe_expert_parallel,
    "fp8_all_gather": case_fp8_all_gather,
    "shard_map_check_vma": _shard_map_case(True, trained=False),
    "shard_map_check_vma_trained": _shard_map_case(True, trained=True),
    "shard_map_no_check_vma": _shard_map_case(False, trained=True),
    "shard_map_pmean_or_psum_of_state_is_wrong": case_shard_map_pmean_or_psum_of_state_is_wrong,
    "eager_shard_map_no_check_vma_refuses": case_eager_shard_map_no_check_vma_refuses,
    "explicit_sharding": case_explicit_sharding,
}


def main(out_path, only=None):
    assert jax.device_count() == 8, f"expected 8 CPU devices, got {jax.device_count()} (is XLA_FLAGS set?)"
    results = {}
    for name, fn in CASES.items():
        if only and name not in only:
            continue
        try:
            info = fn()
            results[name] = {"status": "ok", "info": info}
        except Exception:
            results[name] = {"status": "failed", "info": traceback.format_exc()}
        print(name, results[name]["status"], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
