"""Reading XLA:GPU's optimized HLO (``compiled.as_text()``): the kernels a step launches.

Used by bench/gpu_aot.py (deviceless compiles for an H100), bench/gpu.py (its FP8 check)
and tests/test_gpu_program.py. Only the text format is read, so it works on HLO compiled
anywhere: on a GPU, or ahead of time on a CPU host with the CUDA plugin installed.

What counts as what (the entry computation's instructions are the kernels the step
launches, in the order XLA scheduled them):

- a **kernel** is a top-level instruction that runs on the device: a fusion, a custom
  call, a copy, a collective, a conditional... (not a parameter, constant, tuple,
  get-tuple-element or bitcast, which launch nothing);
- a **GEMM** is a cuBLAS(Lt) custom call (``__cublas$...``), a fusion XLA emits with
  Triton or cuDNN as a GEMM (``"kind":"__triton_gemm"``, ``__triton_nested_gemm_fusion``,
  ``__cudnn$fusion``), or a bare ``dot``;
- an **FP8 GEMM** is ``__cublas$lt$matmul$f8``, or a GEMM fusion whose ``dot`` multiplies
  two FP8 values (the casts may be fused into it);
- the **HBM bytes** of a kernel are the sizes of its operands and results (each read or
  written once: an upper bound for a kernel that reads an operand in part, a lower one
  for a kernel that reads it twice);
- a **cast that waits on its own amax** is a non-GEMM kernel that writes an FP8 tensor
  and depends, through any chain of kernels, on a reduction kernel that reads the same
  large tensor (one at least as large as the FP8 result): the tensor is read twice, one
  pass after the other, and the cast cannot start before the reduction has finished.
  The dependence must run through a scalar that the reduction produces (an amax, or any
  other per-tensor statistic): the per-row statistics of a normalization, which the
  normalized tensor needs, do not count, and neither does a full-size tensor that the
  reduction's kernel also writes (XLA puts an activation's residual and the amax of the
  activation in one multi-output fusion): the cast waits for that tensor as it would
  for any producer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

FP8_TYPES = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e4m3b11fnuz", "f8e8m0fnu")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "token": 0,
    "s4": 0.5,
    "u4": 0.5,
    **{t: 1 for t in FP8_TYPES},
    "f4e2m1fn": 0.5,
}
NOT_KERNELS = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "domain",
}
GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cudnn$fusion", "__triton_scaled_dot")
FP8_CUBLAS = "__cublas$lt$matmul$f8"

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_NAME_RE = re.compile(r"%([\w.\-]+)")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type, e.g. "bf16[8192,4096]{1,0}" or "(f32[], pred[])"
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list

    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        return arrays(self.type)

    @property
    def calls(self) -> list[str]:
        out = []
        for key in ("calls", "to_apply", "body", "condition"):
            m = re.search(rf"\b{key}=%([\w.\-]+)", self.attrs)
            if m:
                out.append(m.group(1))
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            out += _NAME_RE.findall(m.group(1))
        return out

    @property
    def target(self) -> str | None:
        m = re.search(r'custom_call_target="([^"]*)"', self.attrs)
        return m.group(1) if m else None

    @property
    def fusion_kind(self) -> str | None:
        m = re.search(r'"kind":"([^"]*)"', self.attrs)
        return m.group(1) if m else None


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """The (dtype, shape) of every array in a type (a tuple type has several)."""
    return [(d, tuple(int(s) for s in dims.split(",") if s)) for d, dims in _ARRAY_RE.findall(type_text)]


def nbytes(type_text: str) -> float:
    """The bytes of every array in a type."""
    return sum(math.prod(shape) * _BYTES.get(dtype, 4) for dtype, shape in arrays(type_text))


def numel(type_text: str) -> int:
    """The elements of the largest array in a type."""
    return max((math.prod(shape) for _, shape in arrays(type_text)), default=0)


def _split_type(rest: str) -> tuple[str, str]:
    """`rest` = "TYPE opcode(...)...": the type and what follows it."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    i = rest.index(" ")
    return rest[:i], rest[i + 1 :]


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    name, rest = m.group(2), m.group(3)
    type_text, rest = _split_type(rest)
    op_m = re.match(r"([\w\-]+)\(", rest)
    if not op_m:
        return None
    opcode = op_m.group(1)
    depth, start = 0, op_m.end() - 1
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            break
    operands = _NAME_RE.findall(rest[start + 1 : i])
    return Instr(name, type_text, opcode, operands, rest[i + 1 :])


def parse(hlo_text: str) -> tuple[str, dict[str, list[Instr]]]:
    """`(entry name, {computation name: instructions})`."""
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        h = _HEADER_RE.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            ins = _parse_instr(line)
            if ins is not None:
                comps[current].append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return entry, comps


def _reachable(comps, names) -> list[str]:
    seen, todo = [], list(names)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.append(c)
        for ins in comps[c]:
            todo += ins.calls
    return seen


def _dots(comps, ins: Instr) -> list[tuple[Instr, dict[str, Instr]]]:
    out = []
    for c in _reachable(comps, ins.calls):
        table = {i.name: i for i in comps[c]}
        out += [(i, table) for i in comps[c] if i.opcode in ("dot", "scaled-dot")]
    return out


def _dot_flops(dot: Instr, table: dict[str, Instr]) -> float:
    lhs = table.get(dot.operands[0]) if dot.operands else None
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", dot.attrs)
    if lhs is None or m is None:
        return 0.0
    shape = lhs.arrays()[0][1]
    k = 1
    for d in (int(s) for s in m.group(1).split(",") if s):
        k *= shape[d]
    return 2.0 * numel(dot.type) * k


def _cublas_flops(ins: Instr, entry: dict[str, Instr]) -> float:
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    lhs = entry.get(ins.operands[0]) if ins.operands else None
    if m is None or lhs is None:
        return 0.0
    shape = lhs.arrays()[0][1]
    k = 1
    for d in (int(s.strip('"')) for s in m.group(1).split(",") if s):
        k *= shape[d]
    return 2.0 * numel(_first(ins.type)) * k


@dataclasses.dataclass
class Kernel:
    name: str
    opcode: str
    kind: str  # "gemm", "reduce" (a fusion with a reduction in it) or "other"
    fp8_gemm: bool
    out_dtype: str
    path: str  # GEMMs: "cublas", "triton", "cudnn" or "dot"; others ""
    bytes: float
    flops: float
    fp8_out: bool
    operands: list[str]


def kernels(hlo_text: str) -> tuple[list[Kernel], dict[str, Any]]:
    """The kernels of the entry computation, and facts about the whole program."""
    entry_name, comps = parse(hlo_text)
    entry = {i.name: i for i in comps[entry_name]}
    out = []
    for ins in comps[entry_name]:
        if ins.opcode in NOT_KERNELS:
            continue
        target, fkind = ins.target, ins.fusion_kind
        dots = _dots(comps, ins) if ins.opcode == "fusion" else []
        is_gemm = (
            (ins.opcode == "custom-call" and target is not None and "cublas" in target)
            or (ins.opcode == "fusion" and fkind in GEMM_FUSION_KINDS)
            or ins.opcode == "dot"
        )
        path = ""
        flops = 0.0
        fp8 = False
        if is_gemm:
            if ins.opcode == "custom-call":
                path, fp8 = "cublas", target == FP8_CUBLAS
                flops = _cublas_flops(ins, entry)
            elif ins.opcode == "dot":
                path = "dot"
                operand_types = [entry[o].arrays()[0][0] for o in ins.operands[:2] if o in entry]
                fp8 = len(operand_types) == 2 and all(t in FP8_TYPES for t in operand_types)
                flops = _dot_flops(ins, entry)
            else:
                path = "cudnn" if "cudnn" in fkind else "triton"
                for dot, table in dots:
                    types = [table[o].arrays()[0][0] for o in dot.operands[:2] if o in table]
                    fp8 = fp8 or (len(types) == 2 and all(t in FP8_TYPES for t in types))
                    flops += _dot_flops(dot, table)
        reduces = ins.opcode == "reduce" or any(
            i.opcode == "reduce" for c in _reachable(comps, ins.calls) for i in comps[c]
        )
        kind = "gemm" if is_gemm else ("reduce" if reduces else "other")
        byte_count = nbytes(ins.type if not (is_gemm and ins.opcode == "custom-call") else _first(ins.type))
        byte_count += sum(nbytes(entry[o].type) for o in ins.operands if o in entry)
        out_types = ins.arrays()
        out.append(
            Kernel(
                name=ins.name,
                opcode=ins.opcode,
                kind=kind,
                fp8_gemm=fp8,
                out_dtype=out_types[0][0] if out_types else "",
                path=path,
                bytes=byte_count,
                flops=flops,
                fp8_out=any(d in FP8_TYPES for d, _ in out_types),
                operands=ins.operands,
            )
        )
    conditionals = sum(i.opcode == "conditional" for c in comps.values() for i in c)
    callbacks = sum(
        i.opcode == "custom-call" and i.target is not None and "callback" in i.target for c in comps.values() for i in c
    )
    return out, {"conditionals": conditionals, "host_callbacks": callbacks, "entry": entry}


def _first(type_text: str) -> str:
    a = arrays(type_text)
    return f"{a[0][0]}[{','.join(map(str, a[0][1]))}]" if a else ""


def _is_scalar(type_text: str) -> bool:
    # A rank-0 array type (`f32[]`), or a tuple of them.
    a = arrays(type_text)
    return bool(a) and all(len(shape) == 0 for _, shape in a)


def waiting_casts(ks: list[Kernel], entry: dict[str, Instr]) -> list[str]:
    """The FP8 casts that wait on a reduction of their own input (see the module doc)."""
    by_name = {k.name: k for k in ks}

    def producers(name, seen, size, through_full=False, scalar=False):
        # `(kernel, scalar)` for the kernels `name` depends on, through pass-through
        # instructions; `scalar`: the path from the cast went through a rank-0 value. A
        # kernel reached only through one of its full-size outputs (`through_full`: a
        # multi-output fusion's tensor result, not its reduced one) is not yielded
        # itself, but its own producers are.
        if (name, scalar) in seen:
            return
        seen.add((name, scalar))
        ins = entry.get(name)
        if ins is None:
            return
        if name in by_name and not through_full:
            yield by_name[name], scalar
        full = ins.opcode == "get-tuple-element" and numel(ins.type) >= size
        scalar = scalar or _is_scalar(ins.type)
        for o in ins.operands:
            yield from producers(o, seen, size, full, scalar)

    def sources(k: Kernel, at_least: int) -> set[str]:
        out = set()
        for o in k.operands:
            base = o
            while base in entry and entry[base].opcode in ("bitcast", "get-tuple-element") and entry[base].operands:
                base = entry[base].operands[0]
            if base in entry and numel(entry[base].type) >= at_least:
                out.add(base)
        return out

    waiting = []
    for k in ks:
        if k.kind == "gemm" or not k.fp8_out:
            continue
        size = numel(entry[k.name].type)
        mine = sources(k, size)
        if not mine:
            continue
        seen: set[str] = set()
        ancestors = [p for o in k.operands for p in producers(o, seen, size)]
        if any(
            a.kind == "reduce" and through_scalar and a.name != k.name and sources(a, size) & mine
            for a, through_scalar in ancestors
        ):
            waiting.append(k.name)
    return waiting


def summary(hlo_text: str) -> dict[str, Any]:
    """Counts for one compiled program (the fields bench/gpu_aot.py reports)."""
    ks, facts = kernels(hlo_text)
    gemms = [k for k in ks if k.kind == "gemm"]
    others = [k for k in ks if k.kind != "gemm"]
    return {
        "kernels": len(ks),
        "gemms": len(gemms),
        "fp8_gemms": sum(k.fp8_gemm for k in gemms),
        "gemm_paths": sorted(f"{k.path}:{'fp8' if k.fp8_gemm else 'wide'}->{k.out_dtype}" for k in gemms),
        "gemm_out_dtypes": sorted({k.out_dtype for k in gemms}),
        "gemm_flops": sum(k.flops for k in gemms),
        "fp8_gemm_flops": sum(k.flops for k in gemms if k.fp8_gemm),
        "gemm_bytes": sum(k.bytes for k in gemms),
        "non_gemm_bytes": sum(k.bytes for k in others),
        "non_gemm_kernels": len(others),
        "waiting_casts": waiting_casts(ks, facts["entry"]),
        "conditionals": facts["conditionals"],
        "host_callbacks": facts["host_callbacks"],
    }


def roofline_s(s: dict[str, Any], *, fp8_flops_per_s: float, bf16_flops_per_s: float, bytes_per_s: float) -> float:
    """A lower bound on the step time: each GEMM at its peak throughput (FP8 or bf16) or its
    bytes at the memory bandwidth, whichever is slower (summed over GEMMs as if each were
    one; `gemm_bytes` is spread in proportion to FLOPs), plus every other kernel's bytes at
    the memory bandwidth."""
    wide = s["gemm_flops"] - s["fp8_gemm_flops"]
    compute = s["fp8_gemm_flops"] / fp8_flops_per_s + wide / bf16_flops_per_s
    return max(compute, s["gemm_bytes"] / bytes_per_s) + s["non_gemm_bytes"] / bytes_per_s


if __name__ == "__main__":  # python bench/gpu_hlo.py FILE.hlo: the summary of a dumped program
    import sys

    print(json.dumps(summary(open(sys.argv[1]).read()), indent=1))
