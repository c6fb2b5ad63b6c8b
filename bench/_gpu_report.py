"""bench/gpu.py's Markdown tables."""

from __future__ import annotations

import sys
from typing import Any

from _gpu_check import FP8_GEMM_TARGET


def _fmt_check(info: dict[str, Any]) -> tuple[str, str, str]:
    if "error" in info:
        return "-", "-", "ERROR"
    c, r = info["fp8_check"], info["gemm_report"]
    found = f"{c['found']}/{c['expected']}" if c["status"] != "baseline" else f"{c['found']}"
    rep = f"{r['lowered_fp8']}/{r['lowered_total']}, {r['compiled_fp8']}/{r['compiled_total']}"
    return found, rep, "-" if c["status"] == "baseline" else c["status"]


def _fmt_time(info: dict[str, Any]) -> tuple[str, str, str, str]:
    if "median_s" not in info:
        return "-", "-", "-", "-"
    sp = info.get("speedup_vs_bf16")
    return (
        f"{info['median_s'] * 1e3:.3f}",
        f"{info['p25_s'] * 1e3:.3f}-{info['p75_s'] * 1e3:.3f}",
        f"{info['tflops']:.1f}" if info["tflops"] >= 0.1 else f"{info['tflops']:.3g}",
        f"{sp:.2f}" if sp else "-",
    )


def print_tables(payload: dict[str, Any], out=sys.stdout) -> None:
    cols = (
        "ms (median)",
        "ms (p25-p75)",
        "TFLOP/s",
        "x bf16",
        "FP8 GEMMs found/expected",
        "gemm_report lowered, compiled FP8/total",
        "FP8 check",
    )
    if payload["gemm"]:
        print("\n### Single GEMMs\n", file=out)
        print("| shape | M x K -> N | pass | variant | " + " | ".join(cols) + " |", file=out)
        print("|---|---|---|---|" + "---:|" * 4 + "---|---|---|", file=out)
        for e in payload["gemm"]:
            for v, info in e["variants"].items():
                print(
                    f"| {e['shape']} | {e['m']} x {e['k']} -> {e['n']} | {e['pass']} | {v} | "
                    + " | ".join(_fmt_time(info) + _fmt_check(info))
                    + " |",
                    file=out,
                )
    if payload["mlp"]:
        m = payload["mlp"]
        print(
            f"\n### MLP block train step (tokens {m['tokens']}, hidden {m['hidden']} -> mlp {m['mlp']} -> hidden, "
            f"bf16, {m['optimizer']})\n",
            file=out,
        )
        print("| variant | " + " | ".join(cols) + " |", file=out)
        print("|---|" + "---:|" * 4 + "---|---|---|", file=out)
        for v, info in m["variants"].items():
            print(f"| {v} | " + " | ".join(_fmt_time(info) + _fmt_check(info)) + " |", file=out)
    print(
        f'\nFP8 GEMMs: custom calls with custom_call_target="{FP8_GEMM_TARGET}" in the optimized HLO, '
        "against the GEMMs the function should run in FP8 (1 forward, 3 forward+backward, 5 in the MLP "
        "step: 3 per layer less the first layer's input gradient, which nothing needs).\ngemm_report: fp8ax.gemm_report's lowered_fp8/lowered_total, "
        "compiled_fp8/compiled_total. TFLOP/s counts 2*M*N*K per GEMM.",
        file=out,
    )
