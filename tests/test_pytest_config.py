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
