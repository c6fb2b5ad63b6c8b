"""bench/gpu.py's FP8 check: the GEMMs of optimized HLO counted by kind, each compiled
function's FP8 GEMMs against those it should have, and the run's verdict."""

from __future__ import annotations

import re
from typing import Any

import gpu_hlo

# XLA:GPU's custom-call targets for cuBLAS(Lt) GEMMs (xla/service/gpu/cublas_cudnn.cc).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
CUBLASLT_TARGET = "__cublas$lt$matmul"
CUBLAS_GEMM_TARGET = "__cublas$gemm"


# --------------------------------------------------------------------------------------
# Counting GEMM kernels in optimized HLO

_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_DOT_RE = re.compile(r"\sdot\(")


def count_gemm_kernels(hlo_text: str) -> dict[str, int]:
    """Counts the GEMMs of an optimized HLO module (``Compiled.as_text()``) by kind.

    One instruction per line. Keys:

    - ``cublaslt_f8``: ``custom-call``s with ``custom_call_target="__cublas$lt$matmul$f8"``
      (FP8 cuBLASLt GEMMs, what an FP8 variant should compile to on a GPU);
    - ``cublaslt``: ``custom_call_target="__cublas$lt$matmul"`` (bf16/f32 cuBLASLt);
    - ``cublas_gemm``: ``custom_call_target="__cublas$gemm"`` (bf16/f32 cuBLAS);
    - ``other_gemm_custom_call``: any other custom call whose target names a GEMM/matmul;
    - ``triton_gemm``: fusions XLA emits as Triton GEMMs (``"kind":"__triton_gemm"``);
    - ``cudnn_fusion``: fusions run by cuDNN (``"kind":"__cudnn$fusion"``, usually GEMMs);
    - ``dot``: plain ``dot(`` instructions (what a CPU runs; on a GPU, dots inside Triton
      or cuDNN fusions).
    """
    counts = dict(
        cublaslt_f8=0, cublaslt=0, cublas_gemm=0, other_gemm_custom_call=0, triton_gemm=0, cudnn_fusion=0, dot=0
    )
    for line in hlo_text.splitlines():
        if "custom-call(" in line:
            m = _TARGET_RE.search(line)
            target = m.group(1) if m else ""
            if target == FP8_GEMM_TARGET:
                counts["cublaslt_f8"] += 1
            elif target == CUBLASLT_TARGET:
                counts["cublaslt"] += 1
            elif target == CUBLAS_GEMM_TARGET:
                counts["cublas_gemm"] += 1
            elif re.search(r"gemm|matmul", target, re.IGNORECASE):
                counts["other_gemm_custom_call"] += 1
        elif '"kind":"__triton_gemm"' in line:
            counts["triton_gemm"] += 1
        elif '"kind":"__cudnn$fusion"' in line:
            counts["cudnn_fusion"] += 1
        elif _DOT_RE.search(line):
            counts["dot"] += 1
    return counts


def count_fp8_cublaslt(hlo_text: str) -> int:
    """Number of FP8 cuBLASLt GEMM custom calls (``__cublas$lt$matmul$f8``) in optimized HLO."""
    return count_gemm_kernels(hlo_text)["cublaslt_f8"]


def fp8_check(variant: str, hlo_text: str, expected: int, backend: str) -> dict[str, Any]:
    """The FP8 check of one compiled function: found vs expected FP8 GEMMs, where an FP8
    GEMM is an FP8 cuBLASLt call or a Triton/cuDNN GEMM fusion whose dot multiplies FP8
    values (bench/gpu_hlo.py); `gemm_paths` says which path each GEMM took and what it
    writes (e.g. ``"triton:fp8->bf16"``, ``"cublas:wide->bf16"``)."""
    kernels = count_gemm_kernels(hlo_text)
    program = gpu_hlo.summary(hlo_text)
    found = program["fp8_gemms"]
    if variant == "bf16":
        status = "baseline"  # nothing to check; the counts show which bf16 GEMMs ran
        expected = 0
    elif backend != "gpu":
        status = f"n/a on {backend}"
    else:
        status = "PASS" if found == expected else "FAIL"
    return {
        "target": f"{FP8_GEMM_TARGET} or a GEMM fusion on FP8 operands",
        "expected": expected,
        "found": found,
        "status": status,
        "gemm_kernels": kernels,
        "gemm_paths": program["gemm_paths"],
    }


def report_dict(report) -> dict[str, Any]:
    return {
        "lowered_fp8": report.lowered_fp8,
        "lowered_total": report.lowered_total,
        "compiled_fp8": report.compiled_fp8,
        "compiled_total": report.compiled_total,
        "all_fp8": report.all_fp8,
    }


def _all_infos(payload):
    for e in payload["gemm"]:
        for v, info in e["variants"].items():
            yield f"{e['shape']} {e['pass']} {v}", info
    if payload["mlp"]:
        for v, info in payload["mlp"]["variants"].items():
            yield f"mlp {v}", info


def summarise(payload: dict[str, Any]) -> dict[str, Any]:
    backend = payload["machine"]["backend"]
    errors = [name for name, info in _all_infos(payload) if "error" in info]
    failed = [name for name, info in _all_infos(payload) if info.get("fp8_check", {}).get("status") == "FAIL"]
    passed = [name for name, info in _all_infos(payload) if info.get("fp8_check", {}).get("status") == "PASS"]
    if backend != "gpu":
        status = f"n/a on {backend}"
    else:
        status = "FAIL" if failed else "PASS"
    return {"status": status, "target": FP8_GEMM_TARGET, "passed": len(passed), "failed": failed, "errors": errors}
