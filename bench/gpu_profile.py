"""Where a decoder-layer train step spends its GPU time: kernels per variant, from a profile.

Runs bench/gpu_train.py's decoder layer (`build_decoder`, in bench/_train_decoder.py) for
each variant in one process, with the XLA flags in the environment, warms it up, records `--steps` steps with
`jax.profiler.trace`, and reads the trace back with `jax.profiler.ProfileData`: the GPU
kernels of each step (name, count, total time), grouped into GEMMs (cuBLAS(Lt), CUTLASS,
Triton GEMM fusions) and everything else, plus the number of kernel launches per step.
Writes one JSON file and prints a table of the kernels that take the most time.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python bench/gpu_profile.py --out $OUT/profile.json
    python bench/gpu_profile.py --dry   # tiny sizes on the CPU (whatever plane the trace has)
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax

import _harness
from _train_decoder import build_decoder
from _train_parts import DECODER_DRY, DECODER_FULL
from _train_record import _compiled_text

GEMM_PATTERN = re.compile(r"gemm|cublas|xmma|cutlass|sm90|matmul|triton_gemm|dot", re.IGNORECASE)


def _kernels(trace_dir: str, steps: int) -> dict:
    """Per kernel name: launches and total ns over the traced steps, from the device plane
    (or, without a GPU, the busiest plane)."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": "no xplane.pb written"}
    data = jax.profiler.ProfileData.from_file(paths[0])
    planes = list(data.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    chosen = gpu or sorted(planes, key=lambda p: -sum(1 for line in p.lines for _ in line.events))[:1]
    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for plane in chosen:
        for line in plane.lines:
            # XLA's GPU plane: one line per stream; skip the summary lines ("XLA Ops", "XLA Modules").
            if gpu and line.name.startswith("XLA"):
                continue
            for ev in line.events:
                stats[ev.name][0] += 1
                stats[ev.name][1] += ev.duration_ns
    rows = sorted(
        ({"name": n, "launches": c / steps, "us_per_step": t / steps / 1e3} for n, (c, t) in stats.items()),
        key=lambda r: -r["us_per_step"],
    )
    gemm = [r for r in rows if GEMM_PATTERN.search(r["name"])]
    return {
        "plane": [p.name for p in chosen],
        "launches_per_step": sum(r["launches"] for r in rows),
        "us_per_step": sum(r["us_per_step"] for r in rows),
        "gemm_us_per_step": sum(r["us_per_step"] for r in gemm),
        "gemm_launches_per_step": sum(r["launches"] for r in gemm),
        "other_us_per_step": sum(r["us_per_step"] for r in rows if r not in gemm),
        "other_launches_per_step": sum(r["launches"] for r in rows if r not in gemm),
        "top": rows[:40],
    }


def profile(variant: str, s: dict, steps: int, seed: int, hlo_dir: str | None) -> dict:
    model, opt_state, x, y, step, _, fp8_layers = build_decoder(variant, s, seed)
    for _ in range(3):
        model, opt_state = step(model, opt_state, x, y)
    jax.block_until_ready((model, opt_state))
    t0 = time.perf_counter()
    for _ in range(steps):
        model, opt_state = step(model, opt_state, x, y)
    jax.block_until_ready((model, opt_state))
    wall = (time.perf_counter() - t0) / steps
    out = {"variant": variant, "fp8_layers": fp8_layers, "untraced_step_ms": wall * 1e3}
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(steps):
                model, opt_state = step(model, opt_state, x, y)
            jax.block_until_ready((model, opt_state))
        out["kernels"] = _kernels(d, steps)
    if hlo_dir:
        try:
            text = _compiled_text(step.lower(model, opt_state, x, y).compile())
            Path(hlo_dir, f"{variant}.hlo.txt").write_text(text)
            out["hlo_entry_instructions"] = len(re.findall(r"^\s+\S+ = ", text.split("ENTRY", 1)[-1], re.M))
        except Exception as e:  # noqa: BLE001
            out["hlo_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="bf16,fp8ax,fp8ax_nofirst,fp8ax_current,haliax_fp8")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--hlo-dir", default=None, help="also write each variant's optimized HLO there")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    dry = args.dry or jax.default_backend() != "gpu"
    s = DECODER_DRY if dry else DECODER_FULL
    results = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "device": str(jax.devices()[0]), "variants": {}}
    for v in args.variants.split(","):
        try:
            results["variants"][v] = profile(v, s, args.steps, args.seed, args.hlo_dir)
        except Exception as e:  # noqa: BLE001 (one variant's failure must not stop the others)
            results["variants"][v] = {"error": f"{type(e).__name__}: {e}"}
        r = results["variants"][v]
        k = r.get("kernels", {})
        print(
            f"{v}: step {r.get('untraced_step_ms', float('nan')):.3f} ms; kernels {k.get('launches_per_step')} "
            f"launches, {k.get('us_per_step', 0):.0f} us (GEMM {k.get('gemm_us_per_step', 0):.0f} us in "
            f"{k.get('gemm_launches_per_step')}; other {k.get('other_us_per_step', 0):.0f} us in "
            f"{k.get('other_launches_per_step')}) {r.get('error', '')}",
            flush=True,
        )
        for row in k.get("top", [])[:25]:
            print(f"    {row['us_per_step']:9.1f} us  x{row['launches']:<5g} {row['name'][:110]}")
    if args.out:
        _harness.write_json(args.out, results, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
