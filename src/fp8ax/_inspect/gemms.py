import bisect
import dataclasses
import os
import pathlib
import re
from collections.abc import Callable

import equinox as eqx
import jax

_FP8_TYPE = re.compile(r"f8E\dM\d(?:FNUZ|FN|B11FNUZ)?", re.IGNORECASE)
# Optimized HLO: `dot(f8e4m3fn[4,8]{1,0} %a, ...)` or a cuBLAS(Lt) GEMM custom call.
_HLO_DOT = re.compile(r"=\s*[^\n=]*?\b(dot|custom-call)\(([^)]*)\)([^\n]*)")

# fp8ax's own source files: a matmul traced through them belongs to an fp8ax layer (the
# package's directory, this module's parent's parent, with the separator: not a sibling
# such as `fp8ax_extras`).
_FP8AX_DIR = str(pathlib.Path(__file__).resolve().parent.parent) + os.sep
# The named scope of `Fp8DotGeneral.__call__`, in JAX's name for every op it emits
# (forward and backward GEMMs alike).
_FP8AX_SCOPE = "fp8ax.Fp8DotGeneral"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix multiplication of a [`fp8ax.GemmReport`][].

    - `lhs`, `rhs`, `out`: dtype and shape of the operands and the result, as XLA writes
      them (`f8e4m3fn[64,128]`, `bf16[8,4,64,64]`); `""` where the compiled program does
      not say.
    - `fp8`: whether it takes FP8 operands (the rule of the counts).
    - `fp8ax`: whether an fp8ax layer ([`fp8ax.Fp8DotGeneral`][]) issued it: its forward
      GEMM or one of its two gradient GEMMs.
    - `name`: JAX's name for the op: the transformations and named scopes it was traced
      under, e.g. `jvp(eqx.nn.MultiheadAttention)/vmap(sd,Sd->sS)/dot_general`; for a
      GEMM of an fp8ax layer in the lowered program, the shared function it is in and its
      name there (`fp8ax.Fp8DotGeneral.forward/dot_general`).
    - `location`: `"file:line"` of the code that issued it: the innermost frame outside
      JAX, fp8ax and the wrappers of Equinox and Haliax that only pass calls on (for an
      fp8ax GEMM, where the layer was called); None if unknown.
    - `traceback`: all the frames JAX recorded, innermost first (lowered program only).
    """

    lhs: str
    rhs: str
    out: str
    fp8: bool
    fp8ax: bool
    name: str
    location: str | None
    traceback: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = _short_path(self.location) if self.location else "unknown location"
        caller = _caller(self.traceback, self.location)
        if caller is not None:
            where += f" (from {caller})"
        return f"{self.lhs} x {self.rhs} -> {self.out}  {where}  ({_short_name(self.name)})"


@dataclasses.dataclass(frozen=True)
class GemmReport:
    """What [`fp8ax.gemm_report`][] found in a function's lowered and compiled program.

    - `lowered_fp8` / `lowered_total`: `dot_general`s in the StableHLO that JAX emits, and
      how many of them take FP8 operands (what fp8ax's `"direct"` mode produces).
    - `backend`: the platform the program was compiled for: the default backend's, or
      `"gpu"` for a program compiled ahead of time for a GPU topology on a CPU host.
    - `compiled_fp8` / `compiled_total`: matrix multiplications in the program XLA
      compiled for `backend` (dots, inside fusions too, and GEMM custom calls), and how
      many of them run on FP8 operands. On a GPU with FP8 support these are cuBLASLt FP8
      GEMMs and Triton GEMM fusions whose dot multiplies two FP8 values (a fusion that
      converts its FP8 operands to bf16 first does not count); on CPU XLA upcasts FP8
      operands before the dot, so `compiled_fp8` is 0 there.
    - `lowered` / `compiled`: those matmuls one by one, each a `Gemm` with its operand
      and result types (`lhs`, `rhs`, `out`), `fp8`, `fp8ax` (issued by an fp8ax layer:
      its forward or one of its gradient GEMMs), JAX's `name` for it, and the `location`
      (`"file:line"`) and `traceback` of the code that issued it. A compiled matmul's
      location is that of the lowered one with the same name.

    `print(report)` gives the counts, split into fp8ax's GEMMs and the others, and lists
    the lowered matmuls without FP8 operands with their shapes and locations.
    """

    backend: str
    lowered_fp8: int
    lowered_total: int
    compiled_fp8: int
    compiled_total: int
    lowered: tuple[Gemm, ...] = dataclasses.field(default=(), repr=False)
    compiled: tuple[Gemm, ...] = dataclasses.field(default=(), repr=False)

    @property
    def all_fp8(self) -> bool:
        """Whether every compiled matmul runs on FP8 operands. False for a model with
        matmuls outside its FP8 layers (attention scores, a head left in bf16); see
        `converted_all_fp8`."""
        return self.compiled_total > 0 and self.compiled_fp8 == self.compiled_total

    @property
    def converted_all_fp8(self) -> bool:
        """Whether every compiled matmul of fp8ax's layers runs on FP8 operands (and
        there is at least one). Matmuls outside them (attention scores, layers left in
        high precision on purpose) do not count; they are listed in `non_fp8`. On CPU
        this is False: XLA:CPU has no FP8 GEMM."""
        ours = [g for g in self.compiled if g.fp8ax]
        return bool(ours) and all(g.fp8 for g in ours)

    @property
    def lowered_converted_all_fp8(self) -> bool:
        """`converted_all_fp8` for the lowered program: every `dot_general` that fp8ax's
        layers emit takes FP8 operands. True in `mode="direct"` on any backend; False in
        `"qdq"` mode, whose lowered GEMMs are high precision until XLA rewrites them."""
        ours = [g for g in self.lowered if g.fp8ax]
        return bool(ours) and all(g.fp8 for g in ours)

    @property
    def non_fp8(self) -> list[Gemm]:
        """The compiled matmuls that do not run on FP8 operands, with their shapes and
        source locations (on CPU: all of them)."""
        return [g for g in self.compiled if not g.fp8]

    @property
    def lowered_non_fp8(self) -> list[Gemm]:
        """The `dot_general`s of the lowered program that take no FP8 operand."""
        return [g for g in self.lowered if not g.fp8]

    def __str__(self) -> str:
        lines = [
            f"gemm_report on {self.backend}: lowered {self.lowered_fp8}/{self.lowered_total} dot_generals with FP8 "
            f"operands; compiled {self.compiled_fp8}/{self.compiled_total} matmuls on FP8 operands"
        ]
        for title, gemms in (("lowered", self.lowered), ("compiled", self.compiled)):
            ours = [g for g in gemms if g.fp8ax]
            lines.append(
                f"  {title}: fp8ax layers {sum(g.fp8 for g in ours)}/{len(ours)} FP8; "
                f"other matmuls {sum(g.fp8 for g in gemms if not g.fp8ax)}/{len(gemms) - len(ours)} FP8"
            )
        others = _grouped([g for g in self.lowered if not g.fp8])
        if others:
            lines.append("  lowered matmuls without FP8 operands:")
            lines += [f"    {n} x {g}" if n > 1 else f"    {g}" for g, n in others]
        if self.backend == "cpu":
            lines.append("  (XLA:CPU upcasts FP8 before every matmul, so no compiled matmul is FP8 here.)")
        return "\n".join(lines)


def _grouped(gemms: list[Gemm]) -> list[tuple[Gemm, int]]:
    # The same matmul can appear several times (a layer called twice, each stacked layer
    # unrolled): listed once, with a count.
    counts: dict[tuple, list] = {}
    for g in gemms:
        key = (g.lhs, g.rhs, g.out, g.location, _short_name(g.name))
        counts.setdefault(key, [g, 0])[1] += 1
    return [(g, n) for g, n in counts.values()]


def _short_name(name: str, width: int = 72) -> str:
    name = re.sub(r"^jit\([^/]*\)/", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def _caller(frames: tuple[str, ...], location: str | None) -> str | None:
    """The innermost frame of your own code (not an installed package, not fp8ax), if
    the location is in a library."""
    if location is None or not any(m in location for m in ("site-packages/", "dist-packages/")):
        return None
    for f in frames:
        if not any(m in f for m in ("site-packages/", "dist-packages/")) and not _is_fp8ax_frame(f):
            return f
    return None


def _short_path(location: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in location:
            return location.split(marker, 1)[1]
    return location


# --- the matmuls of a program, with their source ---

_MLIR_TYPE = re.compile(r"tensor<([^>]*)>")
_SHLO_DOT_LINE = re.compile(
    r"stablehlo\.dot_general[^\n]*?:\s*\(([^)]*)\)\s*->\s*(tensor<[^>]*>)[^\n]*?loc\((#loc\d*|.*)\)\s*$", re.M
)
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)
_FILE_LOC = re.compile(r'^"([^"]+)":(\d+):\d+')
_NAME_LOC = re.compile(r'^"((?:[^"\\]|\\.)*)"(?:\((.*)\))?$', re.S)
_CALLSITE = re.compile(r"^callsite\((#loc\d*) at (#loc\d*)\)$")


def _mlir_type(t: str) -> str:
    """`tensor<2x4x16xf8E4M3FN>` -> `f8e4m3fn[2,4,16]`."""
    m = _MLIR_TYPE.search(t)
    if not m:
        return t.strip()
    *dims, dtype = m.group(1).split("x")
    return f"{dtype.lower()}[{','.join(dims)}]"


class _Locations:
    """Resolves MLIR location aliases (`#loc12`) to (name, frames)."""

    def __init__(self, text: str):
        self.defs = dict(_LOC_DEF.findall(text))
        self.memo: dict[str, tuple[str, tuple[str, ...]]] = {}

    def resolve(self, loc: str) -> tuple[str, tuple[str, ...]]:
        loc = loc.strip()
        if loc not in self.memo:
            self.memo[loc] = self._resolve(loc)
        return self.memo[loc]

    def _resolve(self, loc: str) -> tuple[str, tuple[str, ...]]:
        if loc.startswith("#loc"):
            body = self.defs.get(loc)
            return self.resolve(body) if body is not None else ("", ())
        if m := _CALLSITE.match(loc):
            n1, f1 = self.resolve(m.group(1))
            n2, f2 = self.resolve(m.group(2))
            return n1 or n2, f1 + f2
        if m := _FILE_LOC.match(loc):
            return "", (f"{m.group(1)}:{m.group(2)}",)
        if m := _NAME_LOC.match(loc):
            name, child = m.group(1), m.group(2)
            n, frames = self.resolve(child) if child else ("", ())
            return name, frames
        return "", ()


def _is_fp8ax_frame(frame: str) -> bool:
    return frame.startswith(_FP8AX_DIR)


def _issued_by_fp8ax(name: str, frames: tuple[str, ...]) -> bool:
    # The named scope of `Fp8DotGeneral.__call__`, or the innermost frame in fp8ax's
    # source (not any frame: `gemm_report` and `microbatched` are fp8ax frames too).
    return _FP8AX_SCOPE in name or bool(frames and _is_fp8ax_frame(frames[0]))


# Library frames that only pass a call on (jit and grad wrappers, Haliax's named-axis
# dot): a location names the code that asked for the matmul, not these.
_PLUMBING = (
    "equinox/_jit.py",
    "equinox/_ad.py",
    "equinox/_vmap_pmap.py",
    "equinox/_module/",
    "haliax/jax_utils.py",
    "haliax/_src/",
    "haliax/core.py",
)


def _location(frames: tuple[str, ...]) -> str | None:
    """The innermost frame outside fp8ax and the plumbing; the innermost if all are."""
    keep = (f for f in frames if not _is_fp8ax_frame(f) and not any(p in f for p in _PLUMBING))
    return next(keep, frames[0] if frames else None)


# A function of the lowered module, and a call of one. fp8ax's GEMM passes are functions
# of their own, shared by every call site of one signature (`_gemm/passes.py`) and named
# after the layer's scope: the ops inside carry no caller's scope, so a GEMM belongs to an
# fp8ax layer by the function it is in, and runs once per call of that function.
_SHLO_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$\-]+)\(", re.M)
_SHLO_CALL = re.compile(r"\bcall @([\w.$\-]+)\(")


def _runs_per_function(text: str, funcs: list[tuple[int, str]]) -> dict[str, int]:
    """How many times one run of the module's entry (`main`) runs each function: once per
    run of each call site (a call graph has no cycles)."""
    calls: dict[str, list[str]] = {}
    for k, (start, name) in enumerate(funcs):
        end = funcs[k + 1][0] if k + 1 < len(funcs) else len(text)
        calls[name] = _SHLO_CALL.findall(text, start + 1, end)
    if "main" not in calls:
        return dict.fromkeys(calls, 1)
    runs = dict.fromkeys(calls, 0)

    def run(name: str) -> None:
        runs[name] += 1
        for callee in calls.get(name, ()):
            run(callee)

    run("main")
    return runs


def _lowered_gemms(text: str) -> tuple[Gemm, ...]:
    """Every `dot_general` the lowered module runs, as many times as it runs (a shared
    function's once per call)."""
    locs = _Locations(text)
    funcs = [(m.start(), m.group(1)) for m in _SHLO_FUNC.finditer(text)]
    starts = [start for start, _ in funcs]
    runs = _runs_per_function(text, funcs)
    out = []
    for m in _SHLO_DOT_LINE.finditer(text):
        operands, result, loc = m.groups()
        types = _MLIR_TYPE.findall(operands)
        lhs, rhs = (_mlir_type(f"tensor<{t}>") for t in (types + ["", ""])[:2])
        name, frames = locs.resolve(loc)
        func = funcs[bisect.bisect_right(starts, m.start()) - 1][1] if funcs and starts[0] <= m.start() else ""
        fp8ax = _issued_by_fp8ax(name, frames)
        if _FP8AX_SCOPE in func:
            fp8ax, name = True, f"{func}/{name}"
        gemm = Gemm(
            lhs, rhs, _mlir_type(result), bool(_FP8_TYPE.search(operands)), fp8ax, name, _location(frames), frames
        )
        out += [gemm] * runs.get(func, 1)
    return tuple(out)


_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+[\w\-]+\(", re.M)
_HLO_LAYOUT = re.compile(r"\{[^{}]*\}")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


_HLO_OPERAND_TYPED = re.compile(r"([^%]*?)%([\w.\-]+)")


def _operand_types(operands: str, types: dict[str, str]) -> list[str]:
    """The type of each operand in an HLO operand list: written before its name
    (`f8e4m3fn[4,8]{1,0} %a`, as older XLA prints it) or, for a bare `%a`, the type of
    the instruction that defines `a`."""
    out = []
    for written, name in _HLO_OPERAND_TYPED.findall(operands):
        written = _HLO_LAYOUT.sub("", written).strip(" ,")
        out.append(written or types.get(name, ""))
    return out


def _compiled_gemms(text: str, lowered: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """The matmuls of an optimized HLO module: every `dot`, in the entry computation or
    inside a fusion (XLA:GPU's Triton GEMM fusions hold theirs inside), and every GEMM
    custom call (cuBLAS). A `dot` is FP8 when both its operands are; XLA prints operands
    by name only, so their types come from the instructions that define them
    (instruction names are unique in a module)."""
    types = {name: _HLO_LAYOUT.sub("", t) for name, t in _HLO_DEF.findall(text)}
    where = {}  # op name -> (location, traceback), from the lowered program
    for g in lowered:
        where.setdefault(g.name, (g.location, g.traceback))
    out = []
    for line in text.splitlines():
        for m in _HLO_DOT.finditer(line):
            kind, operands, rest = m.groups()
            found = re.search(r'custom_call_target="([^"]+)"', rest)
            target = found.group(1) if found else ""  # (never empty when found)
            if kind == "custom-call" and not re.search(r"gemm|matmul|cublas", target, re.IGNORECASE):
                continue
            lhs, rhs = (_operand_types(operands, types) + ["", ""])[:2]
            if kind == "custom-call":
                fp8 = "f8" in target
            else:
                fp8 = bool(_FP8_TYPE.match(lhs) and _FP8_TYPE.match(rhs))
            d = _HLO_DEF.match(line)
            result = _HLO_LAYOUT.sub("", d.group(2)) if d else ""
            if result.startswith("("):  # a GEMM custom call returns (result, workspace)
                first = re.match(r"\(\s*([a-z0-9]+\[[0-9,]*\])", result)
                result = first.group(1) if first else ""
            op = _OP_NAME.search(rest)
            name = op.group(1) if op else ""
            location, frames = where.get(name, (None, ()))
            fp8ax = _issued_by_fp8ax(name, frames)
            out.append(Gemm(lhs, rhs, result, fp8, fp8ax, name, location, frames))
    return tuple(out)


def gemm_report(fn: Callable, *args, **kwargs) -> GemmReport:
    """Counts the matmuls of `jax.jit(fn)(*args, **kwargs)` that really run in FP8.

    XLA only turns the quantize-dequantize (`"qdq"`) pattern into an FP8 GEMM when it
    recognises the exact op sequence, and otherwise silently runs a bf16/f32 GEMM. Use this
    on the device you train on to check what you get. It lowers and compiles `fn`; it does
    not run it.

    **Arguments:**

    - `fn`: the function to inspect, e.g. a training step: a jitted function
      (`eqx.filter_jit`, `jax.jit`) or any callable, which is wrapped in
      `eqx.filter_jit` (so it may take modules).
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
    jitted = fn if hasattr(fn, "lower") else eqx.filter_jit(fn)
    lowered = jitted.lower(*args, **kwargs)
    lowered = getattr(lowered, "lowered", lowered)  # eqx.filter_jit wraps JAX's `Lowered`
    compiled_text = lowered.compile().as_text()
    low = _lowered_gemms(lowered.as_text(debug_info=True))
    lf, lt = sum(g.fp8 for g in low), len(low)
    compiled = _compiled_gemms(compiled_text, low)
    return GemmReport(
        backend=_platform(lowered),
        lowered_fp8=lf,
        lowered_total=lt,
        compiled_fp8=sum(g.fp8 for g in compiled),
        compiled_total=len(compiled),
        lowered=low,
        compiled=compiled,
    )


def _platform(lowered) -> str:
    """The platform `lowered` compiles for: the default backend's, or the one its
    arguments are placed on (a GPU topology, for a program compiled ahead of time on a
    CPU host)."""
    try:
        return str(lowered._lowering.compile_args["backend"].platform)
    except (AttributeError, KeyError, TypeError):  # another JAX: its internals moved
        return jax.default_backend()
