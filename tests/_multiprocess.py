"""Multi-controller FP8 training on CPU, and Orbax checkpoints of it.

Run by tests/test_multiprocess.py, one process per JAX process:

    python tests/_multiprocess.py train  --process-id I --num-processes 2 --devices 4 --port P --out DIR
    python tests/_multiprocess.py single --port P --out DIR      # 1 process x 8 devices, then the resume

`train` runs in each of the two processes (`jax.distributed.initialize` with a coordinator
on 127.0.0.1, 4 CPU devices each, gloo collectives). For each model (a Haliax stack of
MLPs and an Equinox MLP) it trains `STEPS` Adam steps on a 4 x 2 ("data", "model") mesh
laid out for data parallelism, FSDP and tensor parallelism, saves the model, its FP8
state and the optimizer state with Orbax after `SAVE_AT` steps, and writes what it holds
at the end to DIR/process<I>.npz (every array gathered whole, on every process).

`single` does the same training in one process with all 8 devices (DIR/single.npz), then
restores the 2-process checkpoint into this process on another mesh (2 x 4), continues
training and compares with the run that went on without a checkpoint, and checks the
errors of a checkpoint loaded into a template of another kind. Its findings go to
DIR/single.json.

Both runs use the same CPU collectives (gloo, through `jax.distributed.initialize`, with
one process for `single`): XLA:CPU's in-process collectives sum over more than two
devices in another order, which changes float32 sums in the last bit.
"""

import argparse
import functools
import inspect
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("phase", choices=["train", "single"])
parser.add_argument("--process-id", type=int, default=0)
parser.add_argument("--num-processes", type=int, default=1)
parser.add_argument("--devices", type=int, default=8, help="CPU devices of this process")
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--models", default="haliax,equinox")
args = parser.parse_args()

# Before JAX starts.
# (After the flags the test gave: tests/conftest.py's `xla_flags`.)
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
)
os.environ["JAX_PLATFORMS"] = "cpu"

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

sys.path.insert(0, os.path.dirname(__file__))
import fp8ax  # noqa: E402
from helpers import Deep, In, Out  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    coordinator_bind_address=f"127.0.0.1:{args.port}",  # loopback only
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=60,
    heartbeat_timeout_seconds=30,
    shutdown_timeout_seconds=30,
)

STEPS = 4
SAVE_AT = 2
N = 64
Batch = hax.Axis("Batch", N)
BIG = 50.0  # the input's largest magnitude, in a row that only the last process holds
BIG_ROW = N - 3
opt = optax.adam(1e-2)


def mesh_of(shape):
    return Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))


def global_array(value: np.ndarray, mesh, spec):
    """A global array from a value every process knows, each process filling its shards."""
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])


def data(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, In.size)).astype(np.float32)
    x[BIG_ROW, 5] = BIG
    return x, rng.standard_normal((N, Out.size)).astype(np.float32)


def arrays(tree):
    return eqx.filter(tree, eqx.is_array)


def gathered(tree) -> dict[str, np.ndarray]:
    """Every array of `tree`, gathered whole onto this process, by path."""
    leaves = jax.tree_util.tree_leaves_with_path(arrays(tree))
    values = multihost_utils.process_allgather([x for _, x in leaves], tiled=True)
    return {jax.tree_util.keystr(p): np.asarray(v) for (p, _), v in zip(leaves, values, strict=True)}


# ------------------------------------------------------------------------------------
# The Haliax model: tests/helpers.py's `Deep` (3 stacked MLP blocks and a head), with
# the batch over "data" (data parallelism), weights stored sharded over "data" along In
# (FSDP, gathered for the GEMMs, in FP8 with `fp8_all_gather`) and over "model" along Mid
# (tensor parallelism).

HALIAX_COMPUTE = {"Batch": "data", "Mid": "model"}
HALIAX_PARAMS = {"In": "data", "Mid": "model"}


class HaliaxCase:
    name = "haliax"

    def __init__(self, mesh):
        self.mesh = mesh

    def init(self):
        config = fp8ax.Fp8Config(fp8_all_gather=True)

        def fn():
            model = fp8ax.fp8_linear_layers(Deep.init(key=jax.random.key(42)), config)
            return model, opt.init(arrays(fp8ax.partition_for_grad_overwrite(model)[1]))

        with hax.partitioning.set_mesh(self.mesh):
            return hax.named_jit(fn, axis_resources=HALIAX_PARAMS)()

    def batch(self, seed):
        x, y = data(seed)
        return (
            hax.NamedArray(global_array(x, self.mesh, P("data", None)), (Batch, In)),
            hax.NamedArray(global_array(y, self.mesh, P("data", None)), (Batch, Out)),
        )

    def loss(self, model, x, y):
        return hax.mean((model(x) - y) ** 2).scalar()

    @functools.cached_property
    def step(self):
        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(self.loss)(model, x, y)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
                updates, opt_state = opt.update(arrays(grads), opt_state)
            return loss, fp8ax.apply_updates(model, updates, overwrite), opt_state

        jitted = hax.named_jit(step, axis_resources=HALIAX_COMPUTE, out_axis_resources=HALIAX_PARAMS)

        def run(*a):
            with hax.partitioning.set_mesh(self.mesh):
                return jitted(*a)

        return run

    def shardings(self, tree):
        """`tree`'s arrays as `jax.ShapeDtypeStruct`s with this mesh's shardings."""
        # Haliax 1.4.dev453 keeps an array's existing sharding unless told not to;
        # marin-haliax has no such switch (and lays out what the mapping names).
        infer = hax.partitioning.infer_resource_partitions
        keep = {"preserve_existing_shardings": False}
        if "preserve_existing_shardings" not in inspect.signature(infer).parameters:
            keep = {}
        with hax.partitioning.set_mesh(self.mesh):
            shard = infer(arrays(tree), HALIAX_PARAMS, mesh=self.mesh, **keep)

        def sds(a, s):  # Haliax gives one sharding for a NamedArray
            if isinstance(a, hax.NamedArray):
                return hax.NamedArray(jax.ShapeDtypeStruct(a.array.shape, a.dtype, sharding=s), a.axes)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

        return jax.tree.map(sds, arrays(tree), shard, is_leaf=lambda x: isinstance(x, hax.NamedArray))

    def amax_state(self, model):
        # The stored array ([Layers, unit + scale + history]), sharded as it is trained.
        return jax.tree.leaves(model.blocks.stacked.mlp.up_proj.dot_general.lhs)[0]


# ------------------------------------------------------------------------------------
# The Equinox model: an `eqx.nn.MLP` 16 -> 32 -> 32 -> 8, jitted with explicit shardings:
# the batch over "data"; each weight (out, in) over ("model", "data") (tensor parallel
# over out, FSDP over in), each bias over "model"; FP8 state and Adam's count replicated.


def eqx_spec(path, x) -> P:
    where = jax.tree_util.keystr(path)
    if ".dot_general." in where or np.ndim(x) == 0:
        return P()
    if where.endswith(".weight"):
        return P("model", "data")
    if where.endswith(".bias"):
        return P("model")
    raise AssertionError(f"no sharding rule for {where}")


class EquinoxCase:
    name = "equinox"

    def __init__(self, mesh):
        self.mesh = mesh

    def constrain(self, tree):
        def put(path, x):
            if not eqx.is_array(x):
                return x
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, eqx_spec(path, x)))

        return jax.tree_util.tree_map_with_path(put, tree)

    def init(self):
        @eqx.filter_jit
        def fn():
            model = fp8ax.fp8_linear_layers(eqx.nn.MLP(In.size, Out.size, 32, 2, key=jax.random.key(7)))
            return self.constrain((model, opt.init(arrays(fp8ax.partition_for_grad_overwrite(model)[1]))))

        return fn()

    def batch(self, seed):
        x, y = data(seed)
        return global_array(x, self.mesh, P("data", None)), global_array(y, self.mesh, P("data", None))

    def loss(self, model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @functools.cached_property
    def step(self):
        @eqx.filter_jit
        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(self.loss)(model, x, y)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            with jax.numpy_dtype_promotion("standard"):  # optax mixes its int step count with floats
                updates, opt_state = opt.update(arrays(grads), opt_state)
            model, opt_state = self.constrain((fp8ax.apply_updates(model, updates, overwrite), opt_state))
            return loss, model, opt_state

        return step

    def shardings(self, tree):
        def sds(path, a):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(self.mesh, eqx_spec(path, a)))

        return jax.tree_util.tree_map_with_path(sds, arrays(tree))

    def amax_state(self, model):
        return jax.tree.leaves(model.layers[0].dot_general.lhs)[0]  # [unit + scale + history]


_CASES = {}


def case_of(name, shape):
    """One case object per model and mesh, so that its jitted functions compile once."""
    if (name, shape) not in _CASES:
        _CASES[name, shape] = {"haliax": HaliaxCase, "equinox": EquinoxCase}[name](mesh_of(shape))
    return _CASES[name, shape]


def train(case, steps, model, opt_state, save_dir=None, seed0=0):
    """`steps` steps; also returns the model and optimizer state after `SAVE_AT` steps
    (saved with Orbax to `save_dir` if given)."""
    losses, at_save = [], None
    for i in range(steps):
        if i == SAVE_AT:
            at_save = (model, opt_state)
            if save_dir is not None:
                ckptr = ocp.StandardCheckpointer()
                ckptr.save(save_dir, {"model": arrays(model), "opt_state": opt_state})
                ckptr.wait_until_finished()
        loss, model, opt_state = case.step(model, opt_state, *case.batch(seed0 + i))
        losses.append(float(loss))
    return losses, model, opt_state, at_save


def phase_train(models):
    out, info, snapshots = {}, {}, {}
    for name in models:
        case = case_of(name, (4, 2))
        t0 = time.perf_counter()
        model, opt_state = case.init()
        save_dir = os.path.join(args.out, f"ckpt_{name}") if args.num_processes > 1 else None
        losses, model, opt_state, snapshots[name] = train(case, STEPS, model, opt_state, save_dir)
        out.update({f"{name}/model{k}": v for k, v in gathered(model).items()})
        out.update({f"{name}/opt_state{k}": v for k, v in gathered(opt_state).items()})
        out[f"{name}/losses"] = np.array(losses)
        # Global amax: the largest input lives in one row, on the last process only. Each
        # process reports the largest input it holds and the newest amax its own shards
        # of the state record.
        x, _ = case.batch(0)
        x = x.array if isinstance(x, hax.NamedArray) else x
        local_max = max(float(np.max(np.abs(np.asarray(s.data)))) for s in x.addressable_shards)
        hist = case.amax_state(model)
        # The newest entries come first, after the unit and the scale; a stacked state's
        # first row is the first block.
        recorded = [
            np.asarray(s.data).reshape(-1, hist.shape[-1])[0, 2 : 2 + STEPS].tolist() for s in hist.addressable_shards
        ]
        info[name] = {
            "local_input_max": local_max,
            "recorded_input_amax": recorded,
            "seconds": time.perf_counter() - t0,
        }
    return out, info, snapshots


def same(a: dict, b: dict) -> list[str]:
    """The keys whose arrays differ in any bit (or exist in one only)."""
    diff = sorted(set(a) ^ set(b))
    return diff + [k for k in sorted(set(a) & set(b)) if not bitwise_equal(a[k], b[k])]


def bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal in every bit (`np.array_equal` takes -0.0 for 0.0 and a NaN for no value)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def phase_resume(models, snapshots):
    """Restores the 2-process checkpoint on another mesh and continues; compares with the
    run that went on without one."""
    report = {}
    for name in models:
        case_b = case_of(name, (2, 4))
        path = os.path.join(args.out, f"ckpt_{name}")
        r = report[name] = {}
        # Uninterrupted: SAVE_AT steps on the 2-process run's mesh (this process's run of
        # `phase_train`), then moved to mesh B in memory and trained on.
        model, opt_state = snapshots[name]
        at_save = {**gathered(model), **{"opt" + k: v for k, v in gathered(opt_state).items()}}
        model_b, opt_b = jax.device_put(
            (arrays(model), opt_state), jax.tree.map(lambda s: s.sharding, case_b.shardings((model, opt_state)))
        )
        model = eqx.combine(model_b, model)
        losses_ref, model_ref, opt_ref, _ = train(case_b, STEPS - SAVE_AT, model, opt_b, seed0=SAVE_AT)

        # Resumed: a fresh model of the same config is the template, on mesh B.
        fresh, fresh_opt = case_b.init()
        like = {"model": case_b.shardings(fresh), "opt_state": case_b.shardings(fresh_opt)}
        ckptr = ocp.StandardCheckpointer()
        metadata = ckptr.metadata(path).item_metadata
        fp8ax.check_checkpoint_metadata(metadata, like)
        restored = ckptr.restore(path, like)
        model = eqx.combine(restored["model"], fresh)
        opt_state = restored["opt_state"]
        r["restored_shardings_on_mesh_b"] = all(
            x.sharding == s.sharding for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True)
        )
        got = {**gathered(model), **{"opt" + k: v for k, v in gathered(opt_state).items()}}
        r["checkpoint_differs_from_uninterrupted_at_save"] = same(got, at_save)
        losses, model, opt_state, _ = train(case_b, STEPS - SAVE_AT, model, opt_state, seed0=SAVE_AT)
        r["losses"], r["losses_uninterrupted"] = losses, losses_ref
        r["resumed_differs_from_uninterrupted"] = same(
            {**gathered(model), **{"opt" + k: v for k, v in gathered(opt_state).items()}},
            {**gathered(model_ref), **{"opt" + k: v for k, v in gathered(opt_ref).items()}},
        )
        r["n_leaves"] = len(got)

        # A training checkpoint restored into a serving template: fp8ax's error (and
        # Orbax's own, for comparison).
        serving_like = {"model": arrays(fp8ax.serving_template(fresh)), "opt_state": like["opt_state"]}
        r["training_into_serving"] = error_of(lambda: fp8ax.check_checkpoint_metadata(metadata, serving_like))
        r["training_into_serving_orbax"] = error_of(lambda: ckptr.restore(path, serving_like))
        # A serving checkpoint (of the resumed model) restored into a training template.
        served = arrays(fp8ax.to_serving(model))
        serving_path = os.path.join(args.out, f"serving_{name}")
        ckptr.save(serving_path, served)
        ckptr.wait_until_finished()
        serving_metadata = ckptr.metadata(serving_path).item_metadata
        r["serving_into_training"] = error_of(lambda: fp8ax.check_checkpoint_metadata(serving_metadata, like["model"]))
        # ... and into its own template it loads, bit for bit.
        fp8ax.check_checkpoint_metadata(serving_metadata, arrays(fp8ax.serving_template(fresh)))
        back = ckptr.restore(serving_path, arrays(fp8ax.serving_template(fresh)))
        r["serving_roundtrip_differs"] = same(
            {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(back)},
            {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(served)},
        )
    return report


def error_of(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (reported to the test, which checks the message)
        return f"{type(e).__name__}: {e}"
    return None


def main():
    assert jax.process_count() == args.num_processes, jax.process_count()
    assert jax.device_count() == 8 and jax.local_device_count() == args.devices
    models = [m for m in args.models.split(",") if m]
    out, info, snapshots = phase_train(models)
    if args.phase == "train":
        np.savez(os.path.join(args.out, f"process{args.process_id}.npz"), **out)
        with open(os.path.join(args.out, f"process{args.process_id}.json"), "w") as f:
            json.dump(info, f)
    else:
        np.savez(os.path.join(args.out, "single.npz"), **out)
        report = {"train": info, "resume": phase_resume(models, snapshots)}
        with open(os.path.join(args.out, "single.json"), "w") as f:
            json.dump(report, f, indent=1)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
