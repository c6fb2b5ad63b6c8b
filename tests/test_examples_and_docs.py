"""Examples run, the docs' runnable code blocks run, and the docs cover every public name.

Runnable doc blocks. A fenced ```python block in docs/*.md or README.md that comes right
after a line holding only the HTML comment `<!-- runnable -->` is executed by
`test_runnable_doc_blocks`:

    <!-- runnable -->
    ```python
    import fp8ax
    ```

The comment renders as nothing in mkdocs-material and on GitHub. All runnable blocks of a
page run in order, concatenated into one script in one fresh Python process (no strict
dtype promotion: the docs run as users run them), so a later block can use the names an
earlier one defined. Blocks may be indented (inside a list item or an admonition) as long
as the comment has the same indentation as the fence. Leave fragments unmarked, and do not
mark `--8<--` includes: those files are examples, which run on their own.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest

import fp8ax

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_there_are_examples():
    assert {p.name for p in EXAMPLES} >= {
        "demo.py",
        "haliax_mlp.py",
        "equinox_mlp.py",
        "named_axis_dot.py",
        "haliax_transformer_lm.py",
        "moe_transformer_lm.py",
    }


# The examples and the docs' blocks follow the documented path: an optimizer that never
# sees the FP8 state (`fp8ax.skip_fp8_state`), given gradients the new state was split off
# from. `fp8ax.apply_updates` warns when the optimizer sees the state, `skip_fp8_state`
# when the new state was left in the gradients; here both are errors. (A `-W` option or PYTHONWARNINGS cannot name fp8ax's warning:
# Python reads them before the site packages, fp8ax among them, can be imported.)
DOCUMENTED_PATH = (
    "import warnings, fp8ax; warnings.simplefilter('error', fp8ax.OptimizerStateWarning); "
    "warnings.simplefilter('error', fp8ax.StateNotWrittenWarning)"
)
# `python path args` after that: the script's folder first on sys.path, as Python puts it.
AS_A_SCRIPT = (
    "import os, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0]))); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _run_example(path, *args, cwd):
    # Run in a scratch directory, so an example that writes files (a plot) leaves the checkout clean.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{DOCUMENTED_PATH}; {AS_A_SCRIPT}",
            str(path),
            "--steps",
            "3",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


# Examples run by a test of their own, which also checks their output.
# (sharded_training.py: its two-process mode, which also runs its one-process comparison;
# moe_transformer_lm.py: at a tiny size.)
OWN_TEST = {"haliax_transformer_lm.py", "serving.py", "sharded_training.py", "moe_transformer_lm.py"}


def _uses_haliax(code: str) -> bool:
    """Code that uses Haliax is taken to need a working `hax.dot` (every `hax.nn.Linear` calls it)."""
    return re.search(r"^\s*(import\b.*\bhaliax\b|from haliax\b)", code, re.MULTILINE) is not None


def _hax_dot_param(value, code: str):
    return pytest.param(value, marks=pytest.mark.needs_hax_dot) if _uses_haliax(code) else value


@pytest.mark.parametrize(
    "path", [_hax_dot_param(p, p.read_text()) for p in EXAMPLES if p.name not in OWN_TEST], ids=lambda p: p.name
)
def test_example_runs(path, tmp_path):
    _run_example(path, cwd=tmp_path)


@pytest.mark.needs_hax_dot
def test_sharded_training_example_on_two_processes(tmp_path):
    # Two JAX processes of 4 CPU devices each, started by the example itself (loopback).
    out = _run_example(ROOT / "examples" / "sharded_training.py", "--processes", "2", cwd=tmp_path)
    assert "8 devices on 2 processes" in out, out
    first = re.search(r"^\s+1\s+(\S+)\s+(\S+)$", out, re.MULTILINE)
    assert first and abs(float(first[1]) - float(first[2])) < 1e-4, out  # step 1: float32 rounding
    # (Haliax 1.4.dev453 leaves the stacked state's spec at P(None,), marin-haliax pads it.)
    assert re.search(r"FP8 state sharding: P\((None, )*None,?\) \(replicated\)", out), out


@pytest.mark.needs_hax_dot
def test_moe_example_trains_both_runs(tmp_path):
    tiny = ["--layers", "1", "--seq", "16", "--batch", "4", "--embed", "32"]
    out = _run_example(ROOT / "examples" / "moe_transformer_lm.py", *tiny, cwd=tmp_path)
    assert "hax.nn.MoELinear x1" in out and "held-out loss: bf16" in out, out
    scales = re.search(r"per-expert weight scales: (.*)$", out, re.MULTILINE)
    assert scales and len(scales[1].split(", ")) == 4, out  # one scale per expert


@pytest.mark.needs_hax_dot
def test_microbatched_example_runs(tmp_path):
    out = _run_example(ROOT / "examples" / "haliax_mlp.py", "--microbatches", "4", cwd=tmp_path)
    assert "step    3  loss" in out


@pytest.mark.needs_hax_dot
def test_lm_example_prints_the_loss_table_and_saves_the_plot(tmp_path):
    plot = tmp_path / "curves" / "loss.png"
    amax_plot = tmp_path / "curves" / "amax.png"
    tiny = ["--layers", "1", "--seq", "16", "--batch", "4", "--embed", "32"]
    out = _run_example(
        ROOT / "examples" / "haliax_transformer_lm.py",
        *tiny,
        "--plot",
        str(plot),
        "--amax-plot",
        str(amax_plot),
        cwd=tmp_path,
    )
    lines = out.splitlines()
    # The conversion report: the four block projections to FP8, the head left out.
    assert "4 of 5 linear layers converted to FP8" in out, out
    assert re.search(r"^  head +hax\.nn\.Linear +32 +61 +skipped +not selected by `targets`$", out, re.M), out
    # The scaling statistics: a row per FP8 layer and tensor, percentages for lhs and rhs.
    for layer in ("qkv_proj", "o_proj", "up_proj", "down_proj"):
        row = re.search(
            rf"^  blocks\.stacked\.{layer}\[0\] +lhs +(\S+) +(\S+) +(\S+) +([\d.]+)% +([\d.]+)%$", out, re.M
        )
        assert row, (layer, out)
        scale, amax, hist_max = (float(v) for v in row.groups()[:3])
        assert 0 < scale and 0 < amax <= hist_max, row.group(0)
    # gemm_report: every GEMM of the converted layers is FP8 in the lowered program, the
    # attention matmuls are listed with their source.
    assert "every GEMM of the converted layers FP8 in the lowered program: True" in out, out
    assert "haliax/nn/attention.py:" in out, out
    assert amax_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = next(i for i, line in enumerate(lines) if line.split() == ["step", "bf16", "loss", "fp8", "loss"])
    rows = [line.split() for line in lines[header + 1 : header + 4]]
    assert [int(r[0]) for r in rows] == [1, 2, 3], out
    for r in rows:
        bf16, fp8 = float(r[1]), float(r[2])
        assert 0 < bf16 < 10 and 0 < fp8 < 10, out  # cross-entropy over 61 characters starts near ln 61 = 4.1
    assert re.search(r"held-out loss: +bf16 [\d.]+, fp8 [\d.]+", out), out
    assert plot.exists(), f"no plot written (matplotlib is in the `test` extra):\n{out}"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.needs_hax_dot
def test_serving_example_serves_what_it_trained(tmp_path):
    tiny = ["--layers", "1", "--seq", "16", "--batch", "4", "--embed", "32", "--generate", "10"]
    out = _run_example(ROOT / "examples" / "serving.py", *tiny, cwd=tmp_path)
    held = dict(
        re.findall(r"^  (bf16|fp8 trained|fp8 served|PTQ fp8 \(from bf16\)) +(\d+\.\d{4})  \(", out, re.MULTILINE)
    )
    assert set(held) == {"bf16", "fp8 trained", "fp8 served", "PTQ fp8 (from bf16)"}, out
    assert held["fp8 served"] == held["fp8 trained"], out
    assert all(0 < float(v) < 10 for v in held.values()), out
    sizes = dict(re.findall(r"^  (bf16|fp8 training|fp8 serving) +([\d,]+)", out, re.MULTILINE))
    assert int(sizes["fp8 serving"].replace(",", "")) < int(sizes["bf16"].replace(",", "")), out
    assert "loads back into fp8ax.serving_template(...): same logits" in out
    generated = out.split("generated by the served model:\n\n", 1)[1]
    assert generated.startswith("ROMEO:\n") and len(generated) >= len("ROMEO:\n") + 10, out


def test_lm_example_skips_the_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("lm_example", ROOT / "examples" / "haliax_transformer_lm.py")
    lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lm)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    lm.save_plot(tmp_path / "loss.png", [1, 2], {"bf16": [4.0, 3.0], "fp8": [4.0, 3.1]}, {"bf16": 3.0, "fp8": 3.1})
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "loss.png").exists()


def test_lm_example_data_is_plain_text():
    data = ROOT / "examples" / "data"
    text = (data / "tinyshakespeare.txt").read_bytes()
    assert 100_000 < len(text) <= 250_000
    assert text.isascii() and b"\r" not in text and b"\t" not in text
    assert text.startswith(b"First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert text.endswith(b"\n") and not text.endswith(b"\n\n")
    assert "public domain" in (data / "README.md").read_text()


# --- runnable doc blocks (the convention is in this file's docstring) ---

MARKER = "<!-- runnable -->"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Pages that must keep runnable blocks: a guard against markers being dropped by accident.
PAGES_WITH_RUNNABLE_BLOCKS = {"index.md", "state.md", "recipes.md", "migrating.md", "serving.md", "choosing-layers.md"}


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """The `(line number, code)` of each block marked runnable in a Markdown page.

    Raises `ValueError` for a marker that is not directly followed by a ```python fence, or
    a fence that is never closed.
    """
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if i + 1 >= len(lines) or lines[i + 1] != indent + "```python":
            raise ValueError(f"line {i + 1}: {MARKER} must be directly followed by {indent!r} + '```python'")
        try:
            end = lines.index(indent + "```", i + 2)
        except ValueError:
            raise ValueError(f"line {i + 2}: the runnable block is never closed") from None
        body = "\n".join(lines[i + 2 : end])
        blocks.append((i + 3, textwrap.dedent(body)))  # 1-based line of the block's first code line
    return blocks


def _marker_count(text: str) -> int:
    return sum(line.strip() == MARKER for line in text.splitlines())


def _marked_pages():
    return [p for p in DOC_PAGES if _marker_count(p.read_text())]


def _page_id(page):
    return str(page.relative_to(ROOT))


def test_runnable_block_extraction():
    page = f"intro\n\n{MARKER}\n```python\nx = 1\n```\n\n```python\nfragment\n```\n\n- item\n\n  {MARKER}\n  ```python\n  y = x + 1\n  ```\n"
    assert runnable_blocks(page) == [(5, "x = 1"), (16, "y = x + 1")]
    with pytest.raises(ValueError, match="directly followed"):
        runnable_blocks(f"{MARKER}\n\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks(f"{MARKER}\n```python\nx = 1\n")


@pytest.mark.parametrize("page", DOC_PAGES, ids=_page_id)
def test_every_marker_yields_a_runnable_block(page):
    text = page.read_text()
    near_misses = [
        n
        for n, line in enumerate(text.splitlines(), 1)
        if line.strip() != MARKER and re.search(r"<!--\s*runnable\s*-->", re.sub(r"`[^`]*`", "", line), re.I)
    ]
    assert not near_misses, f"{_page_id(page)}: lines {near_misses} look like {MARKER} but are not exactly it"
    n_markers = _marker_count(text)
    blocks = runnable_blocks(text)
    assert len(blocks) == n_markers, f"{_page_id(page)}: {n_markers} markers but {len(blocks)} blocks extracted"
    assert all(code.strip() for _, code in blocks), f"{_page_id(page)}: an empty runnable block"
    if page.name in PAGES_WITH_RUNNABLE_BLOCKS and page.parent.name == "docs":
        assert blocks, f"{_page_id(page)} should have runnable blocks, but none were extracted"


def _runnable_code(page) -> str:
    try:
        return "\n".join(code for _, code in runnable_blocks(page.read_text()))
    except ValueError:  # a malformed page: test_every_marker_yields_a_runnable_block reports it
        return ""


@pytest.mark.parametrize("page", [_hax_dot_param(p, _runnable_code(p)) for p in _marked_pages()], ids=_page_id)
def test_runnable_doc_blocks(page, tmp_path):
    blocks = runnable_blocks(page.read_text())
    assert blocks
    script, spans = [DOCUMENTED_PATH], []  # spans: (first script line, last script line, page line) per block
    for page_line, code in blocks:
        script.append(f"# --- {_page_id(page)}, block at line {page_line} ---")
        start = len(script) + 1
        script.extend(code.splitlines())
        spans.append((start, len(script), page_line))
    path = tmp_path / "doc_blocks.py"
    path.write_text("\n".join(script) + "\n")
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        failing = [int(n) for n in re.findall(rf'File "{re.escape(str(path))}", line (\d+)', proc.stderr)]
        where = "an unknown block"
        for start, stop, page_line in spans:
            if failing and start <= failing[-1] <= stop:
                code = "\n".join(script[start - 1 : stop])
                where = f"the block at {_page_id(page)}:{page_line}, its line {failing[-1] - start + 1}:\n{code}"
        pytest.fail(f"a runnable block of {_page_id(page)} failed; {where}\n\n{proc.stderr[-4000:]}")


def test_every_readme_python_block_is_runnable():
    # A user copies README blocks as they are: each one runs (test_runnable_doc_blocks runs
    # them in order, on a CPU), none is a fragment.
    lines = (ROOT / "README.md").read_text().splitlines()
    fences = [i for i, line in enumerate(lines) if line.strip() == "```python"]
    unmarked = [i + 1 for i in fences if i == 0 or lines[i - 1].strip() != MARKER]
    assert fences and not unmarked, f"README.md: python blocks at lines {unmarked} are not marked {MARKER}"


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    public = sorted(n for n in dir(fp8ax) if not n.startswith("_"))
    documented = set(re.findall(r"^:::\s*fp8ax\.(\w+)", api, flags=re.MULTILINE))
    missing = [n for n in public if n not in documented]
    assert not missing, f"public names missing from docs/api.md: {missing}"


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    head = readme[:3000]
    # The main job installs the `haliax` extra: the demo is a Haliax model, and fp8ax does
    # not install Haliax by itself. The extra is the maintained distribution, marin-haliax;
    # the old `haliax` distribution is never named there (both install the package `haliax`).
    main_job = 'python3 -m venv .venv && .venv/bin/pip install -e ".[haliax]" && .venv/bin/python examples/demo.py'
    assert main_job in head.splitlines()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["haliax"] == ["marin-haliax>=0.2.20.dev202606180959"], extras["haliax"]
    haliax_names = ("haliax", "marin-haliax", "aqtp")
    for name, reqs in [("dependencies", project["dependencies"]), *extras.items()]:
        named = [r for r in reqs if re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() in haliax_names]
        assert named == ([] if name != "haliax" else reqs), (name, reqs)
    assert '.venv/bin/pip install -e ".[test,haliax]" && .venv/bin/python -m pytest -q' in head
    # CI's runs (Python 3.11 / jax 0.10 / marin-haliax at Levanter's pin, Python 3.12 /
    # newest jax and marin-haliax, the deviceless GPU compile with haliax 1.4.dev453) are
    # the README's commands, with the interpreter CI finds and a quiet pip.
    ci = (ROOT / ".ci" / "run").read_text()
    runs = re.findall(r'^"\$py3\d+" -m venv (.+?) \|\| rc\d=\$\?$', ci, flags=re.MULTILINE)
    assert len(runs) == 3, runs
    assert all(".venv" in run and "/bin/python -m pytest -q" in run for run in runs), runs
    assert '"marin-haliax==0.2.20.dev202606180959"' in runs[0] and ".[test,haliax]" in runs[1], runs
    assert "jax[cuda12]" in runs[2] and "FP8AX_REQUIRE_GPU_AOT=1" in runs[2], runs[2]
    assert '".[test]" "haliax>=1.4.dev453"' in runs[2] and '-m "gpu_program or haliax_subset"' in runs[2], runs[2]
    assert all(run.count("FP8AX_REQUIRE_HAX_DOT=1") == 1 for run in runs), runs
    for run in runs:
        assert run.replace(" install -q -e ", " install -e ") in head, run
    # CI also runs the main job, the README line itself, on Python 3.11.
    assert "main_job=$(grep -m 1 -E '^python3 -m venv .*examples/demo\\.py$' README.md)" in ci
    assert 'for py in "$py311"; do' in ci and 'bash -c "$main_job"' in ci


def test_docs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
