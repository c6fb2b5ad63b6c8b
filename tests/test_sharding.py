"""Sharded FP8 training on 8 CPU devices matches one device (the cases are in _multidevice.py).

The device count must be set before JAX starts, so the cases run in subprocesses with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, one per group of cases; each test
below runs a group and reports every case that failed. The subprocess also dumps the
partitioned HLO of the FP8 all-gather probes.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import xla_flags
from recipe_registry import REGISTRY

HERE = pathlib.Path(__file__).resolve().parent
CASES = [
    "data_parallel",
    "fsdp",
    "tensor_parallel",
    "fsdp_tp",
    "global_amax",
    "fp8_all_gather",
    "shard_map_check_vma",
    "shard_map_check_vma_trained",
    "shard_map_no_check_vma",
    "shard_map_pmean_or_psum_of_state_is_wrong",
    "eager_shard_map_no_check_vma_refuses",
    "explicit_sharding",
    *(f"recipe:{name}" for name in REGISTRY),  # every recipe of tests/recipe_registry.py
]

# The cases that train Haliax models (hax.nn.Linear calls hax.dot); the shard_map cases use
# Fp8DotGeneral directly.
HALIAX_CASES = {"data_parallel", "fsdp", "tensor_parallel", "fsdp_tp", "global_amax", "fp8_all_gather"} | {
    c for c in CASES if c.startswith("recipe:")
}

# Each test runs one group of cases in a subprocess of its own (a JAX start, a few
# seconds), so that pytest-xdist shares the groups out between workers; a fixture shared by
# several tests would run once per worker that takes one of them.
# The recipes' cases (each compiles a one-device and an 8-device step) come in two halves,
# so that two workers can share them (as one group they were the suite's longest test).
_RECIPE_CASES = [c for c in CASES if c.startswith("recipe:")]
GROUPS = {
    "layouts": [c for c in CASES if c in HALIAX_CASES and not c.startswith("recipe:")],
    "recipes": _RECIPE_CASES[::2],
    "recipes_2": _RECIPE_CASES[1::2],
    "shard_map": [c for c in CASES if c not in HALIAX_CASES],
}


def _run(cases, tmp) -> dict:
    dump = tmp / "hlo"
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(
        "--xla_force_host_platform_device_count=8",
        f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*gather_probe.* --xla_dump_hlo_pass_re=spmd-partitioning",
    )
    env["FP8AX_HLO_DUMP"] = str(dump)
    out = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_multidevice.py"), str(out), *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_every_case_is_in_a_group():
    assert sorted(c for cases in GROUPS.values() for c in cases) == sorted(CASES)


@pytest.mark.parametrize(
    "group", [pytest.param(g, marks=pytest.mark.needs_hax_dot) if g != "shard_map" else g for g in GROUPS]
)
def test_cases(group, tmp_path):
    results = _run(GROUPS[group], tmp_path)
    assert sorted(results) == sorted(GROUPS[group])
    failed = {case: r["info"] for case, r in results.items() if r["status"] != "ok"}
    assert not failed, "\n\n".join(f"case {case} failed:\n{info}" for case, info in failed.items())


def test_pmean_gradients_rejects_a_bad_axis_name():
    # Checked before any collective, so it needs no mesh.
    import fp8ax

    for bad in (3, [], ["data", 1]):
        with pytest.raises(TypeError, match="`axis_name` must be a mesh axis name or a non-empty sequence"):
            fp8ax.pmean_gradients({}, bad)
