"""bench/gpu.py: its dry pass runs end to end, and its FP8 cuBLASLt counter counts right."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.py"
VARIANTS = ("bf16", "fp8ax_direct", "fp8ax_qdq", "haliax_fp8")
FP8_VARIANTS = VARIANTS[1:]
TARGET = "__cublas$lt$matmul$f8"


def _load_script():
    # The script imports its sibling modules (bench/_harness.py...), as it does when run
    # as `python bench/gpu.py`, where bench/ is first on sys.path.
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("fp8ax_bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench") / "x.json"
    proc = subprocess.run(
        # One GEMM shape (a non-square one: the code is the same for every shape), both
        # passes, every variant, and the MLP block: the whole script at a sixth of its GEMMs.
        [sys.executable, str(SCRIPT), "--dry", "--shapes", "llama3_8b_mlp_up", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    payload = json.loads(out.read_text()) if out.exists() else None
    return proc, payload


def _check_timing(info, where):
    assert "error" not in info, (where, info.get("error"))
    for key in ("median_s", "p25_s", "p75_s", "min_s"):
        assert math.isfinite(info[key]) and info[key] > 0, (where, key, info[key])
    assert all(math.isfinite(t) and t > 0 for t in info["all_s"]), where
    assert math.isfinite(info["tflops"]) and info["tflops"] > 0, where


@pytest.mark.slow
@pytest.mark.needs_hax_dot  # the MLP block is Haliax's
def test_dry_pass(dry_run):
    proc, payload = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:
        assert (
            "No GPU found (backend: cpu): running a small dry pass of the same code on CPU; "
            "no timings are meaningful" in proc.stdout
        ), proc.stdout
    assert payload is not None, proc.stdout + proc.stderr
    assert payload["dry"] is True
    assert payload["machine"]["device_kind"] == jax.devices()[0].device_kind
    assert payload["fp8_gemm_target"] == TARGET

    # Single GEMMs: every variant, forward and forward+backward, for each shape run.
    gemm = payload["gemm"]
    assert gemm
    assert {e["pass"] for e in gemm} == {"fwd", "fwd_bwd"}
    for entry in gemm:
        assert set(entry["variants"]) == set(VARIANTS), entry["variants"].keys()
        for v, info in entry["variants"].items():
            where = f"{entry['shape']} {entry['pass']} {v}"
            _check_timing(info, where)
            check = info["fp8_check"]
            assert check["target"].startswith(TARGET)
            if v in FP8_VARIANTS:
                assert check["expected"] == entry["gemms"] == {"fwd": 1, "fwd_bwd": 3}[entry["pass"]]
                if on_cpu:
                    assert check["status"] == "n/a on cpu", where
                    assert check["found"] == 0, where
            assert info["gemm_report"]["lowered_total"] == entry["gemms"], where
        # fp8ax direct mode hands XLA FP8 operands: every lowered dot is FP8.
        direct = entry["variants"]["fp8ax_direct"]["gemm_report"]
        assert direct["lowered_fp8"] == direct["lowered_total"]

    # MLP block train step.
    mlp = payload["mlp"]
    assert set(mlp["variants"]) == set(VARIANTS)
    for v, info in mlp["variants"].items():
        _check_timing(info, f"mlp {v}")
        if v in FP8_VARIANTS:
            assert info["fp8_layers"] == 2
            assert info["fp8_check"]["expected"] == mlp["gemms"] == 5
            if on_cpu:
                assert info["fp8_check"]["status"] == "n/a on cpu"

    if on_cpu:
        assert payload["fp8_check"]["status"] == "n/a on cpu"
        assert "FP8 cuBLASLt check" in proc.stdout and "n/a on cpu" in proc.stdout
    assert not payload["fp8_check"]["errors"]
    # The markdown table is printed.
    assert "| shape | M x K -> N | pass | variant |" in proc.stdout
    assert "| variant | ms (median) |" in proc.stdout


HLO = """\
HloModule jit_fn, entry_computation_layout={(f8e4m3fn[64,64]{1,0}, f8e4m3fn[64,64]{1,0})->bf16[64,64]{1,0}}

ENTRY %main.9 (p0: f8e4m3fn[64,64], p1: f8e4m3fn[64,64], p2: bf16[64,64], p3: bf16[64,64]) -> bf16[64,64] {
  %p0 = f8e4m3fn[64,64]{1,0} parameter(0)
  %p1 = f8e4m3fn[64,64]{1,0} parameter(1)
  %s = f32[] constant(1)
  %custom-call.1 = (bf16[64,64]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[64,64]{1,0} %p0, f8e4m3fn[64,64]{1,0} %p1, f32[] %s, f32[] %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"epilogue":"DEFAULT"}}
  %custom-call.2 = (bf16[64,64]{1,0}, s8[4194304]{0}) custom-call(bf16[64,64]{1,0} %p2, bf16[64,64]{1,0} %p3), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"epilogue":"DEFAULT"}}
  %dot.3 = f32[64,64]{1,0} dot(f32[64,64]{1,0} %a, f32[64,64]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %gte = bf16[64,64]{1,0} get-tuple-element((bf16[64,64]{1,0}, s8[33554432]{0}) %custom-call.1), index=0
}
"""


def test_count_fp8_cublaslt():
    gpu = _load_script()
    assert gpu.FP8_GEMM_TARGET == TARGET
    assert gpu.count_fp8_cublaslt(HLO) == 1
    counts = gpu.count_gemm_kernels(HLO)
    assert counts["cublaslt_f8"] == 1
    assert counts["cublaslt"] == 1
    assert counts["dot"] == 1
    assert counts["cublas_gemm"] == counts["triton_gemm"] == counts["other_gemm_custom_call"] == 0
    assert gpu.count_fp8_cublaslt("") == 0

    assert gpu.fp8_check("fp8ax_direct", HLO, 1, "gpu")["status"] == "PASS"
    assert gpu.fp8_check("fp8ax_direct", HLO, 3, "gpu")["status"] == "FAIL"
    assert gpu.fp8_check("haliax_fp8", HLO, 1, "cpu")["status"] == "n/a on cpu"
    assert gpu.fp8_check("bf16", HLO, 1, "gpu")["status"] == "baseline"


# A Triton GEMM fusion (the path XLA:GPU's autotuner often picks) whose casts to FP8 are
# fused into it: its operands are bf16, its dot multiplies FP8 values.
TRITON_HLO = """\
HloModule jit_fn

%gemm_computation (p0: bf16[64,64], p1: bf16[64,64], s: f32[]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  %c0 = f8e4m3fn[64,64]{1,0} convert(%p0)
  %c1 = f8e4m3fn[64,64]{1,0} convert(%p1)
  ROOT %dot = bf16[64,64]{1,0} dot(%c0, %c1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%wide_computation (p0: bf16[64,64], p1: bf16[64,64]) -> bf16[64,64] {
  %p0 = bf16[64,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot = bf16[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[64,64], b: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %b = bf16[64,64]{1,0} parameter(1)
  %s = f32[] constant(1)
  %fp8 = bf16[64,64]{1,0} fusion(%a, %b, %s), kind=kCustom, calls=%gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %wide = bf16[64,64]{1,0} fusion(%fp8, %b), kind=kCustom, calls=%wide_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""


def test_fp8_check_counts_triton_fp8_fusions():
    gpu = _load_script()
    check = gpu.fp8_check("fp8ax_direct", TRITON_HLO, 1, "gpu")
    assert (check["found"], check["status"]) == (1, "PASS")
    assert check["gemm_paths"] == ["triton:fp8->bf16", "triton:wide->bf16"]
    assert gpu.fp8_check("fp8ax_direct", TRITON_HLO, 2, "gpu")["status"] == "FAIL"
    # The cuBLASLt module: the FP8 call, the bf16 call and a bare f32 dot.
    assert gpu.fp8_check("fp8ax_direct", HLO, 1, "gpu")["gemm_paths"] == [
        "cublas:fp8->bf16",
        "cublas:wide->bf16",
        "dot:wide->f32",
    ]
