"""What the bench scripts share: timing, the machine and the versions, results files.

A script run as ``python bench/<name>.py`` has bench/ first on Python's module search
path (Python puts the script's directory there), so ``import _harness`` finds this file;
the tests that load a script with importlib put bench/ there themselves. Each script keeps
the keys of its own results file: these helpers give the values, the scripts name them.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


# --------------------------------------------------------------------------------------
# Versions and the machine


def dist_version(name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def haliax_version() -> str | None:
    """Haliax's version: it installs as `marin-haliax` (pyproject.toml's extra) or `haliax`."""
    return dist_version("marin-haliax") or dist_version("haliax")


def versions(names: Iterable[str], missing: str | None = None) -> dict[str, str | None]:
    """{name: version} of distributions (`missing` for one not installed)."""
    return {n: (haliax_version() if n == "haliax" else dist_version(n)) or missing for n in names}


def jax_distributions() -> list[str]:
    """`name==version` of the JAX, cuBLAS and cuDNN distributions (what a GPU run used)."""
    return sorted(
        {
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith(("jax", "nvidia-cublas", "nvidia-cudnn"))
        }
    )


def gpu_versions() -> dict[str, Any]:
    """The versions record of the GPU benchmarks' results files (gpu.py, gpu_train.py)."""
    return {
        **versions(("jax", "jaxlib", "equinox", "haliax", "optax", "fp8ax")),
        "python": python_version(),
        "jax_and_cuda_distributions": jax_distributions(),
    }


def python_version() -> str:
    return platform.python_version()


def now(timespec: str = "seconds") -> str:
    """The UTC time, ISO 8601."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec=timespec)


def command(cmd: list[str]) -> str | None:
    """The output of a command run in the repository, or None if it fails or is missing."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=30)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def git(*args: str) -> str | None:
    """The output of a git command in the repository, or None (no git, not a checkout)."""
    return command(["git", *args])


def git_commit() -> str | None:
    return git("rev-parse", "HEAD")


def src_changes() -> list[str] | None:
    """Uncommitted changes to src/ (a benchmark measures the working tree), or None."""
    dirty = git("status", "--porcelain", "--", "src")
    return None if dirty is None else dirty.splitlines()


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def device_kind() -> str:
    """The first JAX device's kind (this initializes the backend)."""
    import jax

    return jax.devices()[0].device_kind


def machine() -> dict[str, Any]:
    """The machine record of the CPU benchmarks' results files (overhead.py, serving.py)."""
    import jax

    return {
        "devices": [repr(d) for d in jax.devices()],
        "device_kind": device_kind(),
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "jaxlib_version": dist_version("jaxlib"),
        "equinox_version": dist_version("equinox"),
        "haliax_version": haliax_version(),
        "optax_version": dist_version("optax"),
        "fp8ax_version": dist_version("fp8ax"),
        "fp8ax_git_commit": git_commit(),
        "fp8ax_src_uncommitted_changes": src_changes(),
        "python": python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "date": now(),
    }


def slug(text: str) -> str:
    """`text` as a file-name part: lower case, runs of other characters as one `_`."""
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


# --------------------------------------------------------------------------------------
# Timing


def block(tree) -> None:
    """Waits for every array in `tree` (a module, a tuple of them...)."""
    import equinox as eqx
    import jax

    jax.block_until_ready(eqx.filter(tree, eqx.is_array))


def stats(times: list[float]) -> dict[str, Any]:
    """Median, min, quartiles (inclusive) and every sample, in seconds."""
    out = {"median_s": statistics.median(times), "min_s": min(times)}
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [times[0]] * 3
    out["p25_s"], out["p75_s"] = q[0], q[2]
    out["all_s"] = times
    return out


def interleaved(
    run: Callable[[str], Any], names: Iterable[str], rounds: int, warmup: int = 0
) -> dict[str, list[float]]:
    """The seconds of each timed `run(name)` (which blocks on its result), per name.

    First `warmup` untimed calls of each name in turn; then `rounds` rounds of one call of
    every name, the order rotating by one each round, so that a slow spell of a shared
    machine falls on every variant alike."""
    names = list(names)
    for name in names:
        for _ in range(warmup):
            run(name)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------------------------------
# Results files


def jsonable(x):
    """`x` with what JSON cannot hold made plain: NaN and infinities as strings, numpy and
    JAX scalars as floats, anything else unknown as its repr."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, bool | int | float | str) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return repr(x)


def write_json(path: str | Path, payload: Any, indent: int = 2, default=None) -> Path:
    """Writes `payload` as JSON (and a final newline), making the folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent, default=default) + "\n")
    return path
