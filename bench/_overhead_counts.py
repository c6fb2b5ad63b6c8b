"""What bench/overhead.py counts in a step: StableHLO ops, optimized HLO instructions and
the Python calls of a lowering."""

from __future__ import annotations

import collections
import cProfile
import pstats
import re
from typing import Any

import jax

# --------------------------------------------------------------------------------------
# StableHLO op counting

# One MLIR operation per line in `Lowered.as_text()`: `%r = stablehlo.add ...`,
# `%r:2 = "stablehlo.reduce"(...)`, `stablehlo.return ...`, `%r = call @f(...)`, `return ...`.
_OP_RE = re.compile(r'^\s*(?:%[^=]*=\s*)?"?([a-z_]+(?:\.[a-z_0-9]+)+|call|return)\b')
_FUNC_RE = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL_RE = re.compile(r"\bcall @([\w.$-]+)\(")


def _split_funcs(text: str) -> dict[str, list[str]]:
    """Body lines of each `func.func` in the module, by name."""
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            current = m.group(1)
            funcs[current] = []
            continue
        if current is not None:
            if line.rstrip() == "  }":  # end of a top-level function
                current = None
            else:
                funcs[current].append(line)
    return funcs


def _ops_of(lines: list[str]) -> collections.Counter:
    c = collections.Counter()
    for line in lines:
        m = _OP_RE.match(line)
        if m:
            c[m.group(1)] += 1
    return c


def count_ops(text: str) -> dict[str, Any]:
    """Counts the operations of a lowered module (`Lowered.as_text()`), by op name.

    - `textual`: every operation line as the text has it, in all functions. A
      `stablehlo.*` op with or without a result counts (`stablehlo.return` of a reduce
      body included); so do `call` and `return`. A private function (`jnp.where`,
      `jnp.clip` are lowered as `func.func private @_where`/`@clip`) is counted once,
      however many `call`s there are to it.
    - `inlined`: the ops of `@main` with every `call @f` replaced by the ops of `f`
      (recursively): what the module would hold if every call were inlined. `call` and
      `return` themselves are not counted there.
    """
    funcs = _split_funcs(text)
    textual = _ops_of(text.splitlines())
    memo: dict[str, collections.Counter] = {}

    def inlined(name: str) -> collections.Counter:
        if name in memo:
            return memo[name]
        c = collections.Counter()
        for line in funcs.get(name, []):
            m = _OP_RE.match(line)
            if not m or m.group(1) in ("return", "func.return"):
                continue
            if m.group(1) == "call":
                c.update(inlined(_CALL_RE.search(line).group(1)))
            else:
                c[m.group(1)] += 1
        memo[name] = c
        return c

    main = "main" if "main" in funcs else next(iter(funcs), None)
    return {
        "textual": textual,
        "inlined": inlined(main) if main else collections.Counter(),
        "calls": textual.get("call", 0),
        "private_funcs": sum(1 for line in text.splitlines() if line.lstrip().startswith("func.func private")),
    }


def stablehlo_total(c: collections.Counter) -> int:
    return sum(v for k, v in c.items() if k.startswith("stablehlo."))


# An HLO instruction line of `Compiled.as_text()`: `  %name = f32[...] op(...)`.
_HLO_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = ")


# Entry instructions that launch no kernel: they name buffers or pieces of tuples.
_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


def hlo_opcode(line: str) -> str:
    """The opcode of one HLO instruction line (`%x = f32[2]{0} fusion(...)` -> `fusion`)."""
    rhs = line.split(" = ", 1)[1].lstrip()
    if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                rhs = rhs[i + 1 :]
                break
    else:
        rhs = rhs.split(" ", 1)[1] if " " in rhs else rhs
    return rhs.lstrip().split("(", 1)[0].strip()


def count_hlo(compiled_text: str) -> dict[str, int]:
    """Instructions of the optimized (post-fusion) HLO module.

    `total`: in all computations (fusion bodies included); `entry`: in the ENTRY
    computation only (the kernels/thunks that run, plus parameters and tuples);
    `kernels`: entry instructions less those that launch nothing (`parameter`,
    `constant`, `tuple`, `get-tuple-element`, `bitcast`).
    """
    total = entry = kernels = 0
    in_entry = False
    for line in compiled_text.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            in_entry = False
        if _HLO_INSTR_RE.match(line):
            total += 1
            entry += in_entry
            kernels += in_entry and hlo_opcode(line) not in _NOT_KERNELS
    return {"total": total, "entry": entry, "kernels": kernels}


def lower_python_calls(step, *args) -> int:
    """Python function calls (C functions included) while `step.lower(*args)` traces and
    lowers from scratch, counted by `cProfile`. Unlike a timing it is the same in every run,
    so it shows what a change to the tracing code saves."""
    jax.clear_caches()
    profile = cProfile.Profile()
    profile.enable()
    try:
        step.lower(*args)
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls
