"""bench/gpu_llama.py: its dry pass runs every code path a GPU run takes (the Stacked
and unrolled stacks, fp8ax's and Haliax's steps, the GEMM table, the kernel profile) and
writes what docs/gpu.md's table reads; bad part names fail naming what is accepted.
Timings are the benchmark's, never asserted here."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_llama.py"
PARTS = ("stack:fp8ax:scan_remat", "stack:haliax_fp8:unrolled", "profile:gemm")


@pytest.mark.needs_hax_dot  # the stack is built of Haliax's linear layers
def test_dry_pass_writes_every_measurement(tmp_path):
    out = tmp_path / "gpu_llama.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--in-process", "--parts", ",".join(PARTS), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = json.loads(out.read_text())["parts"]
    assert set(parts) == set(PARTS)
    for name in PARTS[:2]:
        r = parts[name]
        assert r["config"]["layers"] == 2 and r["config"]["attention"] == "xla", name
        assert r["first_call_s"] > 0 and r["pipelined_step_s"] > 0 and r["tokens_per_s"] > 0, name
        assert 0 < r["blocked"]["p25_s"] <= r["blocked"]["median_s"] <= r["blocked"]["p75_s"], name
        assert math.isfinite(r["loss_after"]) and r["loss_after"] < r["first_loss"] * 1.5, name
        assert r["gemm_check"]["compiled_total"] > 0, name
        assert r["compiles_after_first"] is False, name  # one program, compiled once
    # The GEMM table: forward and backward of one GEMM are three GEMMs in every case.
    cases = {c["case"]: c for c in parts["profile:gemm"]["cases"]}
    assert {"bf16", "bf16_notriton", "fp8ax", "fp8ax_kernels"} <= set(cases)
    assert all(cases[c]["gemm_check"]["compiled_total"] == 3 for c in ("bf16", "bf16_notriton", "fp8ax"))
    table = out.with_suffix(".md").read_text()
    assert "stack:fp8ax:scan_remat" in table and "fp8ax 256^3" in table


def _refused(*args: str) -> str:
    """The script's stderr for `--dry` with `args`, which it must refuse."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    return proc.stderr


def test_unknown_part_names_what_is_accepted():
    err = _refused("--parts", "stack:fp8ax:sideways")
    assert "unknown part 'stack:fp8ax:sideways'" in err and "scan_remat" in err


def test_a_bad_limit_names_the_option_and_the_form():
    err = _refused("--parts", "gemm", "--limit", "gemm=soon")
    assert "--limit: expected PART=SECONDS" in err and "'gemm=soon'" in err
