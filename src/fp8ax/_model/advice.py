# The warning on a GPU whose XLA autotunes Triton GEMMs with no persistent compilation cache
# (docs/gpu.md): FP8 programs then take minutes to compile, at every start.

import os
import warnings

import jax

GPU_COMPILE_ADVICE = (
    "fp8ax: XLA:GPU autotunes each FP8 GEMM over Triton kernels, and compiling those is slow: the first "
    "compile of a Llama-shaped decoder layer's FP8 train step took 159 s on an H200 (its bf16 step 6.8 s). "
    "Either start JAX with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false (cuBLASLt GEMMs only: 3.8 s there, "
    "steps 7% slower than with Triton's kernels), or give JAX a persistent compilation cache "
    "(jax.config.update('jax_compilation_cache_dir', path): 1.1 s from the second run on). docs/gpu.md has "
    "the measurements. (Shown once per process.)"
)
_ADVISED = []


def _platform() -> str:
    return jax.default_backend()


def _cache_dir():
    # A config state JAX sets on `Config` at run time; its type stubs do not declare it.
    return jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]


def advise_gpu_compile() -> None:
    """Warns once per process, at the first trace of an FP8 layer on a GPU, when XLA:GPU
    would autotune the FP8 GEMMs with Triton (its default) and JAX has no persistent
    compilation cache to keep the result: the first compile then takes minutes."""
    if _ADVISED:
        return
    if _platform() != "gpu":
        return
    _ADVISED.append(True)
    flags = os.environ.get("XLA_FLAGS", "").replace("=", " ").replace(",", " ").split()
    triton_off = any(
        f in ("--xla_gpu_enable_triton_gemm", "-xla_gpu_enable_triton_gemm")
        and i + 1 < len(flags)
        and flags[i + 1].lower() in ("false", "0")
        for i, f in enumerate(flags)
    )
    if triton_off or _cache_dir():
        return
    warnings.warn(GPU_COMPILE_ADVICE, stacklevel=3)
