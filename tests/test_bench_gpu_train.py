"""bench/gpu_train.py: its dry pass runs end to end, each part in its own process.

CI runs one part of each kind and the decoder variants with code of their own (the
others differ from `decoder:fp8ax` by the `Fp8Config` only, and the GEMM shapes and passes
by their sizes): 7 of the 13 default parts, about 40 s instead of 76 on a 2-core machine.
The default list itself is checked without running it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_train.py"
DECODER_VARIANTS = ("bf16", "haliax_fp8", "fp8ax", "fp8ax_skip", "fp8ax_current", "fp8ax_mx", "fp8ax_nofirst")
PARTS = (  # the default order: the warm restart right after the part that fills its cache
    *(f"decoder:{v}" for v in DECODER_VARIANTS[:3]),
    "decoder-warm:fp8ax",
    *(f"decoder:{v}" for v in DECODER_VARIANTS[3:]),
    "gemm:square_8192:fwd_bwd",
    "gemm:llama_up:fwd_bwd",
    "gemm:square_8192:fwd",
    "gemm:llama_up:fwd",
    "moe",
)
RUN = (
    "decoder:bf16",
    "decoder:haliax_fp8",
    "decoder:fp8ax",
    "decoder-warm:fp8ax",
    "decoder:fp8ax_skip",
    "gemm:square_8192:fwd_bwd",
    "moe",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_train") / "x.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--parts", ",".join(RUN), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    payload = json.loads(out.read_text()) if out.exists() else None
    return proc, payload


def _positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def _check_stats(stats, where):
    for key in ("median_s", "p25_s", "p75_s", "min_s"):
        assert _positive(stats[key]), (where, key, stats[key])
    assert stats["min_s"] <= stats["p25_s"] <= stats["median_s"] <= stats["p75_s"], where
    assert all(_positive(t) for t in stats["all_s"]), where


@pytest.mark.slow
@pytest.mark.needs_hax_dot  # the decoder layer is Haliax's
def test_dry_pass(dry_run):
    proc, payload = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert payload is not None, proc.stdout + proc.stderr
    on_cpu = jax.default_backend() == "cpu"
    assert payload["dry"] is True
    assert payload["machine"]["device_kind"] == jax.devices()[0].device_kind
    parts = {r["part"]: r for r in payload["parts"]}
    assert tuple(parts) == RUN, list(parts)
    for name, r in parts.items():
        assert r["status"] == "ok", (name, r.get("error"), r.get("skipped"), r.get("log_tail"))
        assert "error" not in r and r["timed_out"] is False and r["returncode"] == 0, name
        assert r["dry"] is True, name

    for name, r in parts.items():
        if not name.startswith("decoder"):
            continue
        variant = name.split(":")[1]
        for key in ("first_call_s", "first_settled_s", "linear_tflops", "build_s"):
            assert _positive(r[key]), (name, key, r.get(key))
        assert r["first_settled_s"] >= r["first_call_s"], name
        _check_stats(r["step"], name)
        assert len(r["step"]["all_s"]) == 2, name
        assert math.isfinite(r["loss"]), (name, r["loss"])
        assert r["fp8_layers"] == (0 if variant == "bf16" else 7), name
        check = r["fp8_check"]
        assert "error" not in check, (name, check)
        assert check["expected"] == (0 if variant == "bf16" else 21), name
        if variant == "bf16":
            assert check["status"] == "baseline", name
        elif on_cpu:
            assert check["status"] == "n/a on cpu", name
        # Every variant but the cold fp8ax one (whose compiles are checked below) traces
        # and compiles its step once.
        if variant != "fp8ax":
            assert r["traces_first_3_steps"] == r["backend_compiles_first_3_steps"] == 1, name

    # One compiled program per training step: fp8ax's step is traced and compiled once over
    # its first three steps (not a second time once the FP8 state has been written).
    cold = parts["decoder:fp8ax"]
    assert cold["traces_first_3_steps"] <= 1, cold["traces_first_3_steps"]
    assert cold["backend_compiles_first_3_steps"] <= 1, cold["events_first_3_steps"]
    # Restarted with the persistent cache the cold part filled: every compile of the step is
    # served from it.
    warm = parts["decoder-warm:fp8ax"]
    assert warm["cache_dir"] == cold["cache_dir"] is not None
    assert warm["cache_first_3_steps"]["requests"] >= 1, warm["cache_first_3_steps"]
    assert warm["cache_first_3_steps"]["misses"] == 0, warm["cache_first_3_steps"]

    for name in RUN:
        if not name.startswith(("gemm", "moe")):
            continue
        r = parts[name]
        variants = r["variants"]
        assert set(variants) == ({"bf16", "fp8ax", "haliax_fp8"} if name.startswith("gemm") else {"bf16", "fp8ax"})
        for v, info in variants.items():
            where = f"{name} {v}"
            assert "error" not in info, (where, info["error"])
            _check_stats(info, where)
            assert _positive(info["tflops"]) and _positive(info["speedup_vs_bf16"]), where
            assert _positive(info["compile_s"]), where
            check = info["fp8_check"]
            if v == "bf16":
                assert check["status"] == "baseline", where
            elif on_cpu:
                assert check["status"] == "n/a on cpu", where
        assert variants["fp8ax"]["compiled_again_after_fill"] in (True, False)
    moe = parts["moe"]
    assert sum(moe["config"]["group_sizes"]) == moe["config"]["tokens"]
    assert len(set(moe["config"]["group_sizes"])) > 1  # uneven groups
    for info in moe["variants"].values():
        assert "gemm_out_shapes" in info["program"]

    assert payload["summary"]["parts_ok"] == list(RUN)
    assert not payload["summary"]["fp8_failed"]
    # The Markdown tables are printed.
    assert "| part | status | wall s | limit s | note |" in proc.stdout
    assert "| part | first call s | first 2 steps s |" in proc.stdout
    assert "With the persistent cache warm (decoder-warm:fp8ax)" in proc.stdout
    assert "| part | variant | ms (median) |" in proc.stdout


def test_the_default_parts():
    # The default run's parts, in order: the warm restart right after the part that fills
    # its cache; without a cache, no warm part.
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert tuple(gpu_train.parse_parts(None, {}, cache=True)) == PARTS
    assert tuple(gpu_train.parse_parts(None, {}, cache=False)) == tuple(p for p in PARTS if "warm" not in p)
    assert gpu_train.parse_parts("gemm,moe@x", {"x": "--flag"}, cache=True) == [
        *(p for p in PARTS if p.startswith("gemm")),
        "moe@x",
    ]


@pytest.mark.slow
@pytest.mark.needs_hax_dot
def test_profile_dry_pass(tmp_path):
    # bench/gpu_profile.py on tiny sizes: every variant traced and its kernels (on a CPU,
    # the trace's busiest plane) read back; and each variant's optimized HLO written.
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_profile.py"), "--dry", "--variants", "bf16,fp8ax"]
        + ["--out", str(out), "--hlo-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"bf16", "fp8ax"}
    for name, r in variants.items():
        assert "error" not in r and "hlo_error" not in r, (name, r)
        assert _positive(r["untraced_step_ms"]), name
        k = r["kernels"]
        assert k["launches_per_step"] > 0 and _positive(k["us_per_step"]) and k["top"], name
        assert (tmp_path / f"{name}.hlo.txt").read_text().count("ENTRY") == 1
