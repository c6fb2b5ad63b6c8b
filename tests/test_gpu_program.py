"""The program XLA:GPU builds from an FP8 step (issue: make it what the design says).

On every machine: what fp8ax hands XLA (the lowered StableHLO). With the CUDA plugin
installed (``pip install "jax[cuda12]"``): the optimised HLO of a small train step compiled
ahead of time for an H100 (bench/gpu_aot.py's topology), read with bench/gpu_hlo.py.
Without the plugin those tests skip, saying so.
"""

import importlib.util
import pathlib
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import fp8ax

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
DIMS = (((1,), (0,)), ((), ()))


def _dot_precisions(text: str) -> list[str]:
    """The precision of every `dot_general` in lowered StableHLO, in program order."""
    return [m.group(1) if m else "DEFAULT" for m in
            (re.search(r"precision = \[(\w+), \w+\]", line) for line in text.splitlines() if "dot_general" in line)]


@pytest.mark.parametrize("mode", ["direct", "qdq"])
def test_backward_fp8_gemms_accumulate_in_full_precision(mode):
    dg = fp8ax.Fp8DotGeneral.init(mode=mode)
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))

    def loss(d, x, w):
        return jnp.sum(d(x, w, DIMS) ** 2)  # the forward GEMM's output is used

    text = jax.jit(jax.grad(loss, argnums=(1, 2))).trace(dg, x, w).lower().as_text()
    # Forward DEFAULT (fast accumulation allowed), the two backward GEMMs HIGHEST.
    assert sorted(_dot_precisions(text)) == ["DEFAULT", "HIGHEST", "HIGHEST"]

    # An explicit precision is the user's.
    dg_fast = fp8ax.Fp8DotGeneral.init(mode=mode, dlhs_precision=lax.Precision.HIGH, drhs_precision=lax.Precision.HIGH)
    text = jax.jit(jax.grad(loss, argnums=(1, 2))).trace(dg_fast, x, w).lower().as_text()
    assert sorted(_dot_precisions(text)) == ["DEFAULT", "HIGH", "HIGH"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"fp8ax_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def h100():
    """`(mesh, gpu_hlo)`: a one-device mesh on a described H100, or a skip."""
    sys.path.insert(0, str(BENCH))
    aot = _load("gpu_aot")
    try:
        mesh = aot.topology_mesh()
    except Exception as e:  # noqa: BLE001 (the reason is the skip message)
        pytest.skip(f"no deviceless GPU compile here (needs the CUDA plugin, pip install 'jax[cuda12]'): {e}")
    return mesh, _load("gpu_hlo")


def _compile_step(mesh, mode):
    from jax.sharding import NamedSharding, PartitionSpec as P

    dg = fp8ax.Fp8DotGeneral.init(mode=mode)
    rep = NamedSharding(mesh, P())
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    x, w = abstract(jnp.zeros((256, 512), jnp.bfloat16)), abstract(jnp.zeros((512, 384), jnp.bfloat16))
    leaves, tree = jax.tree.flatten(dg)

    def step(leaves, x, w):
        d = jax.tree.unflatten(tree, leaves)
        return jax.grad(lambda d, x, w: jnp.sum(d(x, w, DIMS).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(d, x, w)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "fp8ax: this program is compiled for")
        compiled = jax.jit(step).lower([abstract(a) for a in leaves], x, w).compile()
    return compiled.as_text()


@pytest.mark.parametrize("mode", ["direct", "qdq"])
def test_default_step_compiles_for_an_h100_without_one(h100, mode):
    mesh, gpu_hlo = h100
    s = gpu_hlo.summary(_compile_step(mesh, mode))
    assert s["host_callbacks"] == 0  # left out of a program this process cannot run
    assert s["gemms"] == 3
    if mode == "direct":  # qdq relies on XLA's pattern, which Triton's GEMM fusions do not take
        assert s["fp8_gemms"] == 3, s["gemm_paths"]
