"""What FP8 training costs and gains on a GPU: time to the first step, the step, single GEMMs, a grouped GEMM.

One command for one lent GPU (H100, H200...), sized to fit a 6-minute device call. It runs
a list of **parts**, each in a fresh Python process of its own (this script again, with
``--part NAME``) under its own wall-clock limit, one after the other, and gathers what they
measured into one JSON file and Markdown tables:

- ``decoder:<variant>``: one training step of one Llama-shaped decoder layer written with
  Haliax (RMSNorm, causal self-attention with 32 heads of 128, RMSNorm, SwiGLU MLP 4096 ->
  14336 -> 4096, residuals; the 7 projections are bias-free ``haliax.nn.Linear``), batch
  4 x 2048 tokens, bf16 parameters (``fp8ax.cast_floating``), MSE against a fixed random
  target, ``optax.adam(1e-4)``, the step as a user writes it (``eqx.filter_jit`` of
  ``filter_grad``, ``fp8ax.partition_for_grad_overwrite``, ``opt.update``,
  ``fp8ax.apply_updates``). Variants: ``bf16`` (plain Equinox step), ``haliax_fp8``
  (``haliax.quantization``), ``fp8ax`` (``Fp8Config()``), ``fp8ax_current``
  (``CurrentScaling``), ``fp8ax_mx`` (``MXScaling``), ``fp8ax_nofirst``
  (``DelayedScaling(calibrate_first_call=False)``). Measured, in this order: the first
  call (what a user waits for, in a fresh process, model already built), the first two
  steps, how often the step was traced and compiled over its first 3 steps, ``--steps``
  timed steps (median, quartiles, min), the linear layers' TFLOP/s, the FP8 GEMM check of
  the compiled step (bench/gpu_hlo.py; 21 GEMMs), the loss; with ``--split-compile``, also
  ``step.lower`` and ``.compile()`` timed apart after ``jax.clear_caches()`` (a recompile).
- ``decoder-warm:fp8ax``: ``decoder:fp8ax`` again in a new process with JAX's persistent
  compilation cache that ``decoder:fp8ax`` filled in this run: the first step after a
  restart, and the cache misses of the step (zero when it was served from the cache).
  (``decoder-warm:<variant>`` works for every decoder variant.)
- ``gemm:<shape>:<pass>``: ``y = x @ w.T`` through a one-layer module (bench/gpu.py's
  ``GemmLayer``), ``square_8192`` (8192^3) and ``llama_up`` (8192 x 4096 -> 14336),
  forward (``fwd``: 1 GEMM) or forward and backward (``fwd_bwd``: 3 GEMMs), bf16 vs
  ``fp8ax`` (direct mode, default recipe, its state filled by one untimed call) vs
  ``haliax_fp8``, timed interleaved in one process; with the FP8 check of each.
- ``moe``: a grouped GEMM forward and backward, ``fp8ax.Fp8RaggedDot`` vs
  ``jax.lax.ragged_dot`` in bf16 (8 experts, 8192 tokens with uneven groups, 4096 ->
  14336), and what XLA built for it (the GEMMs' output shapes and FLOPs against the useful
  FLOPs: a dense GEMM over every (token, expert) pair does 8x).

Every part appends JSON lines to a file as it goes, so one cut short by its time limit
still reports what it measured (``"timed_out": true``). The parent never initializes a
JAX backend (the GPU stays free for the parts), skips the parts that cannot start with
their minimum time left in ``--budget-s`` (``"skipped": "budget"``), and exits 0 even when
a part fails (1 only with ``--strict`` when an FP8 check fails on a GPU).

Without a GPU (``jax.default_backend() != "gpu"`` in the parts), or with ``--dry``, every
size is divided (hidden 128, 4 heads of 32, MLP 448, 2 x 64 tokens, GEMMs and MoE / 64),
with 2 timed steps and 2 GEMM reps: a smoke test of the script whose timings mean nothing;
the FP8 check reads "n/a on cpu".

Run::

    python bench/gpu_train.py                      # on a GPU; bench/results/gpu_train_<device>.json
    python bench/gpu_train.py --dry                # tiny sizes; bench/results/gpu_train_dry_<backend>.json
    python bench/gpu_train.py --parts decoder:bf16,decoder:fp8ax,gemm:square_8192:fwd_bwd
    python bench/gpu_train.py --xla-flags-variant notriton=--xla_gpu_enable_triton_gemm=false \\
        --parts decoder:fp8ax,decoder:fp8ax@notriton --autotune-log-dir /tmp/autotune
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

T_IMPORT = time.perf_counter()  # before the JAX imports: a part's import time starts here

# JAX is imported, never initialized in the parent (no backend, no GPU memory). The part
# modules: what runs (_train_parts), the decoder (_train_decoder), the GEMM and MoE parts
# (_train_gemm), a part's records (_train_record), the parent (_train_parent) and its
# tables (_train_report).
import jax  # noqa: E402

from _train_decoder import run_decoder  # noqa: E402
from _train_gemm import run_gemm, run_moe  # noqa: E402
from _train_parent import parent_main  # noqa: E402
from _train_parts import (  # noqa: E402  (DEFAULT_PARTS and parse_parts: tests/test_bench_gpu_train.py reads them here)
    DEFAULT_PARTS as DEFAULT_PARTS,
    parse_parts as parse_parts,
    part_base,
)
from _train_record import Events, Recorder, child_machine, error_info  # noqa: E402

# --------------------------------------------------------------------------------------
# Child: entry


def child_main(args) -> int:
    rec = Recorder(args.lines, T_IMPORT)
    rec(child_started=True, import_s=time.perf_counter() - T_IMPORT)
    try:
        if args.cache_dir:  # before anything compiles
            jax.config.update("jax_compilation_cache_dir", args.cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        events = Events()
        t0 = time.perf_counter()
        machine = child_machine()  # initializes the backend
        backend = machine["backend"]
        args.dry = args.dry or backend != "gpu"
        if args.dry:
            args.steps = min(args.steps, 2)
            args.gemm_reps = min(args.gemm_reps, 2)
        rec(
            machine=machine,
            backend_init_s=time.perf_counter() - t0,
            dry=args.dry,
            cache_dir=args.cache_dir,
            monitoring_listeners=events.installed,
        )
        kind, _, rest = part_base(args.part).partition(":")
        if kind in ("decoder", "decoder-warm"):
            run_decoder(args, rec, events, rest, backend)
        elif kind == "gemm":
            shape, pass_name = rest.split(":")
            run_gemm(args, rec, shape, pass_name, backend)
        elif kind == "moe":
            run_moe(args, rec, backend)
        else:
            raise ValueError(f"unknown part {args.part!r}")
        rec(done=True, part_wall_s=time.perf_counter() - T_IMPORT)
        return 0
    except BaseException as e:  # reported to the parent through the lines file
        rec(error=error_info(e))
        return 1


# --------------------------------------------------------------------------------------
# Command line


def _pairs(items: list[str], what: str, convert=str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {item!r}")
        out[key] = convert(value)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_train_<device>.json); '' for none")
    p.add_argument("--parts", default=None, help="comma-separated parts, 'decoder', 'gemm' or 'all' (default)")
    p.add_argument("--dry", action="store_true", help="tiny sizes even on a GPU (automatic without one)")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget for all parts (default 330)")
    p.add_argument("--steps", type=int, default=20, help="timed decoder steps after 3 warm-up steps (dry: 2)")
    p.add_argument("--gemm-reps", type=int, default=20, help="interleaved GEMM samples per variant (dry: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split-compile",
        action="store_true",
        help="decoder parts also time step.lower() and .compile() apart after jax.clear_caches() (recompiles)",
    )
    p.add_argument("--no-fp8-check", action="store_true", help="skip the decoder parts' FP8 check (a recompile)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="persistent compilation cache for decoder:fp8ax and decoder-warm:fp8ax (default: a fresh temporary one)",
    )
    p.add_argument("--no-cache", action="store_true", help="no persistent cache, no decoder-warm part")
    p.add_argument(
        "--xla-flags-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="XLA flags that a part suffixed @NAME adds to XLA_FLAGS (repeatable; @triton is predefined: "
        "--xla_gpu_enable_triton_gemm=true, XLA's default)",
    )
    p.add_argument(
        "--base-xla-flags",
        default="--xla_gpu_enable_triton_gemm=false",
        help="XLA flags every part adds to XLA_FLAGS before its own (default: no Triton GEMMs, the setting "
        "docs/gpu.md recommends; with XLA's Triton GEMMs the fp8ax decoder alone compiles for minutes). "
        "'' for XLA's defaults",
    )
    p.add_argument("--autotune-log-dir", default=None, help="parts write XLA's autotuning logs to DIR/<part>.textproto")
    p.add_argument(
        "--part-timeout", action="append", default=[], metavar="PART=SECONDS", help="override a part's time limit"
    )
    p.add_argument(
        "--min-start", action="append", default=[], metavar="PART=SECONDS", help="override the least time to start"
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when an FP8 check fails")
    # The child's arguments (set by the parent).
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lines", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.flag_variants = {
        "triton": "--xla_gpu_enable_triton_gemm=true",
        **_pairs(args.xla_flags_variant, "--xla-flags-variant"),
    }
    args.part_timeouts = _pairs(args.part_timeout, "--part-timeout", float)
    args.min_start = _pairs(args.min_start, "--min-start", float)
    if args.steps < 1 or args.gemm_reps < 1:
        p.error("--steps and --gemm-reps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return child_main(args)
    return parent_main(args, T_IMPORT)


if __name__ == "__main__":
    sys.exit(main())
