"""Sharded FP8 training on 8 CPU devices matches one device (the cases are in _multidevice.py).

The device count must be set before JAX starts, so the cases run once, in a subprocess
with `XLA_FLAGS=--xla_force_host_platform_device_count=8`; each test below reports one
case. The subprocess also dumps the partitioned HLO of the FP8 all-gather probes.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from recipe_registry import REGISTRY

# One worker runs every test of this module (pyproject.toml's `--dist loadgroup`): the
# module-scoped fixture below runs the subprocess once per worker that takes a test here.
pytestmark = pytest.mark.xdist_group("multidevice")

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
    *(f"recipe:{name}" for name in REGISTRY),  # every recipe of tests/recipe_registry.py
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multidevice")
    dump = tmp / "hlo"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        "--xla_force_host_platform_device_count=8 "
        f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*gather_probe.* --xla_dump_hlo_pass_re=spmd-partitioning"
    )
    env["FP8AX_HLO_DUMP"] = str(dump)
    out = tmp / "results.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_multidevice.py"), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_every_case_ran(results):
    assert sorted(results) == sorted(CASES)


# The cases that train Haliax models (hax.nn.Linear calls hax.dot); the shard_map cases use
# Fp8DotGeneral directly.
HALIAX_CASES = {"data_parallel", "fsdp", "tensor_parallel", "fsdp_tp", "global_amax", "fp8_all_gather"} | {
    c for c in CASES if c.startswith("recipe:")
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.needs_hax_dot) if c in HALIAX_CASES else c for c in CASES]
)
def test_case(results, case):
    assert results[case]["status"] == "ok", results[case]["info"]


def test_pmean_gradients_rejects_a_bad_axis_name():
    # Checked before any collective, so it needs no mesh.
    import fp8ax

    for bad in (3, [], ["data", 1]):
        with pytest.raises(TypeError, match="`axis_name` must be a mesh axis name or a non-empty sequence"):
            fp8ax.pmean_gradients({}, bad)
