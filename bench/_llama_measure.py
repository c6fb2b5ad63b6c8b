"""What one part of bench/gpu_llama.py measures, in its own process: the stack's steps, a
kernel profile, the GEMM table."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from _llama_model import setup, step_flops

PEAK_BF16 = 989e12  # H100 / H200 SXM, dense bf16 (the vendors' datasheets)


class Recorder:
    """Appends one JSON line per call to `path`: {"part": ..., key: value, ...}."""

    def __init__(self, path: Path, part: str):
        self.path, self.part = path, part

    def __call__(self, **values: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"part": self.part, **values}, default=str) + "\n")


class Durations:
    """Sums `jax.monitoring` durations (trace, lowering, XLA compile) since `reset`."""

    KEYS = {"trace": "jaxpr_trace", "lower": "jaxpr_to_mlir_module", "compile": "backend_compile"}

    def __init__(self):
        import jax

        self.total: dict[str, float] = {}
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_: Any) -> None:
        for key, needle in self.KEYS.items():
            if needle in event:
                self.total[key] = self.total.get(key, 0.0) + duration

    def reset(self) -> None:
        self.total = {}


def run_stack(rec: Recorder, variant: str, layout: str, s: dict[str, int], steps: int, gpu: bool) -> None:
    import equinox as eqx
    import jax

    import fp8ax

    block = lambda t: jax.block_until_ready(eqx.filter(t, eqx.is_array))  # noqa: E731
    durations = Durations()
    rec(
        config={
            **s,
            "variant": variant,
            "layout": layout,
            "attention": "cudnn" if gpu else "xla",
            "step_flops": step_flops(s),
        }
    )
    t0 = time.perf_counter()
    model, opt_state, step, x, y = setup(variant, layout, s, gpu)
    rec(build_s=time.perf_counter() - t0)

    durations.reset()
    t0 = time.perf_counter()
    model, opt_state, loss = step(model, opt_state, x, y)
    block((model, opt_state, loss))
    rec(first_call_s=time.perf_counter() - t0, first_call_parts_s=dict(durations.total), first_loss=float(loss))
    durations.reset()  # from here on, a compile would be a second program

    for _ in range(2):  # warm-up
        model, opt_state, loss = step(model, opt_state, x, y)
    block((model, opt_state, loss))
    t0 = time.perf_counter()
    for _ in range(steps):  # pipelined: one block at the end, as a training loop runs
        model, opt_state, loss = step(model, opt_state, x, y)
    block((model, opt_state, loss))
    per_step = (time.perf_counter() - t0) / steps
    tokens = s["batch"] * s["seq"]
    rec(
        pipelined_step_s=per_step,
        tokens_per_s=tokens / per_step,
        mfu_bf16_peak=step_flops(s) / per_step / PEAK_BF16,
        loss_after=float(loss),
        steps_after_first=steps + 2,
    )
    times = []
    for _ in range(max(steps // 2, 2)):
        t = time.perf_counter()
        model, opt_state, loss = step(model, opt_state, x, y)
        block((model, opt_state, loss))
        times.append(time.perf_counter() - t)
    rec(
        blocked={k: v for k, v in _harness.stats(times).items() if k != "all_s"},
        compiles_after_first=durations.total.get("compile", 0.0) > 0,
    )
    report = fp8ax.gemm_report(step, model, opt_state, x, y)
    rec(gemm_check={"compiled_fp8": report.compiled_fp8, "compiled_total": report.compiled_total})


GEMM_KERNEL = ("gemm", "cublas", "xmma", "cutlass", "sm90", "matmul", "triton_gemm")


def run_profile(rec: Recorder, variant: str, s: dict[str, int], gpu: bool, steps: int = 3) -> None:
    """The GPU kernels of `steps` settled steps of the `scan_remat` stack, from a
    `jax.profiler` trace taken with command buffers kept on (the parent sets
    `--xla_enable_command_buffers_during_profiling=true`): launches, busy time, GEMM
    against the rest, and the wall time the steps took (the gap is the GPU's idle time)."""
    import equinox as eqx
    import jax

    model, opt_state, step, x, y = setup(variant, "scan_remat", s, gpu)
    block = lambda t: jax.block_until_ready(eqx.filter(t, eqx.is_array))  # noqa: E731
    for _ in range(3):
        model, opt_state, loss = step(model, opt_state, x, y)
    block((model, opt_state, loss))

    def run():
        nonlocal model, opt_state, loss
        for _ in range(steps):
            model, opt_state, loss = step(model, opt_state, x, y)
        block((model, opt_state, loss))

    rec(profile=kernel_profile(run, steps))


def kernel_profile(run, steps: int) -> dict[str, Any]:
    """The GPU kernels of `run()` (which runs `steps` steps and blocks), from a
    `jax.profiler` trace: launches, busy time, GEMM against the rest, the wall time."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        with jax.profiler.trace(d):
            run()
        wall = (time.perf_counter() - t0) / steps
        paths = sorted(Path(d).rglob("*.xplane.pb"))
        data = jax.profiler.ProfileData.from_file(str(paths[0]))
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    stats: dict[str, list[float]] = {}
    for plane in planes:
        for line in plane.lines:
            if line.name.startswith("XLA"):  # summary lines ("XLA Ops", "XLA Modules"), not streams
                continue
            for ev in line.events:
                row = stats.setdefault(ev.name, [0, 0.0])
                row[0] += 1
                row[1] += ev.duration_ns
    per = {n: (c / steps, t / steps / 1e3) for n, (c, t) in stats.items()}
    gemm = {n for n in per if any(k in n.lower() for k in GEMM_KERNEL)}
    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "traced_step_ms": wall * 1e3,
        "launches_per_step": sum(c for c, _ in per.values()),
        "busy_us_per_step": sum(t for _, t in per.values()),
        "gemm_us_per_step": sum(per[n][1] for n in gemm),
        "gemm_launches_per_step": sum(per[n][0] for n in gemm),
        "top": sorted(([n[:100], c, round(t, 1)] for n, (c, t) in per.items()), key=lambda r: -r[2])[:20],
    }


def run_gemm(rec: Recorder, n: int, gpu: bool, triton: bool, profile: bool = False) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import fp8ax

    dims = (((1,), (0,)), ((), ()))
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x, w, c = (jax.random.normal(k, (n, n), jnp.bfloat16) for k in (kx, kw, kc))
    bf16 = lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.bfloat16)  # noqa: E731
    dg = fp8ax.Fp8DotGeneral.init()

    @eqx.filter_jit
    def settle(dg, x, w):  # one untimed training call fills the state, as in a settled step
        grads = eqx.filter_grad(lambda d: jnp.sum(d(x, w, dims).astype(jnp.float32)))(dg)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        return fp8ax.apply_updates(dg, grads, overwrite)

    dg = settle(dg, x, w)
    # Every array is an argument (no constant in the program). The FP8 layer is an input
    # of the VJP too: its cotangent is the new state, as in training.
    fp8 = lambda dg, x, w: dg(x, w, dims)  # noqa: E731
    flops = 3 * 2 * n**3
    cases = (
        [("fp8ax_triton", fp8, {})]
        if triton
        else [
            ("bf16", bf16, {}),
            ("bf16_notriton", bf16, {"compiler_options": fp8ax.compiler_options()}),
            ("fp8ax", fp8, {"compiler_options": fp8ax.compiler_options()}),
        ]
    )
    for name, f, options in cases:
        args = (dg, x, w, c) if f is fp8 else (x, w, c)
        fwd_bwd = eqx.filter_jit(lambda *a, f=f: (lambda y, vjp: (y, *vjp(a[-1])))(*jax.vjp(f, *a[:-1])), **options)
        t0 = time.perf_counter()
        jax.block_until_ready(fwd_bwd(*args))
        first = time.perf_counter() - t0
        reps = 20 if gpu else 2
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                out = fwd_bwd(*args)
            jax.block_until_ready(out)
            runs.append((time.perf_counter() - t) / reps)
        report = fp8ax.gemm_report(fwd_bwd, *args)
        best = min(runs)
        rec(
            case=name,
            n=n,
            first_call_s=first,
            fwd_bwd_s=best,
            tflops=flops / best / 1e12,
            gemm_check={"compiled_fp8": report.compiled_fp8, "compiled_total": report.compiled_total},
        )
        if profile:

            def run(fwd_bwd=fwd_bwd, args=args):
                for _ in range(reps):
                    out = fwd_bwd(*args)
                jax.block_until_ready(out)

            rec(case=f"{name}_kernels", kernels=kernel_profile(run, reps))
