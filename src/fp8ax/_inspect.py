import dataclasses
import re
from collections.abc import Callable

import jax

_FP8_TYPE = re.compile(r"f8E\dM\d(?:FNUZ|FN|B11FNUZ)?", re.IGNORECASE)
# StableHLO: `stablehlo.dot_general %a, %b, ... : (tensor<4x8xf8E4M3FN>, tensor<...>) -> tensor<...>`
_SHLO_DOT = re.compile(r"stablehlo\.dot_general[^\n]*?:\s*\(([^)]*)\)\s*->")
# Optimised HLO: `dot(f8e4m3fn[4,8]{1,0} %a, ...)` or a cuBLAS(Lt) GEMM custom call.
_HLO_DOT = re.compile(r"=\s*[^\n=]*?\b(dot|custom-call)\(([^)]*)\)([^\n]*)")


@dataclasses.dataclass(frozen=True)
class GemmReport:
    """What [`fp8ax.gemm_report`][] found in a function's lowered and compiled program.

    - `lowered_fp8` / `lowered_total`: `dot_general`s in the StableHLO that JAX emits, and
      how many of them take FP8 operands (what fp8ax's `"direct"` mode produces).
    - `compiled_fp8` / `compiled_total`: matrix multiplications in the program XLA
      compiled for `backend` (dots and GEMM custom calls), and how many of them run on FP8
      operands. On a GPU with FP8 support these are cuBLASLt FP8 GEMMs; on CPU XLA
      upcasts FP8 operands before the dot, so `compiled_fp8` is 0 there.
    """

    backend: str
    lowered_fp8: int
    lowered_total: int
    compiled_fp8: int
    compiled_total: int

    @property
    def all_fp8(self) -> bool:
        """Whether every compiled matmul runs on FP8 operands."""
        return self.compiled_total > 0 and self.compiled_fp8 == self.compiled_total


def _count_lowered(text: str) -> tuple[int, int]:
    total = fp8 = 0
    for m in _SHLO_DOT.finditer(text):
        total += 1
        operands = m.group(1)
        if _FP8_TYPE.search(operands):
            fp8 += 1
    return fp8, total


def _count_compiled(text: str) -> tuple[int, int]:
    total = fp8 = 0
    for m in _HLO_DOT.finditer(text):
        kind, operands, rest = m.groups()
        if kind == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            if not target or not re.search(r"gemm|matmul|cublas", target.group(1), re.IGNORECASE):
                continue
        total += 1
        if _FP8_TYPE.search(operands) or (kind == "custom-call" and "f8" in target.group(1)):
            fp8 += 1
    return fp8, total


def gemm_report(fn: Callable, *args, **kwargs) -> GemmReport:
    """Counts the matmuls of `jax.jit(fn)(*args, **kwargs)` that really run in FP8.

    XLA only turns the quantise-dequantise (`"qdq"`) pattern into an FP8 GEMM when it
    recognises the exact op sequence, and otherwise silently runs a bf16/f32 GEMM. Use this
    on the device you train on to check what you get. It lowers and compiles `fn`; it does
    not run it.

    **Arguments:**

    - `fn`: the function to inspect, e.g. a training step. Wrap Equinox functions that
      take modules with `eqx.filter_jit` first; any jittable callable works.
    - `*args`, `**kwargs`: example arguments.

    **Returns:**

    A [`fp8ax.GemmReport`][].

    !!! Example

        ```python
        report = fp8ax.gemm_report(eqx.filter_jit(train_step), model, opt_state, batch)
        assert report.all_fp8, report
        ```
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be a callable (e.g. a training step), got {type(fn).__name__}.")
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    lowered = getattr(lowered, "lowered", lowered)  # eqx.filter_jit wraps JAX's `Lowered`
    lf, lt = _count_lowered(lowered.as_text())
    compiled_text = lowered.compile().as_text()
    cf, ct = _count_compiled(compiled_text)
    return GemmReport(backend=jax.default_backend(), lowered_fp8=lf, lowered_total=lt, compiled_fp8=cf, compiled_total=ct)
