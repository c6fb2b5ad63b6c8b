"""Examples run, and the docs cover every public name."""

import pathlib
import re
import subprocess
import sys

import pytest

import fp8ax

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {"demo.py", "haliax_mlp.py", "equinox_mlp.py", "named_axis_dot.py"}


def _run_example(path, *args):
    proc = subprocess.run(
        [sys.executable, str(path), "--steps", "3", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path):
    _run_example(path)


def test_microbatched_example_runs():
    out = _run_example(ROOT / "examples" / "haliax_mlp.py", "--microbatches", "4")
    assert "step    3  loss" in out


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    public = sorted(n for n in dir(fp8ax) if not n.startswith("_"))
    documented = set(re.findall(r"^:::\s*fp8ax\.(\w+)", api, flags=re.MULTILINE))
    missing = [n for n in public if n not in documented]
    assert not missing, f"public names missing from docs/api.md: {missing}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    head = readme[:3000]
    assert ".venv/bin/python examples/demo.py" in head
    assert '.venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest -q' in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert '.venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest -q' in ci


def test_docs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
