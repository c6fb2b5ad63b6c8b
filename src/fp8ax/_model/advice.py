# What a GPU user needs to compile an FP8 step in seconds (docs/gpu.md): the per-program
# XLA options of `compiler_options`, and the warning on a GPU whose XLA would autotune the
# FP8 GEMMs over Triton kernels with no persistent compilation cache: FP8 programs then
# take minutes to compile, at every start.

import os
import warnings

import jax

GPU_COMPILE_ADVICE = (
    "fp8ax: XLA:GPU autotunes each FP8 GEMM over Triton kernels, and compiling those is slow: the first "
    "compile of a Llama-shaped decoder layer's FP8 train step took 159 s on an H200 (its bf16 step 6.8 s). "
    "Compile the step with cuBLASLt's GEMMs only, for this program alone: "
    "eqx.filter_jit(step, compiler_options=fp8ax.compiler_options()) (or jax.jit(..., compiler_options=...); "
    "process-wide: XLA_FLAGS=--xla_gpu_enable_triton_gemm=false), or give JAX a persistent compilation cache "
    "(jax.config.update('jax_compilation_cache_dir', path): 1.1 s from the second run on). docs/gpu.md has "
    "the measurements. (Shown once per process, and not after fp8ax.compiler_options() was called.)"
)
_ADVISED = []


def compiler_options() -> dict[str, bool]:
    """XLA options that compile an FP8 training step in seconds on a GPU, for one program.

    Pass them to the `jit` of the step:

    ```python
    step = eqx.filter_jit(step, compiler_options=fp8ax.compiler_options())
    # or: jax.jit(step, compiler_options=fp8ax.compiler_options())
    ```

    XLA:GPU autotunes every GEMM of a program when it compiles it, and by default it
    compiles Triton kernels as candidates: for FP8 GEMMs that takes minutes (a
    Llama-shaped layer's FP8 step: 159 s on an H200, against 6.8 s for its bf16 step).
    These options turn XLA's Triton GEMMs off for this program only
    (`xla_gpu_enable_triton_gemm=False`): its GEMMs go to cuBLASLt, whose FP8 GEMMs
    need no kernel compile, and the rest of the process keeps XLA's defaults, unlike
    `XLA_FLAGS`, which must be set before JAX starts. docs/gpu.md gives what it costs the
    step (measured on an H100 and an H200). The CPU and other backends accept and
    ignore them, so the same code runs everywhere.

    Calling this also tells fp8ax that the user knows: its one-time warning about the
    first GPU compile stays silent from then on.

    **Returns:**

    A new `dict` of XLA debug options, for `jax.jit`'s or `eqx.filter_jit`'s
    `compiler_options` argument (JAX >= 0.4.36). Add your own to it as you like.
    """
    if not _ADVISED:
        _ADVISED.append(True)
    return {"xla_gpu_enable_triton_gemm": False}


def _platform() -> str:
    return jax.default_backend()


def _cache_dir():
    # A config state JAX sets on `Config` at run time; its type stubs do not declare it.
    return jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]


def advise_gpu_compile() -> None:
    """Warns once per process, at the first trace of an FP8 layer on a GPU, when XLA:GPU
    would autotune the FP8 GEMMs with Triton (its default), JAX has no persistent
    compilation cache to keep the result and `compiler_options` was never asked for: the
    first compile then takes minutes."""
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
