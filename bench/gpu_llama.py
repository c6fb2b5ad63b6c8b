"""FP8 training of a Llama-3-8B-shaped decoder stack on one GPU, as Levanter builds it.

The model: ``--layers`` decoder layers (default 4) of Llama-3-8B's sizes (hidden 4096, 32
heads of 128, SwiGLU MLP 14336), written with Haliax: RMSNorm, q/k/v/o projections,
causal attention through ``jax.nn.dot_product_attention`` (cuDNN's fused kernel on a GPU,
XLA's elsewhere), RMSNorm, gate/up/down projections, residuals; bias-free
``haliax.nn.Linear`` throughout; no embedding, rotary embedding or head (they hold no
GEMM FP8 changes). Batch 8 x 2048 = 16384 tokens per step, bf16 parameters, MSE against a
fixed target, Adam. Three layouts: ``scan_remat`` (``hax.nn.Stacked`` with
``gradient_checkpointing=True``: Levanter's default), ``scan`` (Stacked, no remat) and
``unrolled`` (a tuple of layers).

Variants (the step as README.md writes it, ``eqx.filter_jit``):
- ``bf16``: the plain model, XLA's default options;
- ``bf16_notriton``: the same step compiled with ``fp8ax.compiler_options()``;
- ``fp8ax``: ``fp8ax.fp8_linear_layers`` (the default recipe, delayed scaling), the
  documented optimizer ``fp8ax.skip_fp8_state(optax.adam(...))``, compiled with
  ``fp8ax.compiler_options()``;
- ``fp8ax_current``: the same with ``Fp8Config(recipe=fp8ax.CurrentScaling())``;
- ``fp8ax_nocal``: the same with ``DelayedScaling(calibrate_first_call=False)`` (what
  the first call's calibration costs a settled step);
- ``haliax_fp8``: ``haliax.quantization`` (its optimizer built on the model without its
  FP8 state), compiled with ``fp8ax.compiler_options()`` too.

Each ``stack:<variant>:<layout>`` part measures the first call (trace, XLA compile with
its autotuning, one step: what a user waits for in a fresh process), pipelined throughput
(``--steps`` steps dispatched back to back, one block at the end: tokens/s, and MFU
against a dense bf16 peak of 989 TFLOP/s with the model FLOPs of a step, recomputation
not counted), the blocked step latency (median and quartiles), the loss after the steps
and the FP8 GEMM check of the compiled step (``fp8ax.gemm_report``). The ``gemm`` part
times one 8192^3 GEMM's forward and backward passes (3 GEMMs, ``jax.vjp``) in bf16 with
and without the options and through ``fp8ax.Fp8DotGeneral`` with them; ``gemm_triton``
times the FP8 one compiled with XLA's default options (Triton candidates autotuned).
``profile:<variant>`` (the ``scan_remat`` stack) and ``profile:gemm`` (the GEMM cases)
read the GPU kernels of a ``jax.profiler`` trace taken with
``--xla_enable_command_buffers_during_profiling=true``: launches, GPU busy time, GEMMs
against the rest, the top kernels (the traced wall time includes the tracer's own cost).

Every part runs in a fresh process (this script with ``--part``) under its own time
limit, writing a JSON line per result as it goes, so a part cut short still reports. The
parent skips a part whose limit no longer fits ``--budget-s``. Without a GPU, or with
``--dry``, every size shrinks (2 layers of hidden 128, 2 x 64 tokens, GEMM 256^3, 2 steps):
a smoke test whose timings mean nothing.

Run::

    python bench/gpu_llama.py                 # on a GPU: bench/results/gpu_llama_<device>.json and .md
    python bench/gpu_llama.py --dry           # tiny sizes, one process per part
    python bench/gpu_llama.py --dry --in-process --parts stack:fp8ax:scan_remat,gemm
    python bench/gpu_llama.py --parts profile:gemm,gemm_triton --limit gemm_triton=200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
FULL = {"layers": 4, "hidden": 4096, "heads": 32, "head_size": 128, "mlp": 14336, "batch": 8, "seq": 2048, "gemm": 8192}
DRY = {"layers": 2, "hidden": 128, "heads": 4, "head_size": 32, "mlp": 448, "batch": 2, "seq": 64, "gemm": 256}
PEAK_BF16 = 989e12  # H100 / H200 SXM, dense bf16 (the vendors' datasheets)
VARIANTS = ("bf16", "bf16_notriton", "fp8ax", "fp8ax_current", "fp8ax_nocal", "haliax_fp8")
LAYOUTS = ("scan_remat", "scan", "unrolled")
# In priority order: what the targets need first.
DEFAULT_PARTS = (
    "gemm",
    *(f"stack:{v}:scan_remat" for v in ("bf16", "fp8ax", "fp8ax_current", "haliax_fp8")),
    *(f"stack:{v}:scan" for v in ("bf16", "fp8ax")),
    *(f"stack:{v}:unrolled" for v in ("bf16", "fp8ax")),
    "profile:fp8ax",
    "gemm_triton",
    "profile:fp8ax_current",
    "stack:bf16_notriton:scan_remat",
    "stack:fp8ax_current:scan",
    "stack:haliax_fp8:scan",
)
LIMITS = {"gemm": 60, "gemm_triton": 75, "stack": 45, "stack-unrolled": 60, "profile": 45}
PROFILE_FLAG = "--xla_enable_command_buffers_during_profiling=true"


OVERRIDES: dict[str, int] = {}


def limit(part: str) -> int:
    if part in OVERRIDES:
        return OVERRIDES[part]
    if part.startswith("profile:"):
        return LIMITS["profile"]
    if part.startswith("stack:"):
        return LIMITS["stack-unrolled" if part.endswith(":unrolled") else "stack"]
    return LIMITS[part]


# --------------------------------------------------------------------------------------
# Child side: what one part measures. JAX is imported here only.


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


def _quartiles(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else times * 3
    return {"median_s": statistics.median(times), "p25_s": q[0], "p75_s": q[2], "min_s": min(times)}


def _attention(q, k, v, impl):
    import jax

    # (batch, position, heads, head_size) arrays; causal; cuDNN's fused kernel on a GPU.
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def build_model(s: dict[str, int], layout: str, key, impl):
    import equinox as eqx
    import haliax as hax
    import jax

    Embed, Mlp = hax.Axis("embed", s["hidden"]), hax.Axis("mlp", s["mlp"])
    Heads, HeadSize = hax.Axis("heads", s["heads"]), hax.Axis("head_size", s["head_size"])
    order = ("batch", "position", "heads", "head_size")

    class Layer(eqx.Module):
        norm1: hax.nn.RmsNorm
        q: hax.nn.Linear
        k: hax.nn.Linear
        v: hax.nn.Linear
        o: hax.nn.Linear
        norm2: hax.nn.RmsNorm
        gate: hax.nn.Linear
        up: hax.nn.Linear
        down: hax.nn.Linear

        @staticmethod
        def init(key):
            ks = jax.random.split(key, 7)
            lin = lambda i, o, k: hax.nn.Linear.init(i, o, key=k, use_bias=False)  # noqa: E731
            return Layer(
                hax.nn.RmsNorm.init(Embed, use_bias=False),
                lin(Embed, (Heads, HeadSize), ks[0]),
                lin(Embed, (Heads, HeadSize), ks[1]),
                lin(Embed, (Heads, HeadSize), ks[2]),
                lin((Heads, HeadSize), Embed, ks[3]),
                hax.nn.RmsNorm.init(Embed, use_bias=False),
                lin(Embed, Mlp, ks[4]),
                lin(Embed, Mlp, ks[5]),
                lin(Mlp, Embed, ks[6]),
            )

        def __call__(self, x):
            h = self.norm1(x)
            q, k, v = (p(h).rearrange(order).array for p in (self.q, self.k, self.v))
            att = hax.named(_attention(q, k, v, impl), order)
            x = x + self.o(att)
            h = self.norm2(x)
            return x + self.down(hax.nn.silu(self.gate(h)) * self.up(h))

    Layers = hax.Axis("layers", s["layers"])
    if layout == "unrolled":
        return tuple(Layer.init(k) for k in jax.random.split(key, s["layers"]))
    stacked = hax.nn.Stacked.init(Layers, Layer, gradient_checkpointing=layout == "scan_remat")
    return stacked(key=jax.random.split(key, s["layers"]))


def forward(model, x):
    if isinstance(model, tuple):
        for layer in model:
            x = layer(x)
        return x
    return model.fold(x)


def make_step(variant: str, model, opt):
    """`(model, opt_state, step)`: the README's training step for `variant`, jitted as a
    user would (FP8 variants and `bf16_notriton` with `fp8ax.compiler_options()`)."""
    import equinox as eqx
    import haliax as hax
    import haliax.quantization as haxq
    import jax.numpy as jnp

    import fp8ax

    def loss_fn(model, x, y):
        return hax.mean(hax.square((forward(model, x) - y).astype(jnp.float32))).scalar()

    options = {} if variant == "bf16" else {"compiler_options": fp8ax.compiler_options()}
    if variant in ("bf16", "bf16_notriton"):

        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return eqx.apply_updates(model, updates), opt_state, loss

        return model, opt.init(eqx.filter(model, eqx.is_array)), eqx.filter_jit(step, **options)
    if variant == "haliax_fp8":
        model = haxq.quantize_linear_layers(model, haxq.QuantizationConfig(fp8=True))
        trained = lambda m: eqx.filter(haxq.partition_for_grad_overwrite(m)[1], eqx.is_array)  # noqa: E731

        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            overwrite, grads = haxq.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=trained(model))
            return haxq.apply_updates(model, updates, overwrite), opt_state, loss

        return model, opt.init(trained(model)), eqx.filter_jit(step, **options)
    recipe = {
        "fp8ax": fp8ax.DelayedScaling(),
        "fp8ax_current": fp8ax.CurrentScaling(),
        "fp8ax_nocal": fp8ax.DelayedScaling(calibrate_first_call=False),
    }[variant]
    model = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(recipe=recipe))
    opt = fp8ax.skip_fp8_state(opt)

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    return model, opt.init(eqx.filter(model, eqx.is_array)), eqx.filter_jit(step, **options)


def step_flops(s: dict[str, int]) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation): the
    linear layers' 6 * parameters * tokens, and causal attention's 6 * batch * seq^2 *
    heads * head_size per layer (the useful half of QK^T and PV, forward and backward)."""
    d, a, m = s["hidden"], s["heads"] * s["head_size"], s["mlp"]
    tokens = s["batch"] * s["seq"]
    linear = 6 * tokens * (4 * d * a + 3 * d * m)
    attention = 6 * s["batch"] * s["seq"] ** 2 * a
    return s["layers"] * (linear + attention)


def setup(variant: str, layout: str, s: dict[str, int], gpu: bool):
    """`(model, opt_state, step, x, y)` for `variant` in `layout`, built and on the device
    (the model, input and target made by one jitted function: one compile, not one per op)."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import optax

    import fp8ax

    impl = "cudnn" if gpu else None

    @eqx.filter_jit
    def make(key):
        k_model, k_x, k_y = jax.random.split(key, 3)
        model = fp8ax.cast_floating(build_model(s, layout, k_model, impl), jnp.bfloat16)
        shape = (s["batch"], s["seq"], s["hidden"])
        return model, jax.random.normal(k_x, shape, jnp.bfloat16), jax.random.normal(k_y, shape, jnp.bfloat16)

    model, x, y = make(jax.random.key(0, impl="rbg"))
    axes = (hax.Axis("batch", s["batch"]), hax.Axis("position", s["seq"]), hax.Axis("embed", s["hidden"]))
    x, y = hax.named(x, axes), hax.named(y, axes)
    model, opt_state, step = make_step(variant, model, optax.adam(1e-4))
    jax.block_until_ready(eqx.filter((model, opt_state, x, y), eqx.is_array))
    return model, opt_state, step, x, y


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
    rec(blocked=_quartiles(times), compiles_after_first=durations.total.get("compile", 0.0) > 0)
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


def child(part: str, out: Path, dry: bool, steps: int) -> None:
    import jax

    gpu = jax.default_backend() == "gpu" and not dry
    s = FULL if gpu else DRY
    rec = Recorder(out, part)
    rec(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__)
    if part.startswith("stack:"):
        _, variant, layout = part.split(":")
        run_stack(rec, variant, layout, s, steps if gpu else 2, gpu)
    elif part == "profile:gemm":
        run_gemm(rec, s["gemm"], gpu, triton=False, profile=True)
    elif part.startswith("profile:"):
        run_profile(rec, part.split(":")[1], s, gpu)
    else:
        run_gemm(rec, s["gemm"], gpu, triton=part == "gemm_triton")


# --------------------------------------------------------------------------------------
# Parent side: no JAX here, so that the GPU is free for the parts.


def check_part(part: str) -> None:
    fields = part.split(":")
    ok = (
        part in ("gemm", "gemm_triton")
        or (len(fields) == 3 and fields[0] == "stack" and fields[1] in VARIANTS and fields[2] in LAYOUTS)
        or (len(fields) == 2 and fields[0] == "profile" and fields[1] in (*VARIANTS, "gemm"))
    )
    if not ok:
        raise SystemExit(
            f"--parts: unknown part {part!r}; expected gemm, gemm_triton, stack:<variant>:<layout> or "
            f"profile:<variant>, with variant in {VARIANTS} and layout in {LAYOUTS}"
        )


def gather(path: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return results
    for line in path.read_text().splitlines():
        row = json.loads(line)
        part = row.pop("part")
        entry = results.setdefault(part, {})
        if "case" in row:
            entry.setdefault("cases", []).append(row)
        else:
            entry.update(row)
    return results


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| part | first call s | compile s | tokens/s | MFU | x bf16 | step ms (p25-p75) | loss | FP8 GEMMs |"]
    rows.append("|---|---:|---:|---:|---:|---:|---|---:|---|")
    for part, r in results.items():
        if not part.startswith("stack:"):
            continue
        base = results.get(f"stack:bf16:{part.split(':')[2]}", {}).get("tokens_per_s")
        tps = r.get("tokens_per_s")
        b = r.get("blocked", {})
        check = r.get("gemm_check", {})
        rows.append(
            f"| {part} | {r.get('first_call_s', float('nan')):.1f} | "
            f"{r.get('first_call_parts_s', {}).get('compile', float('nan')):.1f} | "
            f"{tps or float('nan'):.0f} | {r.get('mfu_bf16_peak', float('nan')):.3f} | "
            f"{(tps / base) if tps and base else float('nan'):.2f} | "
            f"{1e3 * b.get('median_s', float('nan')):.1f} ({1e3 * b.get('p25_s', float('nan')):.1f}-"
            f"{1e3 * b.get('p75_s', float('nan')):.1f}) | {r.get('loss_after', float('nan')):.4f} | "
            f"{check.get('compiled_fp8', '-')}/{check.get('compiled_total', '-')} |"
            + (f" {r['status']}" if r.get("status") else "")
        )
    rows += ["", "| GEMM fwd+bwd | first call s | ms | TFLOP/s | x bf16 | FP8 GEMMs |", "|---|---:|---:|---:|---:|---|"]
    cases = [
        c
        for p in ("gemm", "profile:gemm", "gemm_triton")
        for c in results.get(p, {}).get("cases", [])
        if "fwd_bwd_s" in c
    ]
    base = next((c["fwd_bwd_s"] for c in cases if c["case"] == "bf16"), None)
    for c in cases:
        check = c["gemm_check"]
        rows.append(
            f"| {c['case']} {c['n']}^3 | {c['first_call_s']:.1f} | {1e3 * c['fwd_bwd_s']:.2f} | {c['tflops']:.0f} | "
            f"{(base / c['fwd_bwd_s']) if base else float('nan'):.2f} | {check['compiled_fp8']}/{check['compiled_total']} |"
        )
    profiles = {p: r for p, r in results.items() if p.startswith("profile:") and p != "profile:gemm"}
    profiles |= {
        f"gemm {c['case']}": {"profile": c["kernels"]}
        for c in results.get("profile:gemm", {}).get("cases", [])
        if "kernels" in c
    }
    if profiles:
        rows += ["", "| profile (command buffers on) | step ms | GPU busy ms | launches | GEMM ms | status |"]
        rows.append("|---|---:|---:|---:|---:|---|")
        for p, r in profiles.items():
            f = r.get("profile", {})
            rows.append(
                f"| {p} | {f.get('traced_step_ms', float('nan')):.2f} | {f.get('busy_us_per_step', float('nan')) / 1e3:.2f} | "
                f"{f.get('launches_per_step', float('nan')):.0f} | {f.get('gemm_us_per_step', float('nan')) / 1e3:.2f} | "
                f"{r.get('status', '')[:80]} |"
            )
    for p in ("gemm", "gemm_triton"):
        if results.get(p, {}).get("status"):
            rows.append(f"| {p} | {results[p]['status']} | | | | |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    ap.add_argument("--steps", type=int, default=20, help="pipelined steps (the blocked ones: half as many)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="skip parts whose limit no longer fits")
    ap.add_argument("--dry", action="store_true", help="tiny sizes, on any backend")
    ap.add_argument("--limit", action="append", default=[], help="PART=SECONDS: another time limit for a part")
    ap.add_argument("--in-process", action="store_true", help="run the parts here, without limits (tests)")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default bench/results/gpu_llama_<...>.json)")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--lines", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        child(args.part, args.lines, args.dry, args.steps)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        check_part(p)
    for item in args.limit:
        part, _, seconds = item.partition("=")
        if not seconds.isdigit() or int(seconds) == 0:
            raise SystemExit(f"--limit: expected PART=SECONDS with a whole number of seconds > 0, got {item!r}")
        check_part(part)
        OVERRIDES[part] = int(seconds)
    lines = Path(tempfile.mkstemp(suffix=".jsonl")[1])
    deadline = time.time() + args.budget_s
    status: dict[str, str] = {}
    for part in parts:
        if args.in_process:
            child(part, lines, args.dry, args.steps)
            continue
        if time.time() + limit(part) > deadline:
            status[part] = f"skipped: {limit(part)} s limit past the {args.budget_s:.0f} s budget"
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--lines", str(lines)]
        cmd += ["--steps", str(args.steps)] + (["--dry"] if args.dry else [])
        t0 = time.time()
        env = dict(os.environ)
        if part.startswith("profile:"):  # profile the program as it runs untraced: with command buffers
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + PROFILE_FLAG).strip()
        try:
            done = subprocess.run(cmd, timeout=limit(part), capture_output=True, text=True, env=env)
            if done.returncode:
                status[part] = f"failed (exit {done.returncode}): " + done.stderr.strip()[-1500:]
        except subprocess.TimeoutExpired:
            status[part] = f"timed out after {limit(part)} s"
        print(f"{part}: {time.time() - t0:.1f} s {status.get(part, 'ok')[:300]}", flush=True)
    results = gather(lines)
    for part, st in status.items():
        results.setdefault(part, {})["status"] = st
    device = next((r["device"] for r in results.values() if "device" in r), "unknown")
    tag = "dry" if args.dry else device.lower().replace(" ", "_")
    out = args.out or HERE / "results" / f"gpu_llama_{tag}.json"
    meta = {"machine": platform.node(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    out.write_text(json.dumps({"meta": meta, "parts": results}, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
