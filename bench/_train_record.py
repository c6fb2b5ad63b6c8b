"""What a part of bench/gpu_train.py records, in its own process: the JSON lines the parent
reads, the jax.monitoring events, the machine and the FP8 check of a compiled program."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any

import jax

import _harness
from _train_parts import EV_CACHE_HIT, EV_CACHE_MISS, EV_CACHE_REQUEST


class Recorder:
    """Appends one JSON object per call to the part's lines file (the parent merges them)."""

    def __init__(self, path: str, t_start: float):
        self.path = path
        self.t_start = t_start  # the part's start (before its imports), for the log's times

    def __call__(self, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(_harness.jsonable(fields)) + "\n")
        print(f"[{time.perf_counter() - self.t_start:7.1f}s] " + ", ".join(sorted(fields)), file=sys.stderr, flush=True)


def error_info(e: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    lines = "".join(tb).rstrip().splitlines()
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback_tail": lines[-12:]}


class Events:
    """Counts ``jax.monitoring`` events (name -> count) and sums durations (name -> s)."""

    def __init__(self):
        self.log: list[tuple[str, float]] = []  # (name, duration or 0.0)
        self.installed = []
        mon = getattr(jax, "monitoring", None)
        for register, fn in (
            ("register_event_listener", lambda name, **kw: self.log.append((name, 0.0))),
            ("register_event_duration_secs_listener", lambda name, dur, **kw: self.log.append((name, float(dur)))),
        ):
            try:
                getattr(mon, register)(fn)
                self.installed.append(register)
            except Exception:  # an API that moved: the counts read zero, the part goes on
                pass

    def mark(self) -> int:
        return len(self.log)

    def since(self, mark: int) -> dict[str, Any]:
        counts: dict[str, int] = {}
        seconds: dict[str, float] = {}
        for name, dur in self.log[mark:]:
            counts[name] = counts.get(name, 0) + 1
            if dur:
                seconds[name] = seconds.get(name, 0.0) + dur
        return {"counts": counts, "seconds": seconds}

    @staticmethod
    def count(window: dict[str, Any], needle: str) -> int:
        return sum(n for name, n in window["counts"].items() if needle in name)

    @staticmethod
    def seconds(window: dict[str, Any], needle: str) -> float:
        return sum(s for name, s in window["seconds"].items() if needle in name)


def cache_counts(window: dict[str, Any]) -> dict[str, Any]:
    """The persistent cache's answers in a window: `requests` (compiles that asked the
    cache), `hits`, `misses` (requests not served by it: compiled), `written` (JAX's
    "cache_misses" event, which it records when it writes an entry; it writes none for a
    program with host callbacks, so `written` can be below `misses`)."""
    requests, hits = Events.count(window, EV_CACHE_REQUEST), Events.count(window, EV_CACHE_HIT)
    return {
        "requests": requests,
        "hits": hits,
        "misses": requests - hits if requests else None,  # None: no request seen (no cache, or renamed events)
        "written": Events.count(window, EV_CACHE_MISS),
        "compile_time_saved_s": Events.seconds(window, "compile_time_saved"),
    }


def child_machine() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "devices": [repr(d) for d in devices],
        "versions": _harness.gpu_versions(),
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def _compiled_text(compiled) -> str:
    return getattr(compiled, "compiled", compiled).as_text()  # eqx's Compiled wraps JAX's


def fp8_check(text: str, expected: int, variant: str, backend: str, flops: float | None = None) -> dict[str, Any]:
    """The FP8 GEMMs of a compiled program (bench/gpu_hlo.py) against those it should have.

    PASS when `expected` GEMMs are FP8, or when the FP8 GEMMs do exactly the FLOPs of the
    GEMMs that should be FP8 (`flops`): XLA may merge GEMMs that share an operand."""
    import gpu_hlo  # (imports fp8ax: in the part only)

    s = gpu_hlo.summary(text)
    out = {
        "expected": expected,
        "found": s["fp8_gemms"],
        "gemms": s["gemms"],
        "gemm_paths": s["gemm_paths"],
        "gemm_flops": s["gemm_flops"],
        "fp8_gemm_flops": s["fp8_gemm_flops"],
        "expected_fp8_flops": flops,
        "conditionals": s["conditionals"],
        "waiting_casts": len(s["waiting_casts"]),
        "kernels": s["kernels"],
    }
    if variant == "bf16":
        out["status"] = "baseline"
    elif backend != "gpu":
        out["status"] = f"n/a on {backend}"
    elif variant == "fp8ax_mx":
        # MXFP8 runs as a block-scaled GEMM (jax.nn.scaled_matmul) on compute capability
        # >= 10.0 only; elsewhere fp8ax dequantizes the blocks and multiplies in bf16.
        out["status"] = "info (MX: block-scaled GEMMs need compute capability >= 10.0)"
    else:
        by_flops = flops is not None and flops > 0 and abs(s["fp8_gemm_flops"] / flops - 1) < 1e-6
        out["status"] = "PASS" if s["fp8_gemms"] == expected or by_flops else "FAIL"
    return out


def _time_left(args) -> float:
    return args.deadline - time.time() if args.deadline else math.inf
