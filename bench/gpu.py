"""FP8 GEMM and MLP-block speed on a GPU: bf16 vs fp8ax (direct, qdq) vs Haliax's own FP8.

One command measures, on the first JAX device:

- **single GEMMs**, ``y = x @ w.T`` as a linear layer computes it (``x``: tokens x in
  features, ``w``: out features x in features, the layout of ``haliax.nn.Linear`` and
  ``eqx.nn.Linear``), at square sizes 4096, 8192 and 16384 and at the MLP shapes of
  Llama-3 8B and 70B. Each shape is timed forward only (1 GEMM) and forward plus
  backward (``eqx.filter_value_and_grad`` of ``sum(y * g)`` with respect to the layer and
  ``x``: 3 GEMMs, forward, input gradient and weight gradient);
- **a transformer MLP block train step** (``haliax.nn.Linear`` up, GELU,
  ``haliax.nn.Linear`` down, no biases, bf16 parameters via ``fp8ax.cast_floating``,
  mean squared error, optax Adam or SGD, ``eqx.filter_jit`` step with
  ``fp8ax.partition_for_grad_overwrite`` / ``fp8ax.apply_updates`` as in
  ``bench/overhead.py``);

in four variants:

- ``bf16``          -- plain ``lax.dot_general`` on bf16 operands (bf16 result; XLA
  accumulates in float32, as for ``jnp.matmul``);
- ``fp8ax_direct``  -- ``fp8ax.Fp8DotGeneral.init(mode="direct")``
  (``fp8ax.Fp8Config(mode="direct")`` for the MLP block);
- ``fp8ax_qdq``     -- ``fp8ax.Fp8DotGeneral.init(mode="qdq")``;
  both fp8ax variants are run through ``fp8ax.calibrate`` on the timed data first, so the
  timed program is pure delayed scaling (no first-call conditional);
- ``haliax_fp8``    -- ``haliax.quantization.Fp8DotGeneralOp.init()``
  (``quantize_linear_layers(model, QuantizationConfig(fp8=True))`` for the MLP block);

and reports the median time (and quartiles), TFLOP/s (2*M*N*K per GEMM) and the
speed-up over bf16.

It also checks that every GEMM an FP8 variant should run in FP8 compiled to an FP8 GEMM,
on either path XLA:GPU's autotuner may pick: it counts, in the optimized HLO
(``jitted.lower(...).compile().as_text()``, read by bench/gpu_hlo.py), the FP8 cuBLASLt
calls (``custom_call_target`` ``__cublas$lt$matmul$f8``; bf16 ones are ``__cublas$gemm``
or ``__cublas$lt$matmul``) and the Triton or cuDNN GEMM fusions whose dot multiplies FP8
values, and compares the count with the GEMMs the function has: 1 forward, 3
forward+backward, 5 in the MLP train step (3 per layer, less the input gradient of the
first layer, which nothing needs: the input is data). ``gemm_paths`` in the JSON says
which path each GEMM took and the dtype it writes. ``fp8ax.gemm_report`` of the same function goes in the JSON too.

Without a GPU (``jax.default_backend() != "gpu"``), or with ``--dry``, it runs the same
code on tiny shapes (every size divided by 64) with 1 warm-up and 2 reps: a smoke test of
the script (about 25 s on a 2-core CPU), whose timings mean nothing. The FP8 check then reads "n/a on cpu". On a
GPU, a failed FP8 check (or a variant that errors) makes the exit status 1, after
everything has been printed and written.

Run::

    python bench/gpu.py                          # full run; writes bench/results/gpu_<device>.json
    python bench/gpu.py --dry                    # tiny shapes, ~25 s on a CPU; bench/results/gpu_dry_<backend>.json
    python bench/gpu.py --shapes square_8192,llama3_8b_mlp_up --skip-mlp --reps 50
    python bench/gpu.py --skip-gemm --tokens 16384 --hidden 8192 --mlp 28672
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from typing import Any

import jax

import _harness
from _gpu_check import (  # the names tests/test_bench_gpu.py reads from this script
    FP8_GEMM_TARGET as FP8_GEMM_TARGET,
    count_fp8_cublaslt as count_fp8_cublaslt,
    count_gemm_kernels as count_gemm_kernels,
    fp8_check as fp8_check,
    summarise,
)
from _gpu_measure import DRY_DIVISOR, MLP_DEFAULTS, MLP_DRY, SHAPE_NAMES, run_gemms, run_mlp
from _gpu_report import print_tables

RESULTS = _harness.RESULTS

# --------------------------------------------------------------------------------------
# Machine information


def machine_info() -> dict[str, Any]:
    nvidia_smi = None
    if shutil.which("nvidia-smi"):
        nvidia_smi = _harness.command(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        )
    return {
        "device_kind": _harness.device_kind(),
        "devices": [repr(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "versions": _harness.gpu_versions(),
        "nvidia_smi": nvidia_smi,
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "git_commit": _harness.git_commit(),
        "src_uncommitted_changes": _harness.src_changes(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": _harness.now(),
    }


# --------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dry",
        action="store_true",
        help="tiny shapes (sizes / 64), 1 warm-up, 2 reps, even on a GPU (automatic without a GPU)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON output path (default bench/results/gpu_<device kind>.json; "
        "dry pass bench/results/gpu_dry_<backend>.json); '' for none",
    )
    p.add_argument("--reps", type=int, default=None, help="timed samples per variant (default 30; dry 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant first (default 3; dry 1)")
    p.add_argument(
        "--inner",
        type=int,
        default=None,
        help="GEMM calls per timed sample, blocked once; 0 = enough for --sample-ms (default 0; dry 1)",
    )
    p.add_argument("--sample-ms", type=float, default=20.0, help="target length of one GEMM sample with --inner 0")
    p.add_argument(
        "--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPE_NAMES)}, or 'all' (default)"
    )
    p.add_argument("--skip-gemm", action="store_true", help="skip the single-GEMM benchmark")
    p.add_argument("--skip-mlp", action="store_true", help="skip the MLP-block train step")
    p.add_argument(
        "--tokens", type=int, default=None, help=f"MLP block: tokens per step (default {MLP_DEFAULTS['tokens']})"
    )
    p.add_argument(
        "--hidden", type=int, default=None, help=f"MLP block: hidden size (default {MLP_DEFAULTS['hidden']})"
    )
    p.add_argument("--mlp", type=int, default=None, help=f"MLP block: MLP size (default {MLP_DEFAULTS['mlp']})")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="MLP block optimizer (default adam)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    args.backend = jax.default_backend()
    args.no_gpu = args.backend != "gpu"
    args.dry = args.dry or args.no_gpu
    full, dry = dict(reps=30, warmup=3, inner=0), dict(reps=2, warmup=1, inner=1)
    for k, v in (dry if args.dry else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in (MLP_DRY if args.dry else MLP_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.shapes is None or args.shapes.strip() == "all":
        args.shapes = ",".join(SHAPE_NAMES)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPE_NAMES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPE_NAMES)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    if args.inner < 0:
        p.error("--inner must be >= 0")
    for k in ("tokens", "hidden", "mlp"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    args.sample_s = args.sample_ms / 1e3
    if args.out is None:
        name = f"gpu_dry_{args.backend}.json" if args.dry else f"gpu_{_harness.slug(_harness.device_kind())}.json"
        args.out = str(RESULTS / name)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    if args.no_gpu:
        print(
            f"No GPU found (backend: {args.backend}): running a small dry pass of the same code on "
            f"{args.backend.upper()}; no timings are meaningful",
            flush=True,
        )
    elif args.dry:
        print("--dry: running a small dry pass on the GPU (sizes / 64); the timings mean little", flush=True)
    device_kind = jax.devices()[0].device_kind
    log(
        f"fp8ax GPU benchmark on {device_kind} (backend {args.backend}){' [dry pass]' if args.dry else ''}: "
        f"reps {args.reps}, warmup {args.warmup}, inner {args.inner or 'auto'}"
    )

    gemm = [] if args.skip_gemm else run_gemms(args, args.backend, log)
    mlp = None if args.skip_mlp else run_mlp(args, args.backend, log)
    payload: dict[str, Any] = {
        "benchmark": "bench/gpu.py",
        "dry": args.dry,
        "meaningful_timings": not args.dry,
        "machine": machine_info(),
        "config": {
            "reps": args.reps,
            "warmup": args.warmup,
            "inner": args.inner,
            "sample_ms": args.sample_ms,
            "shapes": args.shapes,
            "dry_divisor": DRY_DIVISOR if args.dry else 1,
            "skip_gemm": args.skip_gemm,
            "skip_mlp": args.skip_mlp,
            "seed": args.seed,
            "variants": {
                "bf16": "lax.dot_general on bf16 operands (bf16 result, float32 accumulation)",
                "fp8ax_direct": 'fp8ax.Fp8DotGeneral.init(mode="direct") / Fp8Config(mode="direct")',
                "fp8ax_qdq": 'fp8ax.Fp8DotGeneral.init(mode="qdq") / Fp8Config(mode="qdq")',
                "haliax_fp8": "haliax.quantization.Fp8DotGeneralOp.init() / "
                "quantize_linear_layers(QuantizationConfig(fp8=True))",
            },
            "gemm": "y = x @ w.T, x (m, k) bf16, w (n, k) bf16; fwd: the layer call; fwd_bwd: "
            "eqx.filter_value_and_grad of sum(y * g) w.r.t. (layer, x), 3 GEMMs; jax.jit of the flat layer "
            "arrays; FP8 state fixed (fresh) across calls",
            "mlp_block": "hnn.Linear(embed->mlp, no bias) -> gelu -> hnn.Linear(mlp->embed, no bias), bf16 params "
            "(fp8ax.cast_floating), MSE loss; eqx.filter_jit(filter_grad -> partition_for_grad_overwrite "
            "-> optax update -> apply_updates), state threaded through the steps",
            "timing": "after warmup blocked calls, reps samples per variant, interleaved (order rotates per round); "
            "a sample runs `inner` calls back to back and blocks once (jax.block_until_ready); times per call; "
            "median and quartiles",
            "flops": "2*m*n*k per GEMM; fwd 1 GEMM, fwd_bwd 3, MLP step 5 (3 per layer, less the input gradient of the "
            "first layer, which is not computed)",
            "fp8_check": f"FP8 GEMMs in jitted.lower(...).compile().as_text(): custom calls with "
            f'custom_call_target="{FP8_GEMM_TARGET}", or Triton/cuDNN GEMM fusions whose dot '
            "multiplies FP8 values (bench/gpu_hlo.py), expected 1 (fwd), 3 (fwd_bwd), 3 per FP8 layer "
            "less the first layer's input gradient (MLP step: 5); applies only on a GPU",
        },
        "fp8_gemm_target": FP8_GEMM_TARGET,
        "gemm": gemm,
        "mlp": mlp,
    }
    payload["fp8_check"] = summarise(payload)
    payload["total_wall_s"] = time.perf_counter() - t_start

    if args.dry:
        print(f"\n**{'CPU' if args.no_gpu else 'GPU'} dry pass: tiny shapes, timings are meaningless.**", flush=True)
    print_tables(payload)
    s = payload["fp8_check"]
    print(
        f'\nFP8 cuBLASLt check (custom_call_target="{FP8_GEMM_TARGET}"): {s["status"]}'
        + (f" ({s['passed']} functions passed)" if s["status"] == "PASS" else "")
        + (f"; failed: {', '.join(s['failed'])}" if s["failed"] else "")
        + (f"; errors: {', '.join(s['errors'])}" if s["errors"] else ""),
        flush=True,
    )
    if args.out:
        log(f"wrote {_harness.write_json(args.out, payload)}")
    log(f"total wall time {payload['total_wall_s']:.1f}s")
    return 1 if s["errors"] or s["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
