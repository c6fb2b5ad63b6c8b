"""FP8 training of a small Haliax transformer under FSDP + tensor parallelism.

Runs on 8 devices. Without accelerators it asks XLA for 8 CPU devices, so it runs
anywhere:

    python examples/sharded_training.py             # 30 steps
    python examples/sharded_training.py --steps 100
    python examples/sharded_training.py --processes 2   # 2 processes x 4 CPU devices

With `--processes 2` the script starts two copies of itself, each a JAX process with 4
CPU devices (`jax.distributed.initialize` with a coordinator on 127.0.0.1, gloo
collectives), which train on the same 4 x 2 mesh spread over both processes: what
multi-host training does with one process per host. Process 0 runs the one-device
training too, on its first device, and prints the report.

The same model is trained on one device and on a 4 x 2 mesh (FSDP over "data", tensor
parallel over "model"). The first step agrees to float32 rounding. After that the two
runs drift apart by FP8 rounding noise (about 1% of the loss after 30 Adam steps): the
sharded GEMMs and reductions sum in another order, and a float32 rounding difference
can move a value across an FP8 rounding boundary (one FP8 step is 6-12%), which Adam
then amplifies. The same model without FP8 stays within 2e-6 on these meshes. The FP8
state is replicated: the same on every device.
"""

import os
import sys

# A process started by `--processes N` (see `launch`) has 8 / N CPU devices.
_CHILD = "--process-id" in sys.argv
if _CHILD:
    # The parent's XLA_FLAGS, with this process's device count in place of the parent's.
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    _devices = 8 // int(sys.argv[sys.argv.index("--num-processes") + 1])
    os.environ["XLA_FLAGS"] = " ".join([*_flags, f"--xla_force_host_platform_device_count={_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
elif "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Must happen before JAX starts.
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import fp8ax  # noqa: E402

Batch = hax.Axis("Batch", 16)
Pos = hax.Axis("Pos", 32)
KPos = Pos.alias("KPos")
Embed = hax.Axis("Embed", 64)
Heads = hax.Axis("Heads", 4)
HeadSize = hax.Axis("HeadSize", 16)
Mlp = hax.Axis("Mlp", 256)
Vocab = hax.Axis("Vocab", 32)
Layers = hax.Axis("Layers", 2)
Qkv = hax.Axis("Qkv", 3)

# --8<-- [start:mappings]
# How parameters are stored: FSDP shards Embed over "data"; tensor parallelism shards
# heads and the MLP's hidden axis over "model".
PARAMS = {"Embed": "data", "Heads": "model", "Mlp": "model"}
# How the step computes: the batch over "data", heads and MLP over "model" (weights are
# all-gathered over "data" for the GEMMs: in FP8, with `fp8_all_gather=True`).
COMPUTE = {"Batch": "data", "Heads": "model", "Mlp": "model"}
# --8<-- [end:mappings]


class Block(eqx.Module):
    qkv: hax.nn.Linear
    out: hax.nn.Linear
    up: hax.nn.Linear
    down: hax.nn.Linear
    ln1: hax.nn.LayerNorm
    ln2: hax.nn.LayerNorm

    @staticmethod
    def init(*, key):
        k = jax.random.split(key, 4)
        return Block(
            qkv=hax.nn.Linear.init(Embed, (Qkv, Heads, HeadSize), key=k[0], use_bias=False),
            out=hax.nn.Linear.init((Heads, HeadSize), Embed, key=k[1], use_bias=False),
            up=hax.nn.Linear.init(Embed, Mlp, key=k[2]),
            down=hax.nn.Linear.init(Mlp, Embed, key=k[3]),
            ln1=hax.nn.LayerNorm.init(Embed),
            ln2=hax.nn.LayerNorm.init(Embed),
        )

    def __call__(self, x):
        qkv = self.qkv(self.ln1(x))
        q, k, v = (qkv[Qkv, i] for i in range(3))
        k, v = k.rename({Pos: KPos}), v.rename({Pos: KPos})
        scores = hax.dot(q, k, axis=HeadSize) / HeadSize.size**0.5
        causal = hax.arange(Pos).broadcast_axis(KPos) >= hax.arange(KPos)
        weights = hax.nn.softmax(hax.where(causal, scores, -1e9), axis=KPos)
        x = x + self.out(hax.dot(weights, v, axis=KPos))
        return x + self.down(hax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(eqx.Module):
    embed: hax.nn.Embedding
    blocks: hax.nn.Stacked
    unembed: hax.nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2, k3 = jax.random.split(key, 3)
        return TinyLM(
            embed=hax.nn.Embedding.init(Vocab, Embed, key=k1),
            blocks=hax.nn.Stacked.init(Layers, Block)(key=jax.random.split(k2, Layers.size)),
            unembed=hax.nn.Linear.init(Embed, Vocab, key=k3),
        )

    def __call__(self, tokens):
        return self.unembed(self.blocks.fold(self.embed(tokens)))


def loss_fn(model, tokens):
    # Next-token prediction on sequences that count up modulo the vocabulary.
    logits = model(tokens)[Pos, :-1]
    targets = hax.nn.one_hot(tokens[Pos, 1:], Vocab)
    return hax.mean(hax.nn.cross_entropy_loss(logits, Vocab, targets, reduction=None)).scalar()


def batches(key, steps):
    for i in range(steps):
        k_start, k_step = jax.random.split(jax.random.fold_in(key, i))
        start = jax.random.randint(k_start, (Batch.size, 1), 0, Vocab.size)
        step = jax.random.randint(k_step, (Batch.size, 1), 1, 4)
        yield hax.named((start + step * jnp.arange(Pos.size)) % Vocab.size, (Batch, Pos))


opt = fp8ax.skip_fp8_state(optax.adam(3e-3))  # the optimizer never sees the FP8 state


def train_step(model, opt_state, tokens):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return loss, fp8ax.apply_updates(model, updates, overwrite), opt_state


def init(config):
    model = fp8ax.fp8_linear_layers(TinyLM.init(key=jax.random.PRNGKey(0)), config)
    return model, opt.init(eqx.filter(model, eqx.is_array))


def main(steps: int = 30):
    config = fp8ax.Fp8Config(targets=["qkv", "out", "up", "down"], fp8_all_gather=True)
    data = list(batches(jax.random.PRNGKey(1), steps))

    # One device (in process 0 only, on its first device, when there are several).
    if jax.process_index() == 0:
        model, opt_state = init(config)
        step = eqx.filter_jit(train_step)
        single = []
        for tokens in data:
            loss, model, opt_state = step(model, opt_state, tokens)
            single.append(float(loss))
        one_device_state = model.blocks.stacked.up.dot_general.lhs.amax_history[:, 0]

    # --8<-- [start:sharded]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    with hax.partitioning.set_mesh(mesh):
        model, opt_state = init(config)
        model = hax.shard(model, PARAMS)
        opt_state = hax.shard(opt_state, PARAMS)
        step = hax.named_jit(train_step, axis_resources=COMPUTE, out_axis_resources=PARAMS)
        sharded = []
        for tokens in data:
            loss, model, opt_state = step(model, opt_state, hax.shard(tokens, COMPUTE))
            sharded.append(float(loss))
        hlo = step.lower(model, opt_state, hax.shard(data[0], COMPUTE)).compile().as_text()
    # --8<-- [end:sharded]

    if jax.process_index() != 0:
        return  # process 0 reports
    where = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print(f"{'step':>5}  {'1 device':>10}  {'8 devices' + where:>10}")
    every = max(1, steps // 10)
    for i in list(range(0, steps, every)) + ([steps - 1] if (steps - 1) % every else []):
        print(f"{i + 1:>5}  {single[i]:>10.4f}  {sharded[i]:>10.4f}")
    print(
        f"step 1 loss difference: {abs(single[0] - sharded[0]):.1e}; largest relative difference over the "
        f"run: {max(abs(a - b) / a for a, b in zip(single, sharded)):.1%}"
    )

    dg = model.blocks.stacked.up.dot_general
    state = dg.lhs  # the input's row of the layer's state
    print("weight sharding of blocks.up:", model.blocks.stacked.up.weight.array.sharding.spec)
    print("FP8 state sharding:", jax.tree.leaves(dg.state)[0].sharding.spec, "(replicated)")
    print("newest input amax per layer, 8 devices:", np.asarray(state.amax_history[:, 0]))
    print("newest input amax per layer, 1 device: ", np.asarray(one_device_state))
    kinds = Counter(m.group(1) for m in re.finditer(r" (all-gather|all-reduce|reduce-scatter)(?:-start)?\(", hlo))
    print("collectives in the compiled step:", dict(kinds))
    if jax.devices()[0].platform == "cpu":
        print("(XLA:CPU widens FP8 all-gathers to f16; see docs/distributed.md for what the partitioner emits)")


def launch(processes: int, steps: int, timeout: float = 600.0) -> int:
    """Runs this script as `processes` JAX processes on this machine and waits for them.
    Each is killed if one fails or the time runs out; returns the exit status."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--steps", str(steps), "--num-processes", str(processes)]
            + ["--process-id", str(i), "--port", str(port)],
            start_new_session=True,  # a process group of its own, killed below
        )
        for i in range(processes)
    ]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        print(f"processes {failed} failed or ran past {timeout:.0f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    parser.add_argument("--processes", type=int, default=1, choices=[1, 2], help="JAX processes (default 1)")
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)  # set by `launch`
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes > 1:
        sys.exit(launch(args.processes, args.steps))
    if _CHILD:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            coordinator_bind_address=f"127.0.0.1:{args.port}",  # loopback only
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    main(steps=args.steps)
