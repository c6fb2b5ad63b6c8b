"""The reuse matrix: a layer used several times in one step records one merged observation,
behind every boundary users put around a layer (the cases are defined in `_reuse.py`).

Each case: an entry point (`Fp8DotGeneral`, converted `eqx.nn.Linear`/`eqx.nn.MLP`/
`hax.nn.Linear`, `hax.dot(..., dot_general=)`, `Stacked`, `BlockSeq`), a boundary around
each use (jit, checkpoint with and without a policy, scan, scan of a checkpointed body,
vmap, cond/switch, shard_map, two nested), a use pattern (twice, chained, tied with
`eqx.nn.Shared`, a `fori_loop`, the layer as a loop carry, `fp8ax.microbatched`,
`fp8ax.accumulate_gradients`), fresh or trained. It checks, bit for bit, that the new state
is the max of what each use records alone (for one-layer entry points, also one use on the
concatenated inputs), that an unused layer keeps its state, and that with a NaN in an
input the state stays finite and equals the same merge. Combinations fp8ax cannot make
right must raise fp8ax's error naming the boundary.

The `jax.shard_map` cases need 8 devices, set before JAX starts: they run in subprocesses
(`python tests/_reuse.py OUT.json CHUNK CHUNKS` with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`), one test per chunk, each listing
every case that failed with its traceback.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from _reuse import ENTRIES, case_id, cases, run_all
from conftest import hax_dot_failure, xla_flags

HERE = pathlib.Path(__file__).resolve().parent

# A sweep of fresh models through one compiled reference program is what the stale-state
# warning tells apart from real misuse only after 100 calls; these tests are that sweep.
pytestmark = pytest.mark.filterwarnings("ignore:fp8ax. the same FP8 layer has found its amax history empty")


def _marks(case):
    return [pytest.mark.needs_hax_dot] if ENTRIES[case[0]].haliax else []


@pytest.mark.parametrize("case", [pytest.param(c, id=case_id(c), marks=_marks(c)) for c in cases(multidevice=False)])
def test_reuse(case):
    run_all(*case)


CHUNKS = 4


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_reuse_on_8_devices(chunk, tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"))
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "_reuse.py"), str(out), str(chunk), str(CHUNKS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(out.read_text())
    assert results, "no case ran"
    skip_haliax = hax_dot_failure() is not None and os.environ.get("FP8AX_REQUIRE_HAX_DOT") != "1"
    failed = {k: v for k, v in results.items() if v != "ok" and not (skip_haliax and v.startswith("skipped"))}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
