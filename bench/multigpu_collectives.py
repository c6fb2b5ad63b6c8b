"""All-gather and reduce-scatter bytes of an FSDP FP8 train step compiled for 8 H100s,
with and without `Fp8Config(fp8_all_gather=True)`, on a machine without a GPU.

    CUDA_VISIBLE_DEVICES=-1 JAX_PLATFORMS=cpu python bench/multigpu_collectives.py   # needs jax[cuda12]

As bench/gpu_aot.py, with a topology of one host with 8 H100s (`topologies.get_topology_desc`
with topology "1x1x8") instead of one: the step is lowered on abstract arrays placed on
that mesh and compiled by XLA:GPU ahead of time. The model is bench/sharding_collectives.py's
(3 blocks of Embed 1024 -> Mlp 4096 -> Embed 1024, bf16, batch 256), unstacked so that
every collective is in the entry computation and runs once per step; FSDP over all 8
devices (weights stored sharded along Embed, the batch split 8 ways). The bytes are
those of each collective's result per device, read from the optimized HLO
(`Compiled.as_text()`). Writes bench/results/multigpu_collectives_h100x8.json.
"""

import re
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

import _harness
import fp8ax
from gpu_aot import H100_TARGET

Batch, Embed, Mlp = hax.Axis("Batch", 256), hax.Axis("Embed", 1024), hax.Axis("Mlp", 4096)
N_BLOCKS = 3
COMPUTE, PARAMS = {"Batch": "data"}, {"Embed": "data"}
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}


class Block(eqx.Module):
    up: hax.nn.Linear
    down: hax.nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return Block(hax.nn.Linear.init(Embed, Mlp, key=k1), hax.nn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x):
        return x + self.down(hax.nn.relu(self.up(x)))


class Model(eqx.Module):
    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def loss_fn(model, x):
    return hax.mean(model(x) ** 2).scalar().astype(jnp.float32)


def step(model, x):
    grads = eqx.filter_grad(loss_fn)(model, x)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    return fp8ax.apply_updates(model, jax.tree.map(lambda g: -0.01 * g, grads), overwrite)


def collectives(hlo: str) -> dict:
    out = {}
    for m in re.finditer(r"= (\(.*?\)|\S+) (all-gather|reduce-scatter|all-reduce)(-start)?\(", hlo):
        shapes = [
            (dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        ]
        if m.group(3):  # an async start: (operands..., results...); the results are the second half
            shapes = shapes[len(shapes) // 2 :]
        e = out.setdefault(m.group(2), {"count": 0, "bytes": 0, "bytes_by_dtype": {}})
        for dt, shape in shapes:
            e["count"] += 1
            e["bytes"] += BYTES[dt] * int(np.prod(shape))
            e["bytes_by_dtype"][dt] = e["bytes_by_dtype"].get(dt, 0) + BYTES[dt] * int(np.prod(shape))
    return out


def compile_variant(mesh, cfg):
    def build():
        plain = Model([Block.init(key=k) for k in jax.random.split(jax.random.PRNGKey(0), N_BLOCKS)])
        model = plain if cfg is None else fp8ax.fp8_linear_layers(plain, cfg)
        return fp8ax.cast_floating(model, jnp.bfloat16)

    model = eqx.filter_eval_shape(build)  # abstract: nothing is computed on this machine
    x = hax.NamedArray(jax.ShapeDtypeStruct((Batch.size, Embed.size), jnp.bfloat16), (Batch, Embed))
    is_abstract = lambda t: isinstance(t, jax.ShapeDtypeStruct)  # noqa: E731
    is_na = lambda t: isinstance(t, hax.NamedArray)  # noqa: E731

    # Shardings by hand: Haliax's helpers run an eager op to see whether they are traced,
    # which a mesh of described GPUs cannot run.
    def place(a, mapping):
        if isinstance(a, hax.NamedArray):
            spec = P(*(mapping.get(ax.name) for ax in a.axes))
            return hax.NamedArray(
                jax.ShapeDtypeStruct(a.array.shape, a.dtype, sharding=NamedSharding(mesh, spec)), a.axes
            )
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P()))

    params, static = eqx.partition(model, is_abstract)
    params = jax.tree.map(lambda a: place(a, PARAMS), params, is_leaf=is_na)
    ax = place(x, COMPUTE)

    def fn(p, x):
        with hax.partitioning.axis_mapping(COMPUTE):
            new = step(eqx.combine(p, static), x)
            return hax.shard(eqx.filter(new, eqx.is_array), PARAMS)

    with hax.partitioning.set_mesh(mesh):
        lowered = jax.jit(fn).lower(params, ax)
    return lowered.compile().as_text()


def main():
    topo = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET, topology="1x1x8")
    mesh = topologies.make_mesh(topo, (8,), ("data",))
    results = {
        "target": "8 x NVIDIA H100 80GB HBM3 (deviceless, topology 1x1x8)",
        "jax": jax.__version__,
        "model": f"{N_BLOCKS} x (1024->4096->1024) bf16, batch 256, FSDP over 8",
        "variants": {},
    }
    variants = {
        "bf16 (no FP8)": None,
        "fp8ax qdq": fp8ax.Fp8Config(mode="qdq"),
        "fp8ax qdq, fp8_all_gather": fp8ax.Fp8Config(mode="qdq", fp8_all_gather=True),
        "fp8ax direct": fp8ax.Fp8Config(mode="direct"),
        "fp8ax direct, fp8_all_gather": fp8ax.Fp8Config(mode="direct", fp8_all_gather=True),
    }
    for name, cfg in variants.items():
        t0 = time.perf_counter()
        c = collectives(compile_variant(mesh, cfg))
        c["compile_s"] = time.perf_counter() - t0
        results["variants"][name] = c
        print(
            f"{name:30s}", {k: (v["count"], v["bytes"], v["bytes_by_dtype"]) for k, v in c.items() if k != "compile_s"}
        )
    base = results["variants"]["bf16 (no FP8)"]["all-gather"]["bytes"]
    for name, c in results["variants"].items():
        print(f"{name:30s} all-gather bytes / bf16 step's: {c['all-gather']['bytes'] / base:.4f}")
    out = _harness.write_json(_harness.RESULTS / "multigpu_collectives_h100x8.json", results, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
