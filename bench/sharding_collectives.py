"""Which collectives fp8ax adds to a sharded train step, and what the FP8 all-gather saves.

    python bench/sharding_collectives.py            # 8 CPU devices; writes bench/results/sharding_cpu.json

For a 3-layer stacked Haliax MLP (Embed 1024, Mlp 4096, batch 256; weights and
activations bf16) on a 4 x 2 mesh, it compiles one train step per layout (data
parallel, FSDP, tensor parallel, FSDP + TP), plain and FP8, and counts the collectives
of the compiled program with their bytes. For FSDP it also reads the HLO right after
XLA's SPMD partitioner, before XLA:CPU widens FP8 collectives to f16 (its runtime has
none), to report the bytes the weight all-gathers move with and without
`Fp8Config(fp8_all_gather=True)`. Nothing is run, only compiled.
"""

import os
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="fp8ax_hlo_")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*probe.* --xla_dump_hlo_pass_re=spmd-partitioning"
)

import glob  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import _harness  # noqa: E402
import fp8ax  # noqa: E402

Batch, Embed, Mlp, Layers = (
    hax.Axis("Batch", 256),
    hax.Axis("Embed", 1024),
    hax.Axis("Mlp", 4096),
    hax.Axis("Layers", 3),
)
BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4}
LAYOUTS = {
    "data_parallel": ({"Batch": "data"}, {}),
    "fsdp": ({"Batch": "data"}, {"Embed": "data"}),
    "tensor_parallel": ({"Batch": "data", "Mlp": "model"}, {"Mlp": "model"}),
    "fsdp_tp": ({"Batch": "data", "Mlp": "model"}, {"Embed": "data", "Mlp": "model"}),
}


class Block(eqx.Module):
    up: hax.nn.Linear
    down: hax.nn.Linear

    @staticmethod
    def init(*, key):
        k1, k2 = jax.random.split(key)
        return Block(hax.nn.Linear.init(Embed, Mlp, key=k1), hax.nn.Linear.init(Mlp, Embed, key=k2))

    def __call__(self, x):
        return x + self.down(hax.nn.relu(self.up(x)))


def loss_fn(model, x):
    return hax.mean(model.fold(x) ** 2).scalar().astype(jnp.float32)


def step(model, x):
    grads = eqx.filter_grad(loss_fn)(model, x)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    return fp8ax.apply_updates(model, jax.tree.map(lambda g: -0.01 * g, grads), overwrite)


def _shapes(text):
    # "(f32[], bf16[16,32]{1,0})" or "f32[4]{0}" -> [("f32", ()), ("bf16", (16, 32))]
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", text)]


def collectives(hlo):
    out = {}
    for m in re.finditer(
        r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo
    ):
        kind = m.group(2)
        entry = out.setdefault(kind, {"count": 0, "bytes": 0, "scalar_count": 0})
        for dt, shape in _shapes(m.group(1)):
            entry["count"] += 1
            entry["bytes"] += BYTES[dt] * int(np.prod(shape))
            entry["scalar_count"] += shape == ()
    return out


def compile_step(model, x, compute, params, name):
    def fn(model, x):
        return step(model, x)

    fn.__name__ = name
    with hax.partitioning.set_mesh(Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))):
        model, x = hax.shard(model, params), hax.shard(x, compute)
        return hax.named_jit(fn, axis_resources=compute, out_axis_resources=params).lower(model, x).compile().as_text()


def partitioned_weight_gathers(name):
    (path,) = sorted(glob.glob(os.path.join(DUMP, f"*{name}*after_spmd-partitioning*.txt")))[-1:]
    gathers = []
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]\S* all-gather\(", pathlib.Path(path).read_text()):
        shape = tuple(int(d) for d in m.group(2).split(",") if d)
        if len(shape) >= 2:  # weights, not biases
            gathers.append((m.group(1), shape))
    return {
        "dtypes": sorted({d for d, _ in gathers}),
        "count": len(gathers),
        "bytes_per_device": sum(BYTES[d] * int(np.prod(s)) for d, s in gathers),
    }


def main(out_path):
    assert jax.device_count() == 8
    key = jax.random.PRNGKey(0)
    plain = hax.nn.Stacked.init(Layers, Block)(key=jax.random.split(key, Layers.size))
    plain = fp8ax.cast_floating(plain, jnp.bfloat16)
    x = hax.random.normal(jax.random.PRNGKey(1), (Batch, Embed)).astype(jnp.bfloat16)
    results = {
        "device": str(jax.devices()[0].device_kind),
        "model": "3 x (1024->4096->1024) bf16, batch 256",
        "layouts": {},
        "fp8_all_gather": {},
    }
    for name, (compute, params) in LAYOUTS.items():
        row = {}
        for kind, model in (("plain", plain), ("fp8", fp8ax.fp8_linear_layers(plain))):
            row[kind] = collectives(compile_step(model, x, compute, params, f"{name}_{kind}"))
        results["layouts"][name] = row
        print(name)
        for kind in ("plain", "fp8"):
            print(
                f"  {kind:5s}",
                {k: (v["count"], v["scalar_count"], v["bytes"]) for k, v in row[kind].items()},
                "(count, of which scalars, bytes)",
            )
    compute, params = LAYOUTS["fsdp"]
    for mode in ("qdq", "direct"):
        for flag in (False, True):
            name = f"{mode}_{'fp8' if flag else 'plain'}_gather_probe"
            model = fp8ax.fp8_linear_layers(plain, fp8ax.Fp8Config(mode=mode, fp8_all_gather=flag))
            compile_step(model, x, compute, params, name)
            results["fp8_all_gather"][f"{mode}, fp8_all_gather={flag}"] = partitioned_weight_gathers(name)
    print(
        "FSDP weight all-gathers after SPMD partitioning (per device; those inside the scan over layers run once per layer):"
    )
    for k, v in results["fp8_all_gather"].items():
        print(f"  {k:30s} {v}")
    _harness.write_json(out_path, results, indent=1)
    print("wrote", out_path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(_harness.RESULTS / "sharding_cpu.json"))
