"""bench/state_cost.py: its dry pass runs end to end, its kernel counter counts what it
says, and the structural bars of the state's cost hold on XLA:CPU (leaves and kernels;
times are the benchmark's, never asserted here)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "state_cost.py"


def _load_script():
    # The script imports its sibling modules (bench/_harness.py...), as it does when run
    # as `python bench/state_cost.py`, where bench/ is first on sys.path.
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("fp8ax_bench_state_cost", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("state_cost") / "x.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--models", "mlp,depth1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.needs_hax_dot  # the models are Haliax's
def test_dry_pass_and_the_bars(dry_run):
    proc, payload = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The bare optimizer is what the benchmark measures on purpose: the warning is its own.
    assert payload["dry"] and set(payload["results"]) == {"mlp", "depth1"}
    for name, row in payload["results"].items():
        plain, haliax, fp8ax, bare, current = (
            row[v] for v in ("plain", "haliax", "fp8ax", "fp8ax-bare", "fp8ax-current")
        )
        layers = row["converted_layers"]
        # Leaves: one state array per layer on the default path (the three operands' rows),
        # none in the optimizer; Haliax's layer holds six, and its optimizer none either.
        assert fp8ax["leaves"] - plain["leaves"] == layers, name
        assert haliax["leaves"] - plain["leaves"] == 6 * layers, name
        assert bare["leaves"] - fp8ax["leaves"] == 2 * layers, name  # Adam's two moments
        assert current["leaves"] == plain["leaves"], name
        # Kernels per step: what the default recipe adds per layer is at most Haliax's,
        # and at most current scaling's plus what its history needs: its reduction and the
        # write of the layer's state, two kernels (bench/README.md, run U).
        assert fp8ax["kernels_added_per_layer"] <= haliax["kernels_added_per_layer"], (name, row)
        assert fp8ax["kernels_added_per_layer"] <= current["kernels_added_per_layer"] + 2, (name, row)
        for v in ("plain", "haliax", "fp8ax", "fp8ax-bare", "fp8ax-cal", "fp8ax-current"):
            r = row[v]
            assert r["lower_s"] > 0 and r["compile_s"] > 0, (name, v)
            assert r["first_step_s"] == pytest.approx(r["lower_s"] + r["compile_s"], rel=1e-9), (name, v)
            if name == "mlp":  # (the depth series is compiled, not timed)
                assert row[v]["step_ms"] > 0 and row[v]["host_us"] > 0 and row[v]["dispatch_us"] > 0, (name, v)
                assert row[v]["host_mean_us"] > 0 and row[v]["kept_objects"] > 0, (name, v)
        if name == "mlp":
            # What a call of the step leaves alive for Python's collector: no more than
            # Haliax's (one state and its child per layer, where Haliax's module holds its
            # six arrays; bench/README.md, runs O and U).
            assert fp8ax["kept_objects"] <= haliax["kept_objects"], row


HLO = """\
HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4] get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[4] exponential(%x)
  ROOT %t = (s32[], f32[4]) tuple(%j, %y)
}

%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  %b = f32[4] negate(%a)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]) tuple(%zero, %b)
  %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[4] get-tuple-element(%w), index=1
}
"""


def test_kernels_counts_a_loop_body_per_trip():
    # The entry's negate, and the body's add and exponential three times: 1 + 3 * 2. A
    # `while` itself launches nothing of its own here; its parameters, constants, tuples
    # and get-tuple-elements launch nothing.
    assert _load_script().kernels(HLO) == 1 + 3 * 2
