import functools
import importlib.metadata
import importlib.util
import os
import sys
import warnings
import zlib


# --- XLA:CPU's LLVM back end at -O0 where the tests can only run on the CPU ---
#
# Most of the suite's time is XLA:CPU compiling small programs, and most of a compile is
# LLVM optimising the kernels' machine code, which the tests' tiny arrays never repay:
# at -O0 the whole suite took a third less time (bench/README.md, "How long the tests
# take"). The HLO XLA builds (the fusions, the FP8 casts and GEMMs the tests look for) is
# the same; only the machine code of each kernel is less optimised. Set before JAX reads
# XLA_FLAGS (at its first backend, after this), and kept by the suite's subprocesses
# (`SUITE_XLA_FLAGS`). Not where a GPU or TPU plugin is installed (the GPU tests, CI's
# deviceless H100 compile): those compile as a user's program does. FP8AX_TEST_XLA_OPT=1
# keeps XLA's default optimisation level everywhere.
def cpu_only_install() -> bool:
    """No JAX plugin for another platform (CUDA, ROCm: the `jax_plugins` namespace or
    entry points) and no libtpu is installed."""
    return (
        importlib.util.find_spec("jax_plugins") is None
        and not importlib.metadata.entry_points(group="jax_plugins")
        and importlib.util.find_spec("libtpu") is None
    )


SUITE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0" if os.environ.get("FP8AX_TEST_XLA_OPT") != "1" and cpu_only_install() else ""
)
if SUITE_XLA_FLAGS and SUITE_XLA_FLAGS not in os.environ.get("XLA_FLAGS", "").split():
    if getattr(sys.modules.get("jax._src.xla_bridge"), "_backends", None):  # (read by then: too late)
        raise RuntimeError("tests/conftest.py: JAX made its backends before the suite's XLA_FLAGS were set")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SUITE_XLA_FLAGS}".strip()


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a subprocess of the suite: the suite's own (`SUITE_XLA_FLAGS`) and
    `extra`."""
    return " ".join(filter(None, (SUITE_XLA_FLAGS, *extra)))


import jax  # noqa: E402 (after XLA_FLAGS)
import pytest  # noqa: E402

# On a GPU, JAX preallocates 75% of the GPU's memory in each process that uses it, and the
# suite runs up to 4 xdist workers (addopts): the second would run out of memory. Allocate
# on demand unless the caller chose otherwise. (Read when JAX creates its GPU client, at
# the first array, after this; nothing changes on the CPU.) The GPU selection itself runs
# in one process: `python -m pytest -q -m gpu -n 0` (tests/test_gpu_invariants.py).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Strict promotion forces every cast in fp8ax to be explicit (as Equinox's tests do).
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


class _GetKey:
    """`getkey()` returns a fresh PRNG key on each call."""

    def __init__(self, seed: int):
        self._key = jax.random.key(seed)

    def __call__(self):
        self._key, sub = jax.random.split(self._key)
        return sub


@pytest.fixture
def getkey(request):
    # Seeded by the test's id: every run of a test sees the same data, so a failure
    # reproduces, and different tests still see different data.
    return _GetKey(zlib.crc32(request.node.nodeid.encode()))


def pytest_configure(config):
    # Haliax is no dependency of fp8ax, but the tests use it (many modules import it).
    if importlib.util.find_spec("haliax") is None:
        raise pytest.UsageError(
            "the tests need Haliax, which fp8ax does not install: "
            '`pip install -e ".[test,haliax]"` (marin-haliax), or `pip install -e ".[test]"` beside '
            "the old `haliax` distribution (README.md, 'Supported versions')"
        )


# --- `needs_hax_dot`: tests that need a working named-axis `hax.dot` ---
#
# The `hax.dot` (and so every `hax.nn.Linear`) of Haliax 1.4.dev453 and marin-haliax
# 0.2.20 calls `jax.core.is_constant_dim`, which jax 0.11 removed. Tests marked
# `needs_hax_dot` are skipped when a tiny `hax.dot` fails here, whatever the versions: they
# run again as soon as Haliax works with the installed JAX. CI sets
# FP8AX_REQUIRE_HAX_DOT=1 wherever it runs them, which turns the skip into a failure.


@functools.cache
def hax_dot_failure() -> str | None:
    """None if a named-axis `hax.dot` works (eagerly and under `jit`), else what it raised."""
    import haliax as hax
    import jax.numpy as jnp

    A, B = hax.Axis("a", 2), hax.Axis("b", 3)
    x = hax.named(jnp.arange(6.0).reshape(2, 3), (A, B))
    w = hax.named(jnp.ones(3), (B,))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation warning is not a broken hax.dot
            for out in (hax.dot(x, w, axis=B), jax.jit(lambda x, w: hax.dot(x, w, axis=B))(x, w)):
                assert out.axes == (A,) and out.array.tolist() == [3.0, 12.0], out
    except Exception as e:  # noqa: BLE001 (any failure means the tests cannot run)
        return f"{type(e).__name__}: {e}"
    return None


@pytest.hookimpl(tryfirst=True)  # before fixtures, which may build Haliax models
def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_hax_dot") is None or (why := hax_dot_failure()) is None:
        return
    from fp8ax._haliax import installed_haliax

    msg = f"named-axis hax.dot fails with {installed_haliax()} on jax {jax.__version__}: {why}"
    if os.environ.get("FP8AX_REQUIRE_HAX_DOT") == "1":
        pytest.fail(f"FP8AX_REQUIRE_HAX_DOT=1, but {msg}", pytrace=False)
    pytest.skip(msg)


# --- `haliax_subset`: the tests CI also runs with the other Haliax releases ---
#
# Run 1 of CI runs every test with one Haliax (marin-haliax at the version marin-levanter
# pins). Runs 2 and 3 run these with the newest marin-haliax on jax 0.12 and with the old
# `haliax` distribution (1.4.dev453): the Haliax door, the demo, the README's code and the
# sharded layouts (FSDP, tensor parallel, the FP8 all-gather), about 2 minutes on 2 cores.
# Each entry is a test id or the start of one (a file, a test and all its parameters).
HALIAX_SUBSET = (
    "tests/test_haliax.py::",
    "tests/test_examples_and_docs.py::test_example_runs[demo.py]",
    "tests/test_examples_and_docs.py::test_runnable_doc_blocks[README.md]",
    "tests/test_sharding.py::test_cases[layouts]",
)


# --- `jax_subset`: the tests CI runs again on the newest jax ---
#
# Run 1 of CI runs every test on jax 0.10. Run 2 (Python 3.12, the newest jax and
# marin-haliax; `-m "haliax_subset or (jax_subset and not needs_hax_dot)"`) runs these
# again: the tests of what fp8ax builds on JAX's own machinery, whose outcome can change
# with the JAX version (the custom VJPs and their rules, the max-accumulating extended
# dtype, transformations and the boundaries they put around a layer, the traced program,
# FP8 casts, serialisation, the compilation cache). What runs the same code whatever JAX
# does (each recipe's maths against its NumPy reference, argument checks, reports, the
# docs' text) runs in run 1 only, as do the multi-process tests (jax.distributed, Orbax)
# and the 8-device reuse matrix (shard_map is in test_sharding.py's `shard_map` group).
# About 5 minutes on 2 cores, with the Haliax subset. Each entry is a test id or the
# start of one, with the reason it is here.

# Sweeps over every recipe of tests/recipe_registry.py run one entry of each recipe class
# here: the classes differ in what they ask of JAX (state, random bits, block scales,
# two-level scales, int8, a recipe fp8ax does not know); the variants of a class differ in
# their maths, which the NumPy references check in run 1.
_ONE_RECIPE_PER_CLASS = ("delayed", "current-stochastic", "int8", "mx-fp4", "blockwise", "nvfp4", "running-max")


def _per_class(test: str, reason: str, extra: tuple[str, ...] = ()) -> dict[str, str]:
    return {f"{test}[{name}]": reason for name in (*_ONE_RECIPE_PER_CLASS, *extra)}


JAX_SUBSET = {
    "tests/test_dot_general.py::": "the dense custom VJP: numerics, lowering, jit/grad/vmap/checkpoint",
    "tests/test_maxgrad.py::": "the max-accumulating extended dtype (JAX's extended-dtype protocol)",
    "tests/test_boundaries.py::": "the JAX rules (vmap of cond/switch) that would sum FP8 state",
    "tests/test_state.py::": "the merged state of a layer used several times, under scan, vmap and loops",
    "tests/test_pipeline.py::": "the traced step's data flow: what each cast waits on, one program",
    "tests/test_per_example.py::": "the custom VJP's vmap rule",
    "tests/test_checkpoint.py::": "serialisation of weights and FP8 state",
    "tests/test_entry_points.py::": "the model placed on devices, through lax.scan, filter_vmap, shard_map",
    "tests/test_formats.py::": "FP8 casts against ml_dtypes",
    "tests/test_gpu_program.py::test_a_cpu_only_process": "one per-platform branch where JAX can compile for the CPU only",
    "tests/test_gpu_program.py::test_lowers_for_cpu_only": "JAX's backend registry (jax 0.12 registers a proxy factory)",
    "tests/test_gpu_invariants.py::": "FP8 casts bit for bit, the state's merge and NaN handling",
    "tests/test_compilation_cache.py::": "JAX's persistent compilation cache",
    "tests/test_accumulate.py::": "microbatched gradients through lax.scan",
    "tests/test_calibrate.py::test_one_program_without_conditional": "the calibrating step is one program",
    "tests/test_calibrate.py::test_a_scanned_training_loop": "a training loop in lax.scan",
    "tests/test_remat.py::test_what_remat_rounding_changes": "lax.reduce_precision of saved residuals",
    "tests/test_remat.py::test_protect": "remat of the FP8 state's leaves",
    **_per_class("tests/test_remat.py::test_every_jax_policy", "JAX's checkpoint policies", ("current-fnuz",)),
    **_per_class("tests/test_recipe_conformance.py::test_under_transforms", "each recipe under jit/scan/vmap"),
    **_per_class("tests/test_recipe_conformance.py::test_gemms_match_reference", "each recipe's three GEMMs"),
    "tests/test_recipe_conformance.py::test_state_invariants": "each recipe's state through jax.grad",
    # Every boundary and use pattern, for the dense and the grouped custom VJP (the
    # converted Equinox layers are those VJPs inside a module).
    "tests/test_reuse_matrix.py::test_reuse[dot_general-": "every boundary JAX offers around a reused layer",
    "tests/test_reuse_matrix.py::test_reuse[ragged_dot-": "every boundary around a reused grouped GEMM",
    "tests/test_sharding.py::test_cases[shard_map]": "jax.shard_map with and without check_vma",
}


# --- `gpu_program`: what CI's run 3 compiles with JAX's CUDA plugin, beside its Haliax subset ---
GPU_PROGRAM = ("tests/test_gpu_program.py::", "tests/test_gpu_hlo.py::")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(HALIAX_SUBSET):
            item.add_marker(pytest.mark.haliax_subset)
        if item.nodeid.startswith(tuple(JAX_SUBSET)):
            item.add_marker(pytest.mark.jax_subset)
        if item.nodeid.startswith(GPU_PROGRAM):
            item.add_marker(pytest.mark.gpu_program)
    # An entry whose file was collected whole but that names no test (a test renamed) is an
    # error, not a subset that shrank without a word.
    if any("::" in arg for arg in config.args):
        return  # test ids named on the command line: their files are not collected whole
    ids = [item.nodeid for item in items]
    stale = [
        entry
        for entry in (*HALIAX_SUBSET, *JAX_SUBSET)
        if not any(i.startswith(entry) for i in ids) and any(i.startswith(entry.split("::")[0] + "::") for i in ids)
    ]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: HALIAX_SUBSET or JAX_SUBSET names no collected test: {stale}")
