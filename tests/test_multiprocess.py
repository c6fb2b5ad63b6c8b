"""Multi-controller FP8 training: 2 processes x 4 CPU devices against 1 process x 8, and
Orbax checkpoints of it (the worker is tests/_multiprocess.py).

The two processes talk over loopback (`jax.distributed.initialize` with a coordinator on
127.0.0.1, gloo collectives). Every child runs under a time limit and in a process group
of its own, which is killed whatever happens, so nothing outlives the test.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import hax_dot_failure, xla_flags

HERE = pathlib.Path(__file__).resolve().parent
TIMEOUT = 240  # seconds for each run (the whole test takes about 90 s on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["XLA_FLAGS"] = xla_flags()  # the suite's own; each process adds its device count
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(argv_per_process: list[list[str]], out: pathlib.Path, tag: str) -> list[str]:
    """Runs one child per argument list at once; returns their outputs. Raises if one
    fails or runs past TIMEOUT; kills all of them in any case."""
    procs, logs = [], []
    try:
        for i, argv in enumerate(argv_per_process):
            log = open(out / f"{tag}{i}.log", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "_multiprocess.py"), *argv],
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, killed below
                )
            )
        deadline = time.monotonic() + TIMEOUT
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: still running after {TIMEOUT} s")
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one failed: the other would wait for it until its own timeout
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError("\n\n".join(f"{tag} process {i} failed:\n{texts[i][-4000:]}" for i in failed))
    return texts


def _run_with_port(argvs, out, tag, attempts=3):
    # A port found free can be taken before the coordinator binds it: try another.
    for attempt in range(attempts):
        port = str(_free_port())
        try:
            return _run([[*a, "--port", port] for a in argvs], out, tag)
        except RuntimeError as e:
            taken = ("failed to add port", "address already in use")  # gRPC's words for a port in use
            if attempt + 1 == attempts or not any(t in str(e).lower() for t in taken):
                raise


def _bitwise_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_two_processes_match_one_and_orbax_resumes(tmp_path):
    why = hax_dot_failure()
    if why is not None and os.environ.get("FP8AX_REQUIRE_HAX_DOT") == "1":
        pytest.fail(f"FP8AX_REQUIRE_HAX_DOT=1, but named-axis hax.dot fails: {why}")
    models = ["equinox"] + (["haliax"] if why is None else [])  # Haliax needs a working hax.dot
    common = ["--out", str(tmp_path), "--models", ",".join(models)]

    t0 = time.perf_counter()
    _run_with_port(
        [["train", "--process-id", str(i), "--num-processes", "2", "--devices", "4", *common] for i in range(2)],
        tmp_path,
        "train",
    )
    t1 = time.perf_counter()
    _run_with_port([["single", *common]], tmp_path, "single")
    t2 = time.perf_counter()
    print(f"2 processes: {t1 - t0:.1f} s, 1 process and the resume: {t2 - t1:.1f} s")

    assert _children_of(tmp_path) == [], "a worker outlived its run"
    runs = {}
    for name in ("process0", "process1", "single"):  # read whole, so a failed assertion leaves no file open
        with np.load(tmp_path / f"{name}.npz") as f:
            runs[name] = {k: f[k] for k in f.files}
    single = runs["single"]
    for model in models:
        keys = [k for k in single if k.startswith(f"{model}/")]
        assert any("dot_general.state" in k for k in keys) and any("opt_state" in k for k in keys), keys
        for name in ("process0", "process1"):
            assert sorted(k for k in runs[name] if k.startswith(f"{model}/")) == sorted(keys)
            # Every leaf, bit for bit: parameters, FP8 state, optimizer state, losses.
            differ = [k for k in keys if not _bitwise_equal(runs[name][k], single[k])]
            assert not differ, f"{model}: {name} differs from one process with 8 devices in {differ}"
        # Training moved the parameters and filled the state.
        assert not np.array_equal(single[f"{model}/losses"][0], single[f"{model}/losses"][-1])

    info = [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(2)]
    report = json.loads((tmp_path / "single.json").read_text())["resume"]
    for model in models:
        # Global amax: process 0 holds no row with the largest input (50), yet every one
        # of its shards of the state records 50 at every step, as process 1's do.
        assert info[0][model]["local_input_max"] < 50.0 == info[1][model]["local_input_max"]
        for i in range(2):
            recorded = info[i][model]["recorded_input_amax"]
            assert len(recorded) == 4 and all(r == [50.0] * 4 for r in recorded), (i, recorded)

        r = report[model]
        assert r["restored_shardings_on_mesh_b"]
        assert r["checkpoint_differs_from_uninterrupted_at_save"] == []
        assert r["losses"] == r["losses_uninterrupted"]
        assert r["resumed_differs_from_uninterrupted"] == []
        assert r["n_leaves"] > 20
        # The wrong kind of template: fp8ax's error, which names the layer and both kinds.
        layer = "model.layers.0" if model == "equinox" else "model.blocks.stacked.mlp.up_proj"
        msg = r["training_into_serving"]
        assert msg.startswith(f"ValueError: The checkpoint does not fit `like` at layer `{layer}`"), msg
        assert "`like` has a serving layer" in msg and "holds an FP8 training layer" in msg, msg
        assert (
            "Structure mismatch" in r["training_into_serving_orbax"]
            or "do not match" in r["training_into_serving_orbax"]
        ), r["training_into_serving_orbax"]
        msg = r["serving_into_training"]
        assert msg.startswith(f"ValueError: The checkpoint does not fit `like` at layer `{layer[len('model.') :]}`")
        assert "`like` has an FP8 training layer" in msg and "holds a serving layer" in msg, msg
        assert "fp8ax.serving_template" in msg, msg
        assert r["serving_roundtrip_differs"] == []


def test_a_taken_port_fails_fast_and_leaves_nothing_running(tmp_path):
    # The coordinator cannot bind a port that is in use: the process that hosts it fails,
    # the other is killed at once instead of waiting for the coordinator, and the error
    # is the one `_run_with_port` retries on.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        argv = ["train", "--num-processes", "2", "--devices", "4", "--out", str(tmp_path), "--models", "equinox"]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)failed to add port"):
            _run([[*argv, "--process-id", str(i), "--port", port] for i in range(2)], tmp_path, "taken")
    assert time.monotonic() - t0 < 60
    assert _children_of(tmp_path) == [], "a worker outlived the test"


def _children_of(out: pathlib.Path) -> list[int]:
    """The ids of running processes whose command line names `out` (Linux's /proc)."""
    pids = []
    for d in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            if str(out).encode() in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass  # gone meanwhile, or not ours to read
    return pids
