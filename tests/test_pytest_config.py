"""The suite's pytest settings (pyproject.toml) start up with the plugins GPU images bring."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    importlib.util.find_spec("pytest_benchmark") is None,
    reason="pytest-benchmark is not installed (GPU images have it; it is not a test dependency)",
)
def test_collects_with_pytest_benchmark():
    # pytest-benchmark before 5.3 warns at start-up that xdist (`-n auto` in addopts)
    # disables its benchmarks; `filterwarnings = ["error", ...]` made that an INTERNALERROR
    # before any test ran. pyproject.toml ignores that one warning. A fresh pytest, with
    # the plugin forced on and none of this run's PYTEST_* variables (an xdist worker's
    # among them).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "benchmark", "tests/test_formats.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "INTERNALERROR" not in out, out[-4000:]
    assert " collected" in proc.stdout, out[-4000:]


def test_the_suite_compiles_at_llvm_o0_on_a_cpu_only_install():
    # tests/conftest.py: XLA:CPU's back end at -O0 where no GPU or TPU plugin is installed
    # (unless FP8AX_TEST_XLA_OPT=1), set before JAX made a backend, and handed to the
    # suite's subprocesses by `xla_flags`.
    from conftest import SUITE_XLA_FLAGS, cpu_only_install, xla_flags

    wanted = cpu_only_install() and os.environ.get("FP8AX_TEST_XLA_OPT") != "1"
    assert SUITE_XLA_FLAGS == ("--xla_backend_optimization_level=0" if wanted else "")
    extra = "--xla_force_host_platform_device_count=8"
    assert xla_flags(extra).split() == [*SUITE_XLA_FLAGS.split(), extra]
    if wanted:
        assert SUITE_XLA_FLAGS in os.environ["XLA_FLAGS"].split()
    # With a plugin for another platform installed (CI's run 3 has JAX's CUDA plugin), the
    # tests compile as a user's program does.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "FP8AX_TEST_XLA_OPT")}
    code = "import conftest; print(repr(conftest.SUITE_XLA_FLAGS))"
    for opt_out, expected in (("0", "--xla_backend_optimization_level=0"), ("1", "")):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT / "tests",
            env={**env, "FP8AX_TEST_XLA_OPT": opt_out},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() == repr(expected if cpu_only_install() else ""), proc.stdout
