"""The program XLA:GPU builds from an FP8 train step, compiled for an H100 without one.

XLA compiles for a GPU on a machine that has none ("deviceless" ahead-of-time
compilation): with the CUDA plugin installed (``pip install "jax[cuda12]"``, about 5.5 GB),
``jax.experimental.topologies`` describes an H100 from its specifications, and a step
lowered on abstract arrays placed on that topology compiles to the optimized HLO a real
H100 would run, minus autotuning. Autotuning picks, per GEMM, a Triton GEMM fusion or a
cuBLASLt call; both are compiled here, the default (Triton allowed) and
``--xla_gpu_enable_triton_gemm=false`` (cuBLAS), each in a subprocess because XLA reads
its flags once.

Two steps, each an ``eqx.filter_jit`` train step (mean squared error, SGD, bf16 parameters,
as bench/gpu.py):

- ``mlp``: the MLP block of bench/gpu.py (8192 tokens, 4096 -> 14336 -> 4096, two
  bias-free ``haliax.nn.Linear``, GELU; 5 GEMMs);
- ``block``: a pre-norm transformer block (batch 4 x 2048 positions, embed 4096, 32 heads of
  128, causal ``haliax.nn.attention.dot_product_attention``, MLP 14336; the 6 linear layers
  convert, the attention contractions stay bf16: 18 FP8 GEMMs of 24, where XLA does not
  merge the q, k and v projections into one);

in the variants ``bf16``; ``haliax_fp8`` (Haliax's own FP8); ``fp8ax_direct`` and
``fp8ax_qdq`` (fp8ax's training step in its two modes with
``DelayedScaling(calibrate_first_call=False)``: every cast uses the scale its state
gives);
``fp8ax_direct_first`` and ``fp8ax_qdq_first`` (the default,
``calibrate_first_call=True``: one program for every step, whose casts pick their scale
with a ``select`` between the tensor's own amax and its history; until 2026-11-26 this
was a separate program for a fresh model's first step).

Per variant (see bench/gpu_hlo.py for the exact definitions): GEMMs, FP8 GEMMs and the
path each took, GEMM output dtypes, kernels, HBM bytes of the non-GEMM kernels, FP8 casts
that wait on a reduction of their own input, conditionals and host callbacks left, the
compile time (trace + lower + XLA, on this machine: the fastest of ``--repeat`` compiles,
3 by default, each after ``jax.clear_caches()``; XLA's part alone too), and a roofline estimate of the step
on an H100 SXM: every GEMM at 989 TFLOP/s (FP8) or 495 TFLOP/s (bf16), dense, and every
other kernel's bytes at 3.35 TB/s.

Run::

    python bench/gpu_aot.py                     # both steps, both paths; bench/results/gpu_aot_h100.json
    python bench/gpu_aot.py --quick             # every size / 16: a smoke test (~1 min)
    python bench/gpu_aot.py --steps mlp --variants bf16,fp8ax_direct --dump /tmp/hlo

Exit status 2 (and the reason) when the CUDA plugin is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness

HERE = _harness.HERE
RESULTS = _harness.RESULTS

# The H100 SXM (80 GB HBM3) as XLA describes a GPU (GpuTargetConfigProto, text format):
# compute capability 9.0, 132 SMs, 228 KiB shared memory per SM (227 KiB per block opt-in),
# 50 MiB L2, 3.35 TB/s, 1.98 GHz.
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
# A Blackwell B200 for the checks of block-scaled GEMMs (tests/test_gpu_program.py): the
# H100's description with compute capability 10.0, 148 SMs, 126 MB L2, 8 TB/s and 180 GB,
# and cuDNN 9.28, the version the jax[cuda12] 0.10.2 wheels install (nvidia-cudnn-cu12
# 9.28.0.42). XLA:GPU hands JAX's block-scaled dot to cuDNN only for cuDNN 9.10 and newer
# (with the H100 description's 9.8 it expands it into a dequantize and a plain GEMM).
B200_TARGET = (
    H100_TARGET.replace("major: 9 minor: 0", "major: 10 minor: 0")
    .replace("core_count: 132", "core_count: 148")
    .replace("l2_cache_size: 52428800", "l2_cache_size: 132120576")
    .replace("memory_bandwidth: 3352320000000", "memory_bandwidth: 8000000000000")
    .replace("device_memory_size: 84942979072", "device_memory_size: 193273528320")
    .replace("dnn_version_info { major: 9 minor: 8 patch: 0 }", "dnn_version_info { major: 9 minor: 28 patch: 0 }")
    .replace("NVIDIA H100 80GB HBM3", "NVIDIA B200")
)
H100 = {"fp8_flops_per_s": 989.4e12, "bf16_flops_per_s": 494.7e12, "bytes_per_s": 3.35e12}

PATHS = {"triton": "", "cublas": "--xla_gpu_enable_triton_gemm=false"}
VARIANTS = ("bf16", "haliax_fp8", "fp8ax_direct", "fp8ax_qdq", "fp8ax_direct_first", "fp8ax_qdq_first")
STEPS = ("mlp", "block")
SIZES = {"tokens": 8192, "batch": 4, "embed": 4096, "mlp": 14336, "heads": 32, "head_dim": 128}


def topology_mesh(target: str = H100_TARGET):
    """A one-device mesh on a described GPU (an H100 by default), or raises with the
    reason."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target, topology="1x1x1")
    return topologies.make_mesh(topo, (1,), ("x",))


# --------------------------------------------------------------------------------------
# The steps (imported in the worker only: the parent needs no JAX)


def _models(sizes):
    import equinox as eqx
    import haliax as hax
    import haliax.nn as hnn
    import jax
    import jax.numpy as jnp

    Embed, Mlp = hax.Axis("embed", sizes["embed"]), hax.Axis("mlp", sizes["mlp"])
    Heads, HeadDim = hax.Axis("heads", sizes["heads"]), hax.Axis("head_dim", sizes["head_dim"])

    class Block(eqx.Module):
        ln1: hnn.LayerNorm
        ln2: hnn.LayerNorm
        q: hnn.Linear
        k: hnn.Linear
        v: hnn.Linear
        o: hnn.Linear
        up: hnn.Linear
        down: hnn.Linear

        @staticmethod
        def init(*, key):
            ks = jax.random.split(key, 6)
            lin = lambda i, o, k: hnn.Linear.init(In=i, Out=o, key=k, use_bias=False)  # noqa: E731
            return Block(
                hnn.LayerNorm.init(Embed, use_bias=False),
                hnn.LayerNorm.init(Embed, use_bias=False),
                lin(Embed, (Heads, HeadDim), ks[0]),
                lin(Embed, (Heads, HeadDim), ks[1]),
                lin(Embed, (Heads, HeadDim), ks[2]),
                lin((Heads, HeadDim), Embed, ks[3]),
                lin(Embed, Mlp, ks[4]),
                lin(Mlp, Embed, ks[5]),
            )

        def __call__(self, x):
            Pos = x.resolve_axis("position")
            KPos = Pos.alias("key_position")
            h = self.ln1(x)
            q, k, v = self.q(h), self.k(h).rename({Pos: KPos}), self.v(h).rename({Pos: KPos})
            mask = hnn.attention.causal_mask(Pos, KPos)
            attn = hnn.attention.dot_product_attention(KPos, HeadDim, q, k, v, mask=mask)
            x = x + self.o(attn).astype(x.dtype)
            return x + self.down(hnn.gelu(self.up(self.ln2(x)))).astype(x.dtype)

    import _gpu_models as gpu

    def mlp_init(key):
        return gpu.MlpBlock.init(Embed, Mlp, key=key)

    Batch, Pos = hax.Axis("batch", sizes["batch"]), hax.Axis("position", sizes["tokens"] // sizes["batch"])
    Tokens = hax.Axis("batch", sizes["tokens"])
    return {
        "mlp": (mlp_init, (Tokens, Embed), jnp.bfloat16),
        "block": (lambda key: Block.init(key=key), (Batch, Pos, Embed), jnp.bfloat16),
    }


def _build(variant: str, base):
    import jax.numpy as jnp

    import _gpu_models as gpu
    import fp8ax

    if variant in ("bf16", "haliax_fp8"):
        return gpu.build_mlp(variant, base)
    mode = "qdq" if "qdq" in variant else "direct"
    recipe = fp8ax.DelayedScaling(calibrate_first_call=variant.endswith("_first"))
    if variant == "fp8ax_blockwise":  # not in the default set: `--variants fp8ax_blockwise`
        recipe = fp8ax.BlockwiseScaling()
    return fp8ax.cast_floating(fp8ax.fp8_linear_layers(base, fp8ax.Fp8Config(mode=mode, recipe=recipe)), jnp.bfloat16)


def compile_one(step_name: str, variant: str, sizes, mesh, dump: Path | None, repeat: int = 1) -> dict[str, Any]:
    import equinox as eqx
    import haliax as hax
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import _gpu_models as gpu
    import gpu_hlo

    init, axes, dtype = _models(sizes)[step_name]
    model = eqx.filter_eval_shape(lambda key: _build(variant, init(key)), jax.random.PRNGKey(0))
    x = hax.NamedArray(jax.ShapeDtypeStruct(tuple(a.size for a in axes), dtype), axes)
    opt = optax.sgd(1e-3)
    train_variant = "haliax_fp8" if variant == "haliax_fp8" else "fp8ax_direct"  # which partition/apply
    opt_state = eqx.filter_eval_shape(opt.init, gpu.opt_params(model, train_variant))
    step = gpu.make_mlp_step(train_variant, opt)

    # Lower on abstract arrays placed on the described H100 (Equinox keeps a
    # ShapeDtypeStruct static, so the step gets them as the arguments of a jax.jit).
    is_abstract = lambda a: isinstance(a, jax.ShapeDtypeStruct)  # noqa: E731
    leaves, treedef = jax.tree.flatten((model, opt_state, x, x), is_leaf=is_abstract)
    where = [i for i, leaf in enumerate(leaves) if is_abstract(leaf)]
    replicated = NamedSharding(mesh, P())

    def flat(*arrays):
        full = list(leaves)
        for i, a in zip(where, arrays):
            full[i] = a
        return step(*jax.tree.unflatten(treedef, full))

    args = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype, sharding=replicated) for i in where]
    totals, xla = [], []
    for _ in range(repeat):  # the fastest of `repeat` compiles, each from scratch
        jax.clear_caches()
        t0 = time.perf_counter()
        try:
            lowered = jax.jit(flat).lower(*args)
            t1 = time.perf_counter()
            compiled = lowered.compile()
        except Exception as e:  # noqa: BLE001 (reported: a step that cannot be compiled ahead of time)
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        t2 = time.perf_counter()
        totals.append(t2 - t0)
        xla.append(t2 - t1)
    info: dict[str, Any] = {"compile_s": min(totals), "xla_compile_s": min(xla), "compile_s_all": totals}
    text = compiled.as_text()
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{step_name}_{variant}_{os.environ.get('FP8AX_AOT_PATH', '')}.hlo").write_text(text)
    info.update(gpu_hlo.summary(text))
    info["roofline_ms"] = 1e3 * gpu_hlo.roofline_s(info, **H100)
    return info


def worker(args) -> None:
    sizes = {k: v // (16 if args.quick else 1) for k, v in SIZES.items()}
    sizes["batch"] = SIZES["batch"]
    out: dict[str, Any] = {}
    mesh = topology_mesh()
    for step_name in args.steps.split(","):
        for variant in args.variants.split(","):
            info = compile_one(step_name, variant, sizes, mesh, Path(args.dump) if args.dump else None, args.repeat)
            out[f"{step_name}/{variant}"] = info
            print(
                f"  {os.environ.get('FP8AX_AOT_PATH')} {step_name}/{variant}: "
                + (
                    info["error"]
                    if "error" in info
                    else f"{info['fp8_gemms']}/{info['gemms']} FP8 GEMMs, {info['kernels']} kernels, "
                    f"compile {info['compile_s']:.1f} s"
                ),
                flush=True,
            )
    out["_sizes"] = sizes
    _harness.write_json(args.worker_out, out, indent=1)


# --------------------------------------------------------------------------------------
# The parent: one worker per GEMM path, a table, JSON.


def table(results: dict[str, Any]) -> str:
    rows = [
        "| step | variant | path | FP8 GEMMs | GEMM out | kernels | non-GEMM GB | waiting casts | cond. | "
        "callbacks | compile s (XLA) | roofline ms |",
        "|" + "---|" * 12,
    ]
    for path, per in results.items():
        for key, i in per.items():
            if key.startswith("_"):
                continue
            step, variant = key.split("/")
            if "error" in i:
                rows.append(f"| {step} | {variant} | {path} | error: {i['error'][:80]} |" + " |" * 8)
                continue
            rows.append(
                f"| {step} | {variant} | {path} | {i['fp8_gemms']}/{i['gemms']} | {','.join(i['gemm_out_dtypes'])} | "
                f"{i['kernels']} | {i['non_gemm_bytes'] / 1e9:.2f} | {len(i['waiting_casts'])} | {i['conditionals']} | "
                f"{i['host_callbacks']} | {i['compile_s']:.2f} ({i['xla_compile_s']:.2f}) | {i['roofline_ms']:.2f} |"
            )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default=",".join(STEPS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--quick", action="store_true", help="every size / 16 (a smoke test)")
    p.add_argument("--dump", default=None, help="write each optimized HLO here")
    p.add_argument("--repeat", type=int, default=3, help="compile each step this many times, report the fastest")
    p.add_argument("--out", default=None)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker_out:
        worker(args)
        return 0

    probe = subprocess.run(
        # Run in bench/, where `python -c` finds this script as a module.
        [sys.executable, "-c", "import gpu_aot; gpu_aot.topology_mesh()"],
        cwd=HERE,
        env=_env(""),
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        print(
            "bench/gpu_aot.py needs the CUDA plugin for a deviceless compile (pip install 'jax[cuda12]' for "
            "the installed jax): " + (probe.stderr.strip().splitlines() or ["?"])[-1]
        )
        return 2
    results: dict[str, Any] = {}
    for path in args.paths.split(","):
        tmp = RESULTS / f"gpu_aot_{path}.tmp"
        cmd = [sys.executable, __file__, "--worker-out", str(tmp), "--steps", args.steps, "--variants", args.variants]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--repeat", str(args.repeat)]
        cmd += ["--dump", args.dump] if args.dump else []
        subprocess.run(cmd, env=_env(path), check=True)
        results[path] = json.loads(tmp.read_text())
        tmp.unlink()
    print(table(results))
    out = Path(args.out) if args.out else RESULTS / ("gpu_aot_h100_quick.json" if args.quick else "gpu_aot_h100.json")
    record = {
        "benchmark": "bench/gpu_aot.py",
        "date": _harness.now(timespec="auto"),
        "target": "H100 SXM 80GB (deviceless compile)",
        "roofline": H100,
        "host": platform.node(),
        "versions": _harness.versions(
            ("jax", "jaxlib", "jax-cuda12-plugin", "equinox", "haliax", "fp8ax"), missing="not installed"
        ),
        "results": results,
    }
    _harness.write_json(out, record, indent=1)
    print(f"wrote {out}")
    return 0


def _env(path: str) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="-1", JAX_PLATFORMS="cpu", FP8AX_AOT_PATH=path)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} {PATHS.get(path, '')}".strip()
    return env


if __name__ == "__main__":
    sys.exit(main())
