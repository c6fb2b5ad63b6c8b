"""Overhead of FP8 training with fp8ax vs Haliax's own FP8, on a Haliax MLP.

Measures, for a model `Embed -> Mlp -> Embed` built from two `haliax.nn.Linear` layers
(GELU in between), trained with mean squared error:

- the jitted train-step time (median over interleaved rounds) of three variants:
    * ``plain``   -- no FP8;
    * ``fp8ax``   -- ``fp8ax.fp8_linear_layers(model)``;
    * ``haliax``  -- ``haliax.quantization.quantize_linear_layers(model, QuantizationConfig(fp8=True))``;
- the compile time of each step: ``eqx.filter_jit(step).lower(...)`` (trace + lower) and
  ``.compile()`` (XLA), each after ``jax.clear_caches()``, median of a few, and the
  Python function calls that one ``.lower(...)`` makes (``cProfile``; the same in every run);
- the StableHLO op count of each step (``.lower(...).as_text()``) and what each
  converted layer adds to it relative to the plain step (see `count_ops` for exactly
  what is counted), plus the instruction count of the optimized HLO;

for float32 and for bfloat16 parameters and inputs. Prints a table and writes JSON.

On the CPU backend FP8 is emulated (XLA upcasts the FP8 operands before the dot), so
CPU step-time ratios measure the overhead of scaling/casting/bookkeeping, not GPU FP8
GEMM speed.

Run::

    python bench/overhead.py                 # full default run (spec sizes)
    python bench/overhead.py --quick         # tiny smoke config (~15 s), writes *_quick.json
    python bench/overhead.py --dtypes float32 --rounds 30 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import haliax as hax
import jax
import jax.numpy as jnp

import _harness
from _overhead_counts import count_hlo, count_ops, lower_python_calls, stablehlo_total
from _overhead_model import (
    Mlp,
    build_model,
    count_fp8_layers,
    fp8_state_dtypes,
    loss_fn,
    make_optimizer,
    make_step,
    opt_params,
)
from _overhead_report import print_table

HERE = _harness.HERE
DEFAULT_OUT = _harness.RESULTS / "overhead_cpu.json"
QUICK_OUT = _harness.RESULTS / "overhead_cpu_quick.json"

VARIANTS = ("plain", "fp8ax", "fp8ax-cal", "haliax")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# --------------------------------------------------------------------------------------
# Benchmark


def run_dtype(args, dtype_name: str, log) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    Batch = hax.Axis("batch", args.batch)
    Embed = hax.Axis("embed", args.embed)
    Hidden = hax.Axis("mlp", args.hidden)
    k_model, k_x, k_y = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    base = Mlp.init(Embed, Hidden, key=k_model)
    x = hax.random.normal(k_x, (Batch, Embed)).astype(dtype)
    y = hax.random.normal(k_y, (Batch, Embed)).astype(dtype)
    opt = make_optimizer(args.optimizer, args.lr)

    variants = [v for v in VARIANTS if v in args.variants]
    states, steps, info = {}, {}, {}
    for v in variants:
        model = build_model(v, base, dtype, (x, y))
        opt_state = opt.init(opt_params(model, v))
        states[v] = (model, opt_state)
        steps[v] = make_step(v, opt)
        info[v] = {"fp8_layers": count_fp8_layers(model), "fp8_state_dtypes": fp8_state_dtypes(model)}

    # ---- lowering, op counts and compile time (interleaved, median of compile_reps) ----
    # Rep 0 is untimed: it absorbs one-time costs (first tracing of jnp/haliax helpers,
    # LLVM start-up) and gives the op counts. The order of the variants rotates per rep.
    lower_s = {v: [] for v in variants}
    compile_s = {v: [] for v in variants}
    for rep in range(args.compile_reps + 1):
        for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            model, opt_state = states[v]
            # Drop JAX's in-memory tracing/lowering/executable caches, so every rep
            # traces, lowers and compiles from scratch.
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = steps[v].lower(model, opt_state, x, y)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            if rep > 0:
                lower_s[v].append(t1 - t0)
                compile_s[v].append(t2 - t1)
            else:
                text = lowered.as_text()
                ops = count_ops(text)
                hlo = count_hlo(compiled.compiled.as_text())
                info[v].update(
                    stablehlo_ops=stablehlo_total(ops["textual"]),
                    stablehlo_ops_inlined=stablehlo_total(ops["inlined"]),
                    calls=ops["calls"],
                    private_funcs=ops["private_funcs"],
                    hlo_instructions_total=hlo["total"],
                    hlo_instructions_entry=hlo["entry"],
                    hlo_entry_kernels=hlo["kernels"],
                    op_counts=dict(ops["textual"].most_common()),
                    op_counts_inlined=dict(ops["inlined"].most_common()),
                )
                if args.dump_dir:
                    d = Path(args.dump_dir)
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"{v}_{dtype_name}.stablehlo.mlir").write_text(text)
                    (d / f"{v}_{dtype_name}.optimized.hlo").write_text(compiled.compiled.as_text())
    for v in variants:
        total = [a + b for a, b in zip(lower_s[v], compile_s[v])]
        info[v]["lower_compile_s_median"] = statistics.median(total)
        info[v]["lower_s_median"] = statistics.median(lower_s[v])
        info[v]["compile_s_median"] = statistics.median(compile_s[v])
        info[v]["lower_s_all"] = lower_s[v]
        info[v]["compile_s_all"] = compile_s[v]
        info[v]["lower_python_calls"] = lower_python_calls(steps[v], *states[v], x, y)

    def call(v):
        states[v] = jax.block_until_ready(steps[v](*states[v], x, y))

    # ---- warm-up (first call compiles through the jit cache) ----
    _harness.interleaved(call, variants, 0, warmup=args.warmup)
    # ---- timed rounds, interleaved; the order rotates each round ----
    t_start = time.perf_counter()
    times = _harness.interleaved(call, variants, args.rounds)
    rounds_wall = time.perf_counter() - t_start

    for v in variants:
        info[v]["step_s_median"] = statistics.median(times[v])
        info[v]["step_s_min"] = min(times[v])
        if len(times[v]) >= 4:
            q = statistics.quantiles(times[v], n=4)
            info[v]["step_s_p25"], info[v]["step_s_p75"] = q[0], q[2]
        info[v]["step_s_all"] = times[v]
        loss = loss_fn(states[v][0], x, y)
        info[v]["final_loss"] = float(loss)

    # ---- ratios vs plain ----
    if "plain" in info:
        p = info["plain"]
        for v in variants:
            if v == "plain":
                continue
            n = max(info[v]["fp8_layers"], 1)
            info[v]["vs_plain"] = {
                "step_ratio": info[v]["step_s_median"] / p["step_s_median"],
                "compile_ratio": info[v]["lower_compile_s_median"] / p["lower_compile_s_median"],
                "xla_compile_ratio": info[v]["compile_s_median"] / p["compile_s_median"],
                "lower_ratio": info[v]["lower_s_median"] / p["lower_s_median"],
                "stablehlo_ops_added_per_layer": (info[v]["stablehlo_ops"] - p["stablehlo_ops"]) / n,
                "stablehlo_ops_inlined_added_per_layer": (info[v]["stablehlo_ops_inlined"] - p["stablehlo_ops_inlined"])
                / n,
                "hlo_entry_instructions_added_per_layer": (
                    info[v]["hlo_instructions_entry"] - p["hlo_instructions_entry"]
                )
                / n,
                "hlo_entry_kernels_added_per_layer": (info[v]["hlo_entry_kernels"] - p["hlo_entry_kernels"]) / n,
                "hlo_total_instructions_added_per_layer": (
                    info[v]["hlo_instructions_total"] - p["hlo_instructions_total"]
                )
                / n,
                "op_kinds_added_per_layer_inlined": _diff_counts(
                    info[v]["op_counts_inlined"], p["op_counts_inlined"], n
                ),
                "op_kinds_added_per_layer_textual": _diff_counts(info[v]["op_counts"], p["op_counts"], n),
            }
    log(f"  [{dtype_name}] {args.rounds} rounds took {rounds_wall:.1f}s")
    return {"variants": info, "rounds_wall_s": rounds_wall}


def _diff_counts(a: dict, b: dict, n: int) -> dict[str, float]:
    keys = set(a) | set(b)
    d = {k: (a.get(k, 0) - b.get(k, 0)) / n for k in keys}
    return dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: (-kv[1], kv[0])))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, each runs every variant once (default 50)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 256)")
    p.add_argument("--embed", type=int, default=None, help="Embed axis size (default 1024)")
    p.add_argument("--hidden", type=int, default=None, help="Mlp axis size (default 4096)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant before timing (default 3)")
    p.add_argument(
        "--compile-reps", type=int, default=None, help="timed compiles per variant, after one untimed (default 5)"
    )
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke config: embed 64, hidden 128, batch 16, rounds 3")
    p.add_argument(
        "--out",
        default=None,
        help=f"JSON output path (default {DEFAULT_OUT.relative_to(HERE.parent)}; "
        f"with --quick {QUICK_OUT.relative_to(HERE.parent)}); '' for none",
    )
    p.add_argument("--dump-dir", default=None, help="also write each step's StableHLO and optimized HLO here")
    args = p.parse_args(argv)

    defaults = dict(rounds=50, batch=256, embed=1024, hidden=4096, warmup=3, compile_reps=5)
    quick = dict(rounds=3, batch=16, embed=64, hidden=128, warmup=1, compile_reps=1)
    for k, v in (quick if args.quick else defaults).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = str(QUICK_OUT if args.quick else DEFAULT_OUT)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {VARIANTS}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.compile_reps < 1:
        p.error("--compile-reps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first call compiles)")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    jax.config.update("jax_enable_compilation_cache", False)  # no persistent cache hits
    load_before = _harness.loadavg()
    t0 = time.perf_counter()
    log(
        f"fp8ax overhead benchmark: batch {args.batch}, embed {args.embed}, hidden {args.hidden}, "
        f"rounds {args.rounds}, dtypes {args.dtypes}, optimizer {args.optimizer}, backend {jax.default_backend()}"
    )
    results = {}
    for d in args.dtypes:
        log(f"running {d} ...")
        results[d] = run_dtype(args, d, log)
    total = time.perf_counter() - t0

    print_table(results)
    payload = {
        "benchmark": "bench/overhead.py",
        "machine": _harness.machine(),
        "config": {
            "batch": args.batch,
            "embed": args.embed,
            "hidden": args.hidden,
            "fp8_layers": 2,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "compile_reps": args.compile_reps,
            "dtypes": args.dtypes,
            "variants": args.variants,
            "optimizer": args.optimizer,
            "lr": args.lr,
            "seed": args.seed,
            "quick": args.quick,
            "model": "Mlp: hnn.Linear(Embed->Mlp) -> gelu -> hnn.Linear(Mlp->Embed), MSE loss",
            "step": "eqx.filter_jit(filter_grad -> partition_for_grad_overwrite -> optax update -> apply_updates)",
            "timing": "per round each variant runs one step in turn (order rotates each round), "
            "jax.block_until_ready; median over rounds",
            "compile_time": "wall time of eqx.filter_jit(step).lower(...) (trace+lower) and of .compile() (XLA), "
            "after jax.clear_caches(); lower_compile_s = their sum; medians over compile_reps; "
            "compile_ratio uses lower_compile_s, xla_compile_ratio only .compile()",
            "op_count": "stablehlo_ops: lines of Lowered.as_text() whose op name starts with 'stablehlo.' "
            "(with or without a result, stablehlo.return included; a private func such as @_where or @clip "
            "counted once however often it is called); stablehlo_ops_inlined: the same with every `call` "
            "replaced by the callee's ops; hlo_instructions_total/entry: instructions of Compiled.as_text() "
            "(optimized, post-fusion HLO) in all computations / in the ENTRY computation; "
            "*_added_per_layer = (variant - plain) / fp8_layers",
        },
        "total_wall_s": total,
        "loadavg_before": load_before,
        "loadavg_after": _harness.loadavg(),
        "results": results,
    }
    if args.out:
        log(f"wrote {_harness.write_json(args.out, payload)}")
    log(f"total wall time {total:.1f}s")
    return payload


if __name__ == "__main__":
    main()
