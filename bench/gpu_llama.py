"""FP8 training of a Llama-3-8B-shaped decoder stack on one GPU, as Levanter builds it.

The model: ``--layers`` decoder layers (default 4) of Llama-3-8B's sizes (hidden 4096, 32
heads of 128, SwiGLU MLP 14336), written with Haliax: RMSNorm, q/k/v/o projections,
causal attention through ``jax.nn.dot_product_attention`` (cuDNN's fused kernel on a GPU,
XLA's elsewhere), RMSNorm, gate/up/down projections, residuals; bias-free
``haliax.nn.Linear`` throughout; no embedding, rotary embedding or head (they hold no
GEMM FP8 changes). Batch 8 x 2048 = 16384 tokens per step, bf16 parameters, MSE against a
fixed target, Adam. Three layouts: ``scan_remat`` (``hax.nn.Stacked`` with
``gradient_checkpointing=True``: Levanter's default), ``scan`` (Stacked, no remat) and
``unrolled`` (a tuple of layers).

Variants (the step as README.md writes it, ``eqx.filter_jit``):
- ``bf16``: the plain model, XLA's default options;
- ``bf16_notriton``: the same step compiled with ``fp8ax.compiler_options()``;
- ``fp8ax``: ``fp8ax.fp8_linear_layers`` (the default recipe, delayed scaling), the
  documented optimizer ``fp8ax.skip_fp8_state(optax.adam(...))``, compiled with
  ``fp8ax.compiler_options()``;
- ``fp8ax_current``: the same with ``Fp8Config(recipe=fp8ax.CurrentScaling())``;
- ``fp8ax_nocal``: the same with ``DelayedScaling(calibrate_first_call=False)`` (what
  the first call's calibration costs a settled step);
- ``haliax_fp8``: ``haliax.quantization`` (its optimizer built on the model without its
  FP8 state), compiled with ``fp8ax.compiler_options()`` too.

Each ``stack:<variant>:<layout>`` part measures the first call (trace, XLA compile with
its autotuning, one step: what a user waits for in a fresh process), pipelined throughput
(``--steps`` steps dispatched back to back, one block at the end: tokens/s, and MFU
against a dense bf16 peak of 989 TFLOP/s with the model FLOPs of a step, recomputation
not counted), the blocked step latency (median and quartiles), the loss after the steps
and the FP8 GEMM check of the compiled step (``fp8ax.gemm_report``). The ``gemm`` part
times one 8192^3 GEMM's forward and backward passes (3 GEMMs, ``jax.vjp``) in bf16 with
and without the options and through ``fp8ax.Fp8DotGeneral`` with them; ``gemm_triton``
times the FP8 one compiled with XLA's default options (Triton candidates autotuned).
``profile:<variant>`` (the ``scan_remat`` stack) and ``profile:gemm`` (the GEMM cases)
read the GPU kernels of a ``jax.profiler`` trace taken with
``--xla_enable_command_buffers_during_profiling=true``: launches, GPU busy time, GEMMs
against the rest, the top kernels (the traced wall time includes the tracer's own cost).

Every part runs in a fresh process (this script with ``--part``) under its own time
limit, writing a JSON line per result as it goes, so a part cut short still reports. The
parent skips a part whose limit no longer fits ``--budget-s``. Without a GPU, or with
``--dry``, every size shrinks (2 layers of hidden 128, 2 x 64 tokens, GEMM 256^3, 2 steps):
a smoke test whose timings mean nothing.

Run::

    python bench/gpu_llama.py                 # on a GPU: bench/results/gpu_llama_<device>.json and .md
    python bench/gpu_llama.py --dry           # tiny sizes, one process per part
    python bench/gpu_llama.py --dry --in-process --parts stack:fp8ax:scan_remat,gemm
    python bench/gpu_llama.py --parts profile:gemm,gemm_triton --limit gemm_triton=200
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness
from _llama_measure import Recorder, run_gemm, run_profile, run_stack
from _llama_report import gather, table

FULL = {"layers": 4, "hidden": 4096, "heads": 32, "head_size": 128, "mlp": 14336, "batch": 8, "seq": 2048, "gemm": 8192}
DRY = {"layers": 2, "hidden": 128, "heads": 4, "head_size": 32, "mlp": 448, "batch": 2, "seq": 64, "gemm": 256}
VARIANTS = ("bf16", "bf16_notriton", "fp8ax", "fp8ax_current", "fp8ax_nocal", "haliax_fp8")
LAYOUTS = ("scan_remat", "scan", "unrolled")
# In priority order: what the targets need first.
DEFAULT_PARTS = (
    "gemm",
    *(f"stack:{v}:scan_remat" for v in ("bf16", "fp8ax", "fp8ax_current", "haliax_fp8")),
    *(f"stack:{v}:scan" for v in ("bf16", "fp8ax")),
    *(f"stack:{v}:unrolled" for v in ("bf16", "fp8ax")),
    "profile:fp8ax",
    "gemm_triton",
    "profile:fp8ax_current",
    "stack:bf16_notriton:scan_remat",
    "stack:fp8ax_current:scan",
    "stack:haliax_fp8:scan",
)
LIMITS = {"gemm": 60, "gemm_triton": 75, "stack": 45, "stack-unrolled": 60, "profile": 45}
PROFILE_FLAG = "--xla_enable_command_buffers_during_profiling=true"


OVERRIDES: dict[str, int] = {}


def limit(part: str) -> int:
    if part in OVERRIDES:
        return OVERRIDES[part]
    if part.startswith("profile:"):
        return LIMITS["profile"]
    if part.startswith("stack:"):
        return LIMITS["stack-unrolled" if part.endswith(":unrolled") else "stack"]
    return LIMITS[part]


# --------------------------------------------------------------------------------------
# Child side: what one part measures (bench/_llama_measure.py). JAX is imported in the
# functions only.


def child(part: str, out: Path, dry: bool, steps: int) -> None:
    import jax

    gpu = jax.default_backend() == "gpu" and not dry
    s = FULL if gpu else DRY
    rec = Recorder(out, part)
    rec(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__)
    if part.startswith("stack:"):
        _, variant, layout = part.split(":")
        run_stack(rec, variant, layout, s, steps if gpu else 2, gpu)
    elif part == "profile:gemm":
        run_gemm(rec, s["gemm"], gpu, triton=False, profile=True)
    elif part.startswith("profile:"):
        run_profile(rec, part.split(":")[1], s, gpu)
    else:
        run_gemm(rec, s["gemm"], gpu, triton=part == "gemm_triton")


# --------------------------------------------------------------------------------------
# Parent side: no JAX here, so that the GPU is free for the parts.


def check_part(part: str) -> None:
    fields = part.split(":")
    ok = (
        part in ("gemm", "gemm_triton")
        or (len(fields) == 3 and fields[0] == "stack" and fields[1] in VARIANTS and fields[2] in LAYOUTS)
        or (len(fields) == 2 and fields[0] == "profile" and fields[1] in (*VARIANTS, "gemm"))
    )
    if not ok:
        raise SystemExit(
            f"--parts: unknown part {part!r}; expected gemm, gemm_triton, stack:<variant>:<layout> or "
            f"profile:<variant>, with variant in {VARIANTS} and layout in {LAYOUTS}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    ap.add_argument("--steps", type=int, default=20, help="pipelined steps (the blocked ones: half as many)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip parts whose limit no longer fits")
    ap.add_argument("--dry", action="store_true", help="tiny sizes, on any backend")
    ap.add_argument("--limit", action="append", default=[], help="PART=SECONDS: another time limit for a part")
    ap.add_argument("--in-process", action="store_true", help="run the parts here, without limits (tests)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/gpu_llama_<...>.json)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--lines", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        child(args.part, args.lines, args.dry, args.steps)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        check_part(p)
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if not seconds.isdigit() or int(seconds) == 0:
            raise SystemExit(f"--limit: expected PART=SECONDS with a whole number of seconds > 0, got {item!r}")
        check_part(part)
        OVERRIDES[part] = int(seconds)
    lines = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    deadline = time.time() + args.budget_s
    status: dict[str, str] = {}
    for part in parts:
        if args.in_process:
            child(part, lines, args.dry, args.steps)
            continue
        if time.time() + limit(part) > deadline:
            status[part] = f"skipped: {limit(part)} s limit past the {args.budget_s:.0f} s budget"
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--lines", str(lines)]
        cmd += ["--steps", str(args.steps)] + (["--dry"] if args.dry else [])
        t0 = time.time()
        env = dict(os.environ)
        if part.startswith("profile:"):  # profile the program as it runs untraced: with command buffers
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + PROFILE_FLAG).strip()
        try:
            done = subprocess.run(cmd, timeout=limit(part), capture_output=True, text=True, env=env)
            if done.returncode:
                status[part] = f"failed (exit {done.returncode}): " + done.stderr.strip()[-1500:]
        except subprocess.TimeoutExpired:
            status[part] = f"timed out after {limit(part)} s"
        print(f"{part}: {time.time() - t0:.1f} s {status.get(part, 'ok')[:300]}", flush=True)
    results = gather(lines)
    for part, st in status.items():
        results.setdefault(part, {})["status"] = st
    device = next((r["device"] for r in results.values() if "device" in r), "unknown")
    tag = "dry" if args.dry else device.lower().replace(" ", "_")
    out = args.out or _harness.RESULTS / f"gpu_llama_{tag}.json"
    meta = {"machine": platform.node(), "python": _harness.python_version(), "date": time.strftime("%Y-%m-%d")}
    _harness.write_json(out, {"meta": meta, "parts": results}, indent=1, default=str)
    out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
