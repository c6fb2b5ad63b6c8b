"""bench/gpu_llama.py's results: the parts' JSON lines gathered, and the Markdown table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def gather(path: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return results
    for line in path.read_text().splitlines():
        row = json.loads(line)
        part = row.pop("part")
        entry = results.setdefault(part, {})
        if "case" in row:
            entry.setdefault("cases", []).append(row)
        else:
            entry.update(row)
    return results


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| part | first call s | compile s | tokens/s | MFU | x bf16 | step ms (p25-p75) | loss | FP8 GEMMs |"]
    rows.append("|---|---:|---:|---:|---:|---:|---|---:|---|")
    for part, r in results.items():
        if not part.startswith("stack:"):
            continue
        base = results.get(f"stack:bf16:{part.split(':')[2]}", {}).get("tokens_per_s")
        tps = r.get("tokens_per_s")
        b = r.get("blocked", {})
        check = r.get("gemm_check", {})
        rows.append(
            f"| {part} | {r.get('first_call_s', float('nan')):.1f} | "
            f"{r.get('first_call_parts_s', {}).get('compile', float('nan')):.1f} | "
            f"{tps or float('nan'):.0f} | {r.get('mfu_bf16_peak', float('nan')):.3f} | "
            f"{(tps / base) if tps and base else float('nan'):.2f} | "
            f"{1e3 * b.get('median_s', float('nan')):.1f} ({1e3 * b.get('p25_s', float('nan')):.1f}-"
            f"{1e3 * b.get('p75_s', float('nan')):.1f}) | {r.get('loss_after', float('nan')):.4f} | "
            f"{check.get('compiled_fp8', '-')}/{check.get('compiled_total', '-')} |"
            + (f" {r['status']}" if r.get("status") else "")
        )
    rows += ["", "| GEMM fwd+bwd | first call s | ms | TFLOP/s | x bf16 | FP8 GEMMs |", "|---|---:|---:|---:|---:|---|"]
    cases = [
        c
        for p in ("gemm", "profile:gemm", "gemm_triton")
        for c in results.get(p, {}).get("cases", [])
        if "fwd_bwd_s" in c
    ]
    base = next((c["fwd_bwd_s"] for c in cases if c["case"] == "bf16"), None)
    for c in cases:
        check = c["gemm_check"]
        rows.append(
            f"| {c['case']} {c['n']}^3 | {c['first_call_s']:.1f} | {1e3 * c['fwd_bwd_s']:.2f} | {c['tflops']:.0f} | "
            f"{(base / c['fwd_bwd_s']) if base else float('nan'):.2f} | {check['compiled_fp8']}/{check['compiled_total']} |"
        )
    profiles = {p: r for p, r in results.items() if p.startswith("profile:") and p != "profile:gemm"}
    profiles |= {
        f"gemm {c['case']}": {"profile": c["kernels"]}
        for c in results.get("profile:gemm", {}).get("cases", [])
        if "kernels" in c
    }
    if profiles:
        rows += ["", "| profile (command buffers on) | step ms | GPU busy ms | launches | GEMM ms | status |"]
        rows.append("|---|---:|---:|---:|---:|---|")
        for p, r in profiles.items():
            f = r.get("profile", {})
            rows.append(
                f"| {p} | {f.get('traced_step_ms', float('nan')):.2f} | {f.get('busy_us_per_step', float('nan')) / 1e3:.2f} | "
                f"{f.get('launches_per_step', float('nan')):.0f} | {f.get('gemm_us_per_step', float('nan')) / 1e3:.2f} | "
                f"{r.get('status', '')[:80]} |"
            )
    for p in ("gemm", "gemm_triton"):
        if results.get(p, {}).get("status"):
            rows.append(f"| {p} | {results[p]['status']} | | | | |")
    return "\n".join(rows)
