"""bench/gpu_train.py's summary and Markdown tables."""

from __future__ import annotations

import sys
from typing import Any

from _train_parts import part_base, part_kind


def _checks(payload):
    for r in payload["parts"]:
        if "fp8_check" in r and "status" in r["fp8_check"]:
            yield r["part"], r["fp8_check"]
        for v, info in (r.get("variants") or {}).items():
            if "status" in info.get("fp8_check", {}):
                yield f"{r['part']} {v}", info["fp8_check"]


def summarise(payload) -> dict[str, Any]:
    checks = list(_checks(payload))
    return {
        "parts_ok": [r["part"] for r in payload["parts"] if r.get("status") == "ok"],
        "parts_failed": [r["part"] for r in payload["parts"] if r.get("status") in ("error", "crashed")],
        "parts_timed_out": [r["part"] for r in payload["parts"] if r.get("status") == "timed_out"],
        "parts_skipped": [r["part"] for r in payload["parts"] if r.get("status") == "skipped"],
        "fp8_passed": [n for n, c in checks if c["status"] == "PASS"],
        "fp8_failed": [n for n, c in checks if c["status"] == "FAIL"],
    }


def _f(x, fmt="{:.2f}", scale=1.0) -> str:
    return "-" if not isinstance(x, int | float) else fmt.format(x * scale)


def _range(stats: dict[str, Any]) -> str:
    if "p25_s" not in stats:
        return "-"
    return f"{stats['p25_s'] * 1e3:.3f}-{stats['p75_s'] * 1e3:.3f}"


def _check_cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    if "error" in c:
        return "ERROR"
    if "skipped" in c:
        return f"skipped ({c['skipped']})"
    if c["status"] == "baseline":
        return f"({c['found']} FP8)"
    return f"{c['found']}/{c['expected']} {c['status']}"


def print_tables(payload: dict[str, Any], out=sys.stdout) -> None:
    parts = payload["parts"]
    if payload["dry"]:
        print("\n**Dry pass: tiny sizes, timings are meaningless.**", file=out)
    print("\n### Parts\n", file=out)
    print("| part | status | wall s | limit s | note |", file=out)
    print("|---|---|---:|---:|---|", file=out)
    for r in parts:
        note = r.get("skipped") or (f"{r['error']['type']}: {r['error']['message'][:100]}" if "error" in r else "")
        if r.get("timed_out"):
            note = f"cut short after: {', '.join(r.get('last_recorded', [])) or 'nothing recorded'}"
        print(
            f"| {r['part']} | {r['status']} | {_f(r.get('wall_s'), '{:.1f}')} | {_f(r.get('timeout_s'), '{:.0f}')} | "
            f"{note.replace('|', '/').replace(chr(10), ' ')} |",
            file=out,
        )
    dec = [r for r in parts if part_kind(r["part"]) in ("decoder", "decoder-warm") and "config" in r]
    if dec:
        base = next((r for r in dec if part_base(r["part"]) == "decoder:bf16" and "step" in r), None)
        print("\n### Decoder layer train step\n", file=out)
        print(
            "| part | first call s | first 2 steps s | traces / compiles (3 steps) | step ms (median) | p25-p75 | min "
            "| linear TFLOP/s | x bf16 | FP8 GEMMs | loss |",
            file=out,
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|", file=out)
        for r in dec:
            st = r.get("step", {})
            sp = base["step"]["median_s"] / st["median_s"] if base and "median_s" in st else None
            tc = f"{r.get('traces_first_3_steps', '-')} / {r.get('backend_compiles_first_3_steps', '-')}"
            print(
                f"| {r['part']} | {_f(r.get('first_call_s'))} | {_f(r.get('first_settled_s'))} | {tc} | "
                f"{_f(st.get('median_s'), '{:.3f}', 1e3)} | {_range(st)} | "
                f"{_f(st.get('min_s'), '{:.3f}', 1e3)} | {_f(r.get('linear_tflops'), '{:.1f}')} | {_f(sp)} | "
                f"{_check_cell(r.get('fp8_check'))} | {_f(r.get('loss'), '{:.4g}')} |",
                file=out,
            )
        warm = [r for r in dec if r.get("warm_cache")]
        for r in warm:
            cold = next((c for c in dec if c["part"] == r["part"].replace("decoder-warm", "decoder")), {})
            cache = r.get("cache_first_3_steps", {})
            print(
                f"\nWith the persistent cache warm ({r['part']}): first call {_f(r.get('first_call_s'))} s "
                f"(cold {_f(cold.get('first_call_s'))} s), first 2 steps {_f(r.get('first_settled_s'))} s "
                f"(cold {_f(cold.get('first_settled_s'))} s); over the first 3 steps: cache misses "
                f"{cache.get('misses', '-')}, hits {cache.get('hits', '-')}, requests {cache.get('requests', '-')}.",
                file=out,
            )
        for r in dec:
            sc = r.get("split_compile")
            if sc and "trace_lower_s" in sc:
                print(
                    f"\n{r['part']}: trace+lower {sc['trace_lower_s']:.2f} s, XLA compile {sc['xla_compile_s']:.2f} s "
                    "(after jax.clear_caches(); XLA's in-process autotuning results may be reused)",
                    file=out,
                )
    gem = [r for r in parts if part_kind(r["part"]) in ("gemm", "moe") and r.get("variants")]
    if gem:
        print("\n### Single and grouped GEMMs\n", file=out)
        print(
            "| part | variant | ms (median) | p25-p75 | TFLOP/s | x bf16 | compile s | FP8 GEMMs | GEMM FLOPs / useful |",
            file=out,
        )
        print("|---|---|---:|---:|---:|---:|---:|---|---:|", file=out)
        for r in gem:
            for v, i in r["variants"].items():
                prog = i.get("program", {})
                if "error" in i:
                    cells = ["ERROR: " + i["error"]["type"]] + ["-"] * 6
                else:
                    cells = [
                        _f(i.get("median_s"), "{:.3f}", 1e3),
                        _range(i),
                        _f(i.get("tflops"), "{:.1f}"),
                        _f(i.get("speedup_vs_bf16")),
                        _f(i.get("compile_s")),
                        _check_cell(i.get("fp8_check")),
                        _f(prog.get("gemm_flops_over_useful")),
                    ]
                print(f"| {r['part']} | {v} | " + " | ".join(cells) + " |", file=out)
        for r in gem:
            for v, i in r["variants"].items():
                if "program" in i:
                    print(f"\n{r['part']} {v}: GEMM outputs {', '.join(i['program']['gemm_out_shapes'])}", file=out)
    s = payload["summary"]
    print(
        f"\nParts: {len(s['parts_ok'])} ok, {len(s['parts_failed'])} failed, {len(s['parts_timed_out'])} timed out, "
        f"{len(s['parts_skipped'])} skipped. FP8 checks: {len(s['fp8_passed'])} PASS, {len(s['fp8_failed'])} FAIL"
        + (f" ({', '.join(s['fp8_failed'])})" if s["fp8_failed"] else "")
        + (" (n/a off a GPU)" if payload["dry"] and payload["machine"].get("backend") != "gpu" else "")
        + ". Linear TFLOP/s: the 21 projection GEMMs' FLOPs (2*M*N*K each) over the whole step's time.",
        file=out,
    )
