"""What FP8 training costs and gains on a GPU: time to the first step, the step, single GEMMs, a grouped GEMM.

One command for one lent GPU (H100, H200...), sized to fit a 6-minute device call. It runs
a list of **parts**, each in a fresh Python process of its own (this script again, with
``--part NAME``) under its own wall-clock limit, one after the other, and gathers what they
measured into one JSON file and Markdown tables:

- ``decoder:<variant>``: one training step of one Llama-shaped decoder layer written with
  Haliax (RMSNorm, causal self-attention with 32 heads of 128, RMSNorm, SwiGLU MLP 4096 ->
  14336 -> 4096, residuals; the 7 projections are bias-free ``haliax.nn.Linear``), batch
  4 x 2048 tokens, bf16 parameters (``fp8ax.cast_floating``), MSE against a fixed random
  target, ``optax.adam(1e-4)``, the step as a user writes it (``eqx.filter_jit`` of
  ``filter_grad``, ``fp8ax.partition_for_grad_overwrite``, ``opt.update``,
  ``fp8ax.apply_updates``). Variants: ``bf16`` (plain Equinox step), ``haliax_fp8``
  (``haliax.quantization``), ``fp8ax`` (``Fp8Config()``), ``fp8ax_current``
  (``CurrentScaling``), ``fp8ax_mx`` (``MXScaling``), ``fp8ax_nofirst``
  (``DelayedScaling(calibrate_first_call=False)``). Measured, in this order: the first
  call (what a user waits for, in a fresh process, model already built), the first two
  steps, how often the step was traced and compiled over its first 3 steps, ``--steps``
  timed steps (median, quartiles, min), the linear layers' TFLOP/s, the FP8 GEMM check of
  the compiled step (bench/gpu_hlo.py; 21 GEMMs), the loss; with ``--split-compile``, also
  ``step.lower`` and ``.compile()`` timed apart after ``jax.clear_caches()`` (a recompile).
- ``decoder-warm:fp8ax``: ``decoder:fp8ax`` again in a new process with JAX's persistent
  compilation cache that ``decoder:fp8ax`` filled in this run: the first step after a
  restart, and the cache misses of the step (zero when it was served from the cache).
  (``decoder-warm:<variant>`` works for every decoder variant.)
- ``gemm:<shape>:<pass>``: ``y = x @ w.T`` through a one-layer module (bench/gpu.py's
  ``GemmLayer``), ``square_8192`` (8192^3) and ``llama_up`` (8192 x 4096 -> 14336),
  forward (``fwd``: 1 GEMM) or forward and backward (``fwd_bwd``: 3 GEMMs), bf16 vs
  ``fp8ax`` (direct mode, default recipe, its state filled by one untimed call) vs
  ``haliax_fp8``, timed interleaved in one process; with the FP8 check of each.
- ``moe``: a grouped GEMM forward and backward, ``fp8ax.Fp8RaggedDot`` vs
  ``jax.lax.ragged_dot`` in bf16 (8 experts, 8192 tokens with uneven groups, 4096 ->
  14336), and what XLA built for it (the GEMMs' output shapes and FLOPs against the useful
  FLOPs: a dense GEMM over every (token, expert) pair does 8x).

Every part appends JSON lines to a file as it goes, so one cut short by its time limit
still reports what it measured (``"timed_out": true``). The parent never initializes a
JAX backend (the GPU stays free for the parts), skips the parts that cannot start with
their minimum time left in ``--budget-s`` (``"skipped": "budget"``), and exits 0 even when
a part fails (1 only with ``--strict`` when an FP8 check fails on a GPU).

Without a GPU (``jax.default_backend() != "gpu"`` in the parts), or with ``--dry``, every
size is divided (hidden 128, 4 heads of 32, MLP 448, 2 x 64 tokens, GEMMs and MoE / 64),
with 2 timed steps and 2 GEMM reps: a smoke test of the script whose timings mean nothing;
the FP8 check reads "n/a on cpu".

Run::

    python bench/gpu_train.py                      # on a GPU; bench/results/gpu_train_<device>.json
    python bench/gpu_train.py --dry                # tiny sizes; bench/results/gpu_train_dry_<backend>.json
    python bench/gpu_train.py --parts decoder:bf16,decoder:fp8ax,gemm:square_8192:fwd_bwd
    python bench/gpu_train.py --xla-flags-variant notriton=--xla_gpu_enable_triton_gemm=false \\
        --parts decoder:fp8ax,decoder:fp8ax@notriton --autotune-log-dir /tmp/autotune
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

T_IMPORT = time.perf_counter()  # before the JAX imports: a part's import time starts here

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import haliax.nn as hnn  # noqa: E402
import jax  # noqa: E402  (imported, never initialized in the parent: no backend, no GPU memory)
import jax.numpy as jnp  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = Path(__file__).resolve()
RESULTS = HERE / "results"

# --------------------------------------------------------------------------------------
# What runs

DECODER_VARIANTS = ("bf16", "haliax_fp8", "fp8ax", "fp8ax_skip", "fp8ax_current", "fp8ax_mx", "fp8ax_nofirst")
FP8AX_RECIPES = {  # variant -> how its Fp8Config is built (for the JSON)
    "fp8ax": "fp8ax.Fp8Config()",
    "fp8ax_skip": "fp8ax.Fp8Config(), optimizer fp8ax.skip_fp8_state(optax.adam(1e-4))",
    "fp8ax_current": "fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling())",
    "fp8ax_mx": "fp8ax.Fp8Config(recipe=fp8ax.MXScaling())",
    "fp8ax_nofirst": "fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=False))",
}
DECODER_FULL = dict(batch=4, seq=2048, hidden=4096, heads=32, head_size=128, mlp=14336)
DECODER_DRY = dict(batch=2, seq=64, hidden=128, heads=4, head_size=32, mlp=448)
DECODER_GEMMS = 21  # 7 projections x (forward, input gradient, weight gradient); see `decoder_flops`

GEMM_SHAPES = {"square_8192": (8192, 8192, 8192), "llama_up": (8192, 4096, 14336)}  # (m, k, n)
GEMM_NOTES = {"square_8192": "M = K = N = 8192", "llama_up": "8192 tokens, 4096 -> 14336 (Llama-3 8B up/gate)"}
GEMM_PASSES = {"fwd": 1, "fwd_bwd": 3}
GEMM_VARIANTS = ("bf16", "fp8ax", "haliax_fp8")

MOE_FULL = dict(tokens=8192, k=4096, n=14336, group_sizes=(1536, 512, 1024, 256, 768, 2048, 1024, 1024))
DRY_DIVISOR = 64  # GEMM and MoE sizes in the dry pass

DEFAULT_PARTS = (
    *(f"decoder:{v}" for v in DECODER_VARIANTS[:3]),
    "decoder-warm:fp8ax",  # right after the part that fills its cache
    *(f"decoder:{v}" for v in DECODER_VARIANTS[3:]),
    "gemm:square_8192:fwd_bwd",  # the target: fp8ax >= 1.7x bf16 here
    "gemm:llama_up:fwd_bwd",
    "gemm:square_8192:fwd",
    "gemm:llama_up:fwd",
    "moe",
)
# Wall-clock limits (s) and the least time a part is started with (s).
LIMITS = {"decoder:bf16": 60, "decoder:haliax_fp8": 60, "decoder:fp8ax": 150, "decoder": 90, "gemm": 60, "moe": 60}
MIN_START = {"decoder": 40, "decoder-warm": 25, "gemm": 25, "moe": 25}
MARGIN_S = 5.0  # a part starts an optional compile only with this much to spare
EXIT_GRACE_S = 15.0  # a part that recorded "done" but has not exited by then is killed

# jax.monitoring event names (jax/_src/dispatch.py, compiler.py, compilation_cache.py in
# jax 0.10); matched by substring, so a renamed event is counted as zero, not an error.
EV_BACKEND_COMPILE = "backend_compile"
EV_TRACE = "jaxpr_trace"
EV_CACHE_MISS = "/jax/compilation_cache/cache_misses"
EV_CACHE_HIT = "/jax/compilation_cache/cache_hits"
EV_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


def part_kind(part: str) -> str:
    return part.split("@")[0].split(":")[0]


def part_base(part: str) -> str:
    return part.split("@")[0]


def uses_cache(part: str, parts: list[str]) -> bool:
    """The persistent cache goes to a warm part and to the part that fills it for it."""
    kind, _, rest = part.partition(":")
    return kind == "decoder-warm" or (kind == "decoder" and f"decoder-warm:{rest}" in parts)


def part_limit(part: str, overrides: dict[str, float]) -> float:
    for key in (part, part_base(part), part_kind(part)):
        if key in overrides:
            return overrides[key]
    base = part_base(part)
    return LIMITS.get(base, LIMITS.get(part_kind(part).replace("decoder-warm", "decoder"), 60))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


# --------------------------------------------------------------------------------------
# The decoder layer


class RMSNorm(eqx.Module):
    """``x / rms(x) * weight`` over the embedding axis, in float32, weight only."""

    weight: hax.NamedArray
    eps: float = eqx.field(static=True, default=1e-5)

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        Embed = self.weight.axes[0]
        x32 = x.astype(jnp.float32)
        inv = hax.rsqrt(hax.mean(x32 * x32, axis=Embed) + self.eps)
        return (x32 * inv * self.weight.astype(jnp.float32)).astype(x.dtype)


class DecoderLayer(eqx.Module):
    """One Llama-shaped layer: RMSNorm, causal attention, residual; RMSNorm, SwiGLU, residual."""

    attn_norm: RMSNorm
    q: hnn.Linear
    k: hnn.Linear
    v: hnn.Linear
    o: hnn.Linear
    mlp_norm: RMSNorm
    gate: hnn.Linear
    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Heads: hax.Axis, HeadSize: hax.Axis, Mlp: hax.Axis, *, key) -> DecoderLayer:
        kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)

        def linear(In, Out, k):
            return hnn.Linear.init(In=In, Out=Out, key=k, use_bias=False)

        return DecoderLayer(
            attn_norm=RMSNorm(hax.ones(Embed)),
            q=linear(Embed, (Heads, HeadSize), kq),
            k=linear(Embed, (Heads, HeadSize), kk),
            v=linear(Embed, (Heads, HeadSize), kv),
            o=linear((Heads, HeadSize), Embed, ko),
            mlp_norm=RMSNorm(hax.ones(Embed)),
            gate=linear(Embed, Mlp, kg),
            up=linear(Embed, Mlp, ku),
            down=linear(Mlp, Embed, kd),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:  # (batch, position, embed)
        Pos = x.resolve_axis("position")
        KPos = Pos.alias("key_position")
        h = self.attn_norm(x)
        q = self.q(h)
        k = self.k(h).rename({"position": "key_position"})
        v = self.v(h).rename({"position": "key_position"})
        head_size = q.resolve_axis("head_size").size
        scores = hax.dot(q, k, axis="head_size").astype(jnp.float32) / math.sqrt(head_size)
        scores = hax.where(hnn.attention.causal_mask(Pos, KPos), scores, -1e9)
        weights = hnn.softmax(scores, axis=KPos).astype(x.dtype)
        x = x + self.o(hax.dot(weights, v, axis=KPos))
        h = self.mlp_norm(x)
        return x + self.down(hnn.silu(self.gate(h)) * self.up(h))


def decoder_loss(model, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def decoder_flops(s: dict[str, int]) -> dict[str, Any]:
    tokens, d, f = s["batch"] * s["seq"], s["hidden"], s["mlp"]
    hd = s["heads"] * s["head_size"]
    in_out = 3 * d * hd + hd * d + 2 * d * f + f * d  # q, k, v, o, gate, up, down
    return {
        "linear_flops": 3 * 2 * tokens * in_out,
        "linear_flops_formula": "3 GEMMs (forward, input gradient, weight gradient) x 2*M*N*K for each of the 7 "
        "projections, M = batch*seq tokens: 6 * tokens * (3*hidden*heads*head_size + heads*head_size*hidden "
        "+ 2*hidden*mlp + mlp*hidden); attention's batched GEMMs not counted",
        "attention_flops": 6 * 2 * s["batch"] * s["heads"] * s["seq"] ** 2 * s["head_size"],
    }


# --------------------------------------------------------------------------------------
# Child: recording


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, bool | int | float | str) or x is None:
        return x
    try:
        return float(x)  # numpy / JAX scalars
    except (TypeError, ValueError):
        return repr(x)


class Recorder:
    """Appends one JSON object per call to the part's lines file (the parent merges them)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(_jsonable(fields)) + "\n")
        print(f"[{time.perf_counter() - T_IMPORT:7.1f}s] " + ", ".join(sorted(fields)), file=sys.stderr, flush=True)


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


def _dist_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def child_machine() -> dict[str, Any]:
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "devices": [repr(d) for d in devices],
        "versions": {
            "jax": jax.__version__,
            "jaxlib": _dist_version("jaxlib"),
            "equinox": _dist_version("equinox"),
            "haliax": _dist_version("haliax"),
            "optax": _dist_version("optax"),
            "fp8ax": _dist_version("fp8ax"),
            "python": sys.version.split()[0],
            "jax_and_cuda_distributions": sorted(
                f"{d.metadata['Name']}=={d.version}"
                for d in importlib.metadata.distributions()
                if (d.metadata["Name"] or "").lower().startswith(("jax", "nvidia-cublas", "nvidia-cudnn"))
            ),
        },
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def _bench_module(name: str):
    """bench/gpu.py or bench/gpu_hlo.py, imported in the part (they import fp8ax)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return __import__(name)


def _stats(times: list[float]) -> dict[str, Any]:
    out = {"median_s": statistics.median(times), "min_s": min(times)}
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) >= 2 else [times[0]] * 3
    out["p25_s"], out["p75_s"] = q[0], q[2]
    out["all_s"] = times
    return out


def _block(tree) -> None:
    jax.block_until_ready(eqx.filter(tree, eqx.is_array))


def _compiled_text(compiled) -> str:
    return getattr(compiled, "compiled", compiled).as_text()  # eqx's Compiled wraps JAX's


def fp8_check(text: str, expected: int, variant: str, backend: str, flops: float | None = None) -> dict[str, Any]:
    """The FP8 GEMMs of a compiled program (bench/gpu_hlo.py) against those it should have.

    PASS when `expected` GEMMs are FP8, or when the FP8 GEMMs do exactly the FLOPs of the
    GEMMs that should be FP8 (`flops`): XLA may merge GEMMs that share an operand."""
    gpu_hlo = _bench_module("gpu_hlo")
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


# --------------------------------------------------------------------------------------
# Child: the decoder step


def build_decoder(variant: str, s: dict[str, int], seed: int):
    import haliax.quantization as haxq
    import optax

    import fp8ax

    Batch, Pos = hax.Axis("batch", s["batch"]), hax.Axis("position", s["seq"])
    Embed, Mlp = hax.Axis("embed", s["hidden"]), hax.Axis("mlp", s["mlp"])
    Heads, HeadSize = hax.Axis("heads", s["heads"]), hax.Axis("head_size", s["head_size"])

    @eqx.filter_jit  # one compile instead of one per eager op
    def make(key):
        k_model, k_x, k_y = jax.random.split(key, 3)
        model = fp8ax.cast_floating(DecoderLayer.init(Embed, Heads, HeadSize, Mlp, key=k_model), jnp.bfloat16)
        shape = (s["batch"], s["seq"], s["hidden"])
        return model, jax.random.normal(k_x, shape, jnp.bfloat16), jax.random.normal(k_y, shape, jnp.bfloat16)

    model, x, y = make(jax.random.key(seed, impl="rbg"))  # cheaper to compile than threefry
    x, y = hax.named(x, (Batch, Pos, Embed)), hax.named(y, (Batch, Pos, Embed))
    opt = optax.adam(1e-4)
    opt_init = eqx.filter_jit(opt.init)
    traces: list[float] = []

    if variant == "bf16":

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())  # runs once per trace
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return eqx.apply_updates(model, updates), opt_state

        opt_state = opt_init(eqx.filter(model, eqx.is_array))
    elif variant == "haliax_fp8":
        # Cast before quantizing, so that Haliax's FP8 state stays float32. Haliax's
        # partition puts None where the FP8 state is, so its optimizer state is built from
        # the model without the state.
        model = haxq.quantize_linear_layers(model, haxq.QuantizationConfig(fp8=True))

        def trained(model):
            return eqx.filter(haxq.partition_for_grad_overwrite(model)[1], eqx.is_array)

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            overwrite, grads = haxq.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=trained(model))
            return haxq.apply_updates(model, updates, overwrite), opt_state

        opt_state = opt_init(trained(model))
    else:
        config = {
            "fp8ax": lambda: fp8ax.Fp8Config(),
            "fp8ax_skip": lambda: fp8ax.Fp8Config(),
            "fp8ax_current": lambda: fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling()),
            "fp8ax_mx": lambda: fp8ax.Fp8Config(recipe=fp8ax.MXScaling()),
            "fp8ax_nofirst": lambda: fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=False)),
        }[variant]()
        model = fp8ax.fp8_linear_layers(model, config)
        if variant == "fp8ax_skip":  # no optimizer moments for the FP8 state
            opt = fp8ax.skip_fp8_state(opt)
            opt_init = eqx.filter_jit(opt.init)

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return fp8ax.apply_updates(model, updates, overwrite), opt_state

        opt_state = opt_init(eqx.filter(model, eqx.is_array))
    kinds = (fp8ax.Fp8DotGeneral, haxq.Fp8DotGeneralOp)
    fp8_layers = sum(
        isinstance(n, kinds) for n in jax.tree_util.tree_leaves(model, is_leaf=lambda n: isinstance(n, kinds))
    )
    return model, opt_state, x, y, step, traces, fp8_layers


def run_decoder(args, rec: Recorder, events: Events, variant: str, backend: str) -> None:
    s = DECODER_DRY if args.dry else DECODER_FULL
    flops = decoder_flops(s)
    rec(config={**s, "variant": variant, "recipe": FP8AX_RECIPES.get(variant), "steps": args.steps, **flops})
    t0 = time.perf_counter()
    model, opt_state, x, y, step, traces, fp8_layers = build_decoder(variant, s, args.seed)
    _block((model, opt_state, x, y))
    rec(build_s=time.perf_counter() - t0, fp8_layers=fp8_layers)

    # (a) The first call: trace, lower, compile (XLA:GPU autotunes here) and run.
    m0 = events.mark()
    t_first = time.perf_counter()
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    first_call_s = time.perf_counter() - t_first
    w = events.since(m0)
    rec(
        first_call_s=first_call_s,
        first_call_breakdown_s={  # from jax.monitoring durations inside the first call
            "trace": Events.seconds(w, EV_TRACE),
            "lower_to_mlir": Events.seconds(w, "jaxpr_to_mlir_module"),
            "backend_compile": Events.seconds(w, EV_BACKEND_COMPILE),
        },
    )

    # (c) Steps 2 and 3; first_settled_s ends with step 2.
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    first_settled_s = time.perf_counter() - t_first
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    w = events.since(m0)
    rec(
        first_settled_s=first_settled_s,
        traces_first_3_steps=len(traces),
        backend_compiles_first_3_steps=Events.count(w, EV_BACKEND_COMPILE),
        cache_first_3_steps=cache_counts(w) if args.cache_dir else None,
        events_first_3_steps=w["counts"],
    )

    # (d) Timed steps (steps 1-3 were the warm-up).
    times: list[float] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model, opt_state = step(model, opt_state, x, y)
        _block((model, opt_state))
        times.append(time.perf_counter() - t0)
        rec(step_times_partial_s=times)
    st = _stats(times)
    # (e) The linear layers' FLOPs over the whole step's time.
    rec(step=st, linear_tflops=flops["linear_flops"] / st["median_s"] / 1e12, traces_after_timed=len(traces))

    # (b) Optional: trace+lower and XLA compile timed apart, on a cleared in-process cache.
    compiled = None
    if args.split_compile:
        if _time_left(args) > first_call_s * 1.2 + MARGIN_S:
            try:
                compiled, split = split_compile(step, (model, opt_state, x, y), cache=bool(args.cache_dir))
                rec(split_compile=split)
            except Exception as e:
                rec(split_compile={"error": error_info(e)})
        else:
            rec(split_compile={"skipped": "time"})

    # (f) The FP8 GEMM check of the step as it runs now. `step.lower(...).compile()` after
    # the calls was served from JAX's in-process cache on jax 0.10 (no backend compile:
    # `backend_compiles` says); the guard assumes it may have to compile again.
    if args.no_fp8_check:
        rec(fp8_check={"skipped": "--no-fp8-check"})
    elif compiled is not None or _time_left(args) > first_call_s * 1.2 + MARGIN_S:
        try:
            t0 = time.perf_counter()
            m1 = events.mark()
            if compiled is None:
                compiled = step.lower(model, opt_state, x, y).compile()
            text = _compiled_text(compiled)
            expected = DECODER_GEMMS if variant != "bf16" else 0
            check = fp8_check(text, expected, variant, backend, flops["linear_flops"])
            check["compile_s"] = time.perf_counter() - t0
            check["backend_compiles"] = Events.count(events.since(m1), EV_BACKEND_COMPILE)
            rec(fp8_check=check)
        except Exception as e:
            rec(fp8_check={"error": error_info(e)})
    else:
        rec(fp8_check={"skipped": "time"})

    # (g) The loss after the steps (a forward-only program: one more, smaller compile).
    if _time_left(args) > MARGIN_S:
        try:
            rec(loss=float(eqx.filter_jit(decoder_loss)(model, x, y)))
        except Exception as e:
            rec(loss_error=error_info(e))


def split_compile(step, call_args, cache: bool):
    """Times `step.lower(...)` and `.compile()` apart after `jax.clear_caches()` (and with the
    persistent cache switched off), so that neither is served from a cache of JAX's. XLA's
    own in-process autotuning results are not cleared: GEMM fusions the first call tuned may
    not be tuned again, so `xla_compile_s` can be shorter than the first call's compile."""
    jax.clear_caches()
    if cache:
        from jax.experimental.compilation_cache import compilation_cache as cc

        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()
    t0 = time.perf_counter()
    lowered = step.lower(*call_args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    split = {
        "trace_lower_s": t1 - t0,
        "xla_compile_s": t2 - t1,
        "method": "jax.clear_caches() then eqx.filter_jit(step).lower(...) and .compile() after the timed steps"
        + ("; persistent cache disabled for it" if cache else "")
        + "; XLA's in-process autotuning results may be reused",
    }
    return compiled, split


# --------------------------------------------------------------------------------------
# Child: single GEMMs and the grouped GEMM


class RaggedLayer(eqx.Module):
    """``op(x, w, group_sizes)``: ``jax.lax.ragged_dot`` or ``fp8ax.Fp8RaggedDot``."""

    weight: jax.Array  # (experts, in, out)
    group_sizes: jax.Array  # (experts,) int32
    op: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.op(x, self.weight, self.group_sizes)


class PlainRaggedDot(eqx.Module):
    def __call__(self, lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def fill_and_compile(layer, pass_name: str, x, g, *, fill: bool) -> tuple[Callable[[], Any], dict[str, Any], Any]:
    """Compiles `layer`'s function for `pass_name` (bench/gpu.py's `gemm_function`); with
    `fill`, runs one forward+backward first and writes the FP8 state it returns
    (`fp8ax.partition_for_grad_overwrite`, `fp8ax.apply_updates`), so the timed calls see a
    filled state. The compiled program is reused after the fill when the layer's
    non-array fields did not change; otherwise the filled layer is compiled again."""
    import fp8ax

    gpu = _bench_module("gpu")
    info: dict[str, Any] = {}
    jitted, leaves = gpu.gemm_function(layer, "fwd_bwd" if fill else pass_name)
    t0 = time.perf_counter()
    compiled = jitted.lower(leaves, x, g).compile()
    info["compile_s"] = time.perf_counter() - t0
    if fill:
        t0 = time.perf_counter()
        _, (layer_grad, _) = compiled(leaves, x, g)
        overwrite, _ = fp8ax.partition_for_grad_overwrite(layer_grad)
        filled = fp8ax.apply_updates(layer, None, overwrite)
        _block(filled)
        info["fill_s"] = time.perf_counter() - t0
        old_dyn, old_static = eqx.partition(layer, eqx.is_array)
        new_dyn, new_static = eqx.partition(filled, eqx.is_array)
        same = pass_name == "fwd_bwd" and (
            jax.tree.structure(old_dyn) == jax.tree.structure(new_dyn) and eqx.tree_equal(old_static, new_static)
        )
        info["compiled_again_after_fill"] = not same
        if same:
            leaves = jax.tree.leaves(new_dyn)
        else:
            info["fill_compile_s"] = info["compile_s"]
            jitted, leaves = gpu.gemm_function(filled, pass_name)
            t0 = time.perf_counter()
            compiled = jitted.lower(leaves, x, g).compile()
            info["compile_s"] = time.perf_counter() - t0
    return (lambda c=compiled, a=leaves: c(a, x, g)), info, compiled


def _rates(variants: dict[str, dict[str, Any]], flops: float) -> None:
    base = variants.get("bf16", {}).get("median_s")
    for info in variants.values():
        if "median_s" in info:
            info["tflops"] = flops / info["median_s"] / 1e12
            info["speedup_vs_bf16"] = base / info["median_s"] if base else None


def run_gemm(args, rec: Recorder, shape_name: str, pass_name: str, backend: str) -> None:
    gpu = _bench_module("gpu")
    m, k, n = (d // DRY_DIVISOR for d in GEMM_SHAPES[shape_name]) if args.dry else GEMM_SHAPES[shape_name]
    n_gemms = GEMM_PASSES[pass_name]
    flops = 2.0 * m * n * k * n_gemms
    rec(config={"shape": shape_name, "pass": pass_name, "m": m, "k": k, "n": n, "gemms": n_gemms, "flops": flops})
    kx, kw, kg = jax.random.split(jax.random.key(args.seed, impl="rbg"), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    variants: dict[str, dict[str, Any]] = {v: {} for v in GEMM_VARIANTS}
    calls = {}
    for v in GEMM_VARIANTS:
        info = variants[v]
        try:
            dg = gpu.make_dot_general({"bf16": "bf16", "fp8ax": "fp8ax_direct", "haliax_fp8": "haliax_fp8"}[v])
            call, more, compiled = fill_and_compile(gpu.GemmLayer(w, dg), pass_name, x, g, fill=v == "fp8ax")
            info.update(more)
            info["fp8_check"] = fp8_check(_compiled_text(compiled), n_gemms, v, backend)
            calls[v] = call
        except Exception as e:  # one broken variant must not hide the others
            info["error"] = error_info(e)
        rec(variants={v: info})
    _time_variants(args, rec, gpu, calls, variants, flops)


def _time_variants(args, rec: Recorder, gpu, calls, variants: dict[str, dict[str, Any]], flops: float) -> None:
    """Times the compiled `calls` interleaved (bench/gpu.py's `time_interleaved`) into
    `variants`, with their rates for `flops`, and records them."""
    timed = gpu.time_interleaved(
        calls, reps=args.gemm_reps, warmup=1 if args.dry else 2, inner=1 if args.dry else 0, target_s=0.02
    )
    for v, t in timed.items():
        if "error" in t:
            t = {"error": {"type": "warm-up", "message": t["error"], "traceback_tail": []}}
        variants[v].update(t)
    _rates(variants, flops)
    rec(variants=variants)


def ragged_ops(text: str) -> dict[str, Any]:
    """What of the ragged dot is left in a compiled program, over all its computations
    (loop bodies included): instructions whose opcode or custom-call target names a ragged
    or grouped GEMM, the `while` loops, and the result types of every `dot`."""
    gpu_hlo = _bench_module("gpu_hlo")
    _, comps = gpu_hlo.parse(text)
    instrs = [i for c in comps.values() for i in c]
    named = sorted({i.target or i.opcode for i in instrs if re.search(r"ragged|grouped|gmm", i.target or i.opcode)})
    return {
        "ragged_or_grouped_ops": named,
        "while_loops": sum(i.opcode == "while" for i in instrs),
        "dot_result_types": sorted(i.type.split("{")[0] for i in instrs if i.opcode in ("dot", "ragged-dot")),
    }


def run_moe(args, rec: Recorder, backend: str) -> None:
    import fp8ax

    gpu = _bench_module("gpu")
    gpu_hlo = _bench_module("gpu_hlo")
    d = DRY_DIVISOR if args.dry else 1
    m, k, n = MOE_FULL["tokens"] // d, MOE_FULL["k"] // d, MOE_FULL["n"] // d
    sizes = tuple(s // d for s in MOE_FULL["group_sizes"])
    experts = len(sizes)
    useful = 3 * 2.0 * m * k * n  # forward, input gradient, weight gradient: each token x its expert only
    rec(config={"tokens": m, "k": k, "n": n, "experts": experts, "group_sizes": sizes, "useful_flops": useful})
    kx, kw, kg = jax.random.split(jax.random.key(args.seed, impl="rbg"), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (experts, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (m, n), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    variants: dict[str, dict[str, Any]] = {"bf16": {}, "fp8ax": {}}
    calls = {}
    for v, info in variants.items():
        try:
            op = PlainRaggedDot() if v == "bf16" else fp8ax.Fp8RaggedDot.init(num_experts=experts)
            layer = RaggedLayer(w, group_sizes, op)
            call, more, compiled = fill_and_compile(layer, "fwd_bwd", x, g, fill=v == "fp8ax")
            info.update(more)
            text = _compiled_text(compiled)
            info["fp8_check"] = fp8_check(text, 3, v, backend, useful)
            s = gpu_hlo.summary(text)
            ks, facts = gpu_hlo.kernels(text)
            info["program"] = {
                "gemms": s["gemms"],
                "fp8_gemms": s["fp8_gemms"],
                "gemm_paths": s["gemm_paths"],
                "gemm_out_shapes": sorted(facts["entry"][q.name].type.split("{")[0] for q in ks if q.kind == "gemm"),
                "gemm_flops": s["gemm_flops"],
                "gemm_flops_over_useful": s["gemm_flops"] / useful,
                **ragged_ops(text),
                "kernels": s["kernels"],
            }
            calls[v] = call
        except Exception as e:
            info["error"] = error_info(e)
        rec(variants={v: info})
    _time_variants(args, rec, gpu, calls, variants, useful)


# --------------------------------------------------------------------------------------
# Child: entry


def child_main(args) -> int:
    rec = Recorder(args.lines)
    rec(child_started=True, import_s=time.perf_counter() - T_IMPORT)
    try:
        if args.cache_dir:  # before anything compiles
            jax.config.update("jax_compilation_cache_dir", args.cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        events = Events()
        t0 = time.perf_counter()
        machine = child_machine()  # initializes the backend
        backend = machine["backend"]
        args.dry = args.dry or backend != "gpu"
        if args.dry:
            args.steps = min(args.steps, 2)
            args.gemm_reps = min(args.gemm_reps, 2)
        rec(
            machine=machine,
            backend_init_s=time.perf_counter() - t0,
            dry=args.dry,
            cache_dir=args.cache_dir,
            monitoring_listeners=events.installed,
        )
        kind, _, rest = part_base(args.part).partition(":")
        if kind in ("decoder", "decoder-warm"):
            run_decoder(args, rec, events, rest, backend)
        elif kind == "gemm":
            shape, pass_name = rest.split(":")
            run_gemm(args, rec, shape, pass_name, backend)
        elif kind == "moe":
            run_moe(args, rec, backend)
        else:
            raise ValueError(f"unknown part {args.part!r}")
        rec(done=True, part_wall_s=time.perf_counter() - T_IMPORT)
        return 0
    except BaseException as e:  # reported to the parent through the lines file
        rec(error=error_info(e))
        return 1


# --------------------------------------------------------------------------------------
# Parent


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def _git(*cmd) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=ROOT, timeout=20)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:
        return None


def autotune_files(log_dir: str | None, slug: str) -> list[dict[str, Any]]:
    """The autotuning logs of one part: name, size and, for text protos, the autotuned
    fusions (`fusion_name` entries) and distinct fingerprints found in them."""
    if not log_dir:
        return []
    out = []
    for p in sorted(Path(log_dir).glob(f"{slug}*")):
        entry: dict[str, Any] = {"file": p.name, "bytes": p.stat().st_size}
        try:
            text = p.read_text(errors="replace") if p.stat().st_size < 200_000_000 else ""
            names = re.findall(r'fusion_name:\s*"([^"]*)"', text)
            fingerprints = re.findall(r'fingerprint:\s*"([^"]*)"', text)
            entry.update(
                logs=len(re.findall(r"^logs\s*\{", text, re.MULTILINE)),
                fusion_names=len(names),
                distinct_fusion_names=len(set(names)),
                distinct_fingerprints=len(set(fingerprints)),
            )
        except Exception as e:
            entry["parse_error"] = f"{type(e).__name__}: {e}"
        out.append(entry)
    return out


def run_part(args, part: str, timeout: float, work: Path, cache_dir: str | None) -> dict[str, Any]:
    slug = _slug(part)
    lines = work / f"{slug}.jsonl"
    log = work / f"{slug}.log"
    cmd = [sys.executable, str(SCRIPT), "--part", part, "--lines", str(lines), "--deadline", f"{time.time() + timeout}"]
    cmd += ["--steps", str(args.steps), "--gemm-reps", str(args.gemm_reps), "--seed", str(args.seed)]
    cmd += ["--dry"] * args.dry + ["--split-compile"] * args.split_compile + ["--no-fp8-check"] * args.no_fp8_check
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    flags = [os.environ.get("XLA_FLAGS", ""), args.base_xla_flags]
    variant = part.partition("@")[2]
    if variant:
        flags.append(args.flag_variants[variant])
    if args.autotune_log_dir:
        # One file per part; the two parts that share a persistent cache share the file
        # name too, since the flag is part of the cache key.
        name = _slug(part.replace("decoder-warm", "decoder")) if cache_dir else slug
        flags.append(f"--xla_gpu_dump_autotune_logs_to={Path(args.autotune_log_dir).resolve() / name}.textproto")
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if f).strip())
    result: dict[str, Any] = {"part": part, "timeout_s": round(timeout, 1), "xla_flags": env["XLA_FLAGS"]}
    t0 = time.monotonic()
    with open(log, "w") as out:
        # A new session, so that a kill takes the whole process group (XLA may run ptxas).
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        done_at = None
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                result["timed_out"] = False
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if done_at is None and lines.exists() and b'"done": true' in lines.read_bytes()[-4096:]:
                done_at = now
            hung = done_at is not None and now - done_at > EXIT_GRACE_S  # finished, but does not exit
            if now - t0 > timeout or hung:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                rc = proc.wait()
                result["timed_out"] = not hung
                result["killed_after_done"] = hung
                break
    result["wall_s"] = time.monotonic() - t0
    result["returncode"] = rc
    if lines.exists():
        for line in lines.read_text().splitlines():
            try:
                fields = json.loads(line)
                _merge(result, fields)
                result["last_recorded"] = sorted(fields)
            except json.JSONDecodeError:  # a line cut short by a kill
                result.setdefault("unreadable_lines", 0)
                result["unreadable_lines"] += 1
    log_lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    if result["timed_out"]:
        result["status"] = "timed_out"
    elif "error" in result:
        result["status"] = "error"
    elif (rc != 0 and not result.get("killed_after_done")) or not result.get("done"):
        result["status"] = "crashed"
        result["error"] = {"type": "exit", "message": f"exit status {rc}", "traceback_tail": log_lines[-12:]}
    else:
        result["status"] = "ok"
    result["log_tail"] = log_lines[-(40 if result["status"] != "ok" else 6) :]
    if args.autotune_log_dir:
        result["autotune_logs"] = autotune_files(
            args.autotune_log_dir, _slug(part.replace("decoder-warm", "decoder")) if cache_dir else slug
        )
    return result


def parse_parts(text: str | None, flag_variants: dict[str, str], cache: bool) -> list[str]:
    parts = list(DEFAULT_PARTS if cache else [p for p in DEFAULT_PARTS if not p.startswith("decoder-warm")])
    if text is None or text.strip() == "all":
        return parts
    groups = {
        "decoder": [p for p in parts if part_kind(p) == "decoder"],
        "gemm": [p for p in parts if part_kind(p) == "gemm"],
    }
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, variant = item.partition("@")
        if variant and variant not in flag_variants:
            raise SystemExit(
                f"--parts: {item!r} names the XLA flags variant {variant!r}, not given with --xla-flags-variant"
            )
        names = groups.get(name, [name])
        for base in names:
            kind, _, rest = base.partition(":")
            ok = (
                (kind in ("decoder", "decoder-warm") and rest in DECODER_VARIANTS)
                or (
                    kind == "gemm"
                    and rest.count(":") == 1
                    and rest.split(":")[0] in GEMM_SHAPES
                    and rest.split(":")[1] in GEMM_PASSES
                )
                or base == "moe"
            )
            if not ok:
                raise SystemExit(f"--parts: unknown part {base!r}; known: {', '.join(DEFAULT_PARTS)}, decoder, gemm")
            out.append(f"{base}@{variant}" if variant else base)
    return out


def parent_main(args) -> int:
    t_start = T_IMPORT  # the budget counts this process's own start (its imports) too

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    own_cache = args.cache_dir is None and not args.no_cache
    cache_root = None if args.no_cache else (args.cache_dir or tempfile.mkdtemp(prefix="gpu_train_cache_"))
    parts = parse_parts(args.parts, args.flag_variants, cache_root is not None)
    if args.autotune_log_dir:
        Path(args.autotune_log_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_train_parts_"))
    cache_at_start = None
    if cache_root:
        cache_at_start = sum(1 for _ in Path(cache_root).rglob("*") if _.is_file()) if Path(cache_root).exists() else 0
    log(f"gpu_train: {len(parts)} parts, budget {args.budget_s:.0f}s: {', '.join(parts)}")
    results: list[dict[str, Any]] = []
    try:
        for part in parts:
            left = args.budget_s - (time.perf_counter() - t_start)
            kind = part_kind(part)
            need = args.min_start.get(part, args.min_start.get(kind, MIN_START.get(kind, 25)))
            if left < need:
                results.append({"part": part, "status": "skipped", "skipped": "budget", "budget_left_s": left})
                log(f"  {part}: skipped (budget: {left:.0f}s left, needs {need}s)")
                continue
            cache_dir = None
            if cache_root and uses_cache(part, parts):
                cache_dir = str(Path(cache_root) / _slug(part_base(part).split(":")[1] + "@" + part.partition("@")[2]))
            if kind == "decoder-warm":
                cold = next((r for r in results if r["part"] == part.replace("decoder-warm", "decoder")), None)
                if cold is not None and "first_call_s" not in cold:
                    results.append({"part": part, "status": "skipped", "skipped": f"{cold['part']} did not finish"})
                    log(f"  {part}: skipped ({cold['part']} did not finish its first step)")
                    continue
            timeout = min(part_limit(part, args.part_timeouts), left)
            log(f"  {part}: running (limit {timeout:.0f}s)")
            r = run_part(args, part, timeout, work, cache_dir)
            if kind == "decoder-warm" and cache_dir:
                r["warm_cache"] = True
            results.append(r)
            msg = r["status"] + (f": {r['error']['type']}: {r['error']['message'][:200]}" if "error" in r else "")
            log(f"  {part}: {msg} ({r['wall_s']:.1f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own_cache and cache_root:
            shutil.rmtree(cache_root, ignore_errors=True)

    machine = next((r["machine"] for r in results if "machine" in r), {})
    dry = any(r.get("dry") for r in results) or args.dry
    dirty = _git("status", "--porcelain", "--", "src")
    payload: dict[str, Any] = {
        "benchmark": "bench/gpu_train.py",
        "dry": dry,
        "meaningful_timings": not dry,
        "machine": {
            **machine,
            "parent_python": sys.version.split()[0],
            "git_commit": _git("rev-parse", "HEAD"),
            "src_uncommitted_changes": None if dirty is None else dirty.splitlines(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "parent_xla_flags": os.environ.get("XLA_FLAGS"),
        },
        "config": {
            "argv": sys.argv[1:],
            "parts": parts,
            "budget_s": args.budget_s,
            "steps": args.steps if not dry else min(args.steps, 2),
            "gemm_reps": args.gemm_reps if not dry else min(args.gemm_reps, 2),
            "seed": args.seed,
            "split_compile": args.split_compile,
            "xla_flags_variants": args.flag_variants,
            "base_xla_flags": args.base_xla_flags,
            "autotune_log_dir": args.autotune_log_dir,
            "persistent_cache": None
            if cache_root is None
            else {
                "dir": cache_root,
                "temporary": own_cache,
                "files_at_start": cache_at_start,
                "given_to": [p for p in parts if uses_cache(p, parts)],
                "note": "the part that fills the cache also writes every program it compiles to it",
            },
            "decoder": "one Llama-shaped layer (haliax): RMSNorm -> q,k,v (hnn.Linear, no bias) -> causal attention "
            "(hax.dot in bf16, softmax in float32) -> o -> residual -> RMSNorm -> down(silu(gate(h)) * up(h)) -> "
            "residual; bf16 parameters (fp8ax.cast_floating); MSE in float32 against a fixed random target; "
            "optax.adam(1e-4); opt.init(eqx.filter(model, eqx.is_array)) (haliax_fp8: the model without its FP8 "
            "state, which Haliax's partition leaves out); eqx.filter_jit step: filter_grad, "
            "partition_for_grad_overwrite, opt.update(params=model), apply_updates",
            "decoder_sizes": DECODER_DRY if dry else DECODER_FULL,
            "decoder_timing": "first_call_s: the first step(...) incl. jax.block_until_ready, in a fresh process after "
            "the model is built; first_settled_s: from the start of step 1 to the end of step 2; steps 1-3 are the "
            "warm-up, then `steps` steps each blocked and timed; traces_first_3_steps: Python traces of the step "
            "(a counter in its body), backend_compiles_first_3_steps: jax.monitoring backend-compile events",
            "gemm": "y = x @ w.T through bench/gpu.py's GemmLayer (x (m, k), w (n, k) bf16); fwd: the call; fwd_bwd: "
            "eqx.filter_value_and_grad of sum(y * g) w.r.t. (layer, x); jax.jit of the layer's flat arrays; "
            "fp8ax: Fp8DotGeneral.init(mode='direct'), its state written once by an untimed forward+backward; "
            "variants timed interleaved (bench/gpu.py's time_interleaved)",
            "moe": "jax.lax.ragged_dot (bf16) vs fp8ax.Fp8RaggedDot.init(num_experts=8) (state filled once), "
            "eqx.filter_value_and_grad of sum(y * g) w.r.t. (weights, x): 3 grouped GEMMs; useful FLOPs "
            "3 * 2 * tokens * k * n",
            "fp8_check": "FP8 GEMMs (bench/gpu_hlo.py: __cublas$lt$matmul$f8, or a Triton/cuDNN GEMM fusion on FP8 "
            "operands) in compiled.as_text() against the GEMMs that should be FP8 (decoder 21, gemm 1 or 3); PASS "
            "also when the FP8 GEMMs do exactly the FLOPs of the linear layers (XLA may merge GEMMs); n/a off a GPU",
        },
        "parts": results,
        "total_wall_s": time.perf_counter() - t_start,
    }
    payload["summary"] = summarise(payload)
    out = args.out
    if out is None:
        name = f"gpu_train_dry_{machine.get('backend', 'unknown')}.json" if dry else None
        name = name or f"gpu_train_{_slug(machine.get('device_kind', 'unknown'))}.json"
        out = str(RESULTS / name)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
        log(f"wrote {out}")
    print_tables(payload)
    log(f"total wall time {payload['total_wall_s']:.1f}s")
    return 1 if args.strict and payload["summary"]["fp8_failed"] else 0


def _checks(payload):
    for r in payload["parts"]:
        if "fp8_check" in r and "status" in r["fp8_check"]:
            yield r["part"], r["fp8_check"]
        for v, info in (r.get("variants") or {}).items():
            if "status" in info.get("fp8_check", {}):
                yield f"{r['part']} {v}", info["fp8_check"]


def summarise(payload) -> dict[str, Any]:
    checks = list(_checks(payload))
    return {
        "parts_ok": [r["part"] for r in payload["parts"] if r.get("status") == "ok"],
        "parts_failed": [r["part"] for r in payload["parts"] if r.get("status") in ("error", "crashed")],
        "parts_timed_out": [r["part"] for r in payload["parts"] if r.get("status") == "timed_out"],
        "parts_skipped": [r["part"] for r in payload["parts"] if r.get("status") == "skipped"],
        "fp8_passed": [n for n, c in checks if c["status"] == "PASS"],
        "fp8_failed": [n for n, c in checks if c["status"] == "FAIL"],
    }


# --------------------------------------------------------------------------------------
# Tables


def _f(x, fmt="{:.2f}", scale=1.0) -> str:
    return "-" if not isinstance(x, int | float) else fmt.format(x * scale)


def _range(stats: dict[str, Any]) -> str:
    if "p25_s" not in stats:
        return "-"
    return f"{stats['p25_s'] * 1e3:.3f}-{stats['p75_s'] * 1e3:.3f}"


def _check_cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    if "error" in c:
        return "ERROR"
    if "skipped" in c:
        return f"skipped ({c['skipped']})"
    if c["status"] == "baseline":
        return f"({c['found']} FP8)"
    return f"{c['found']}/{c['expected']} {c['status']}"


def print_tables(payload: dict[str, Any], out=sys.stdout) -> None:
    parts = payload["parts"]
    if payload["dry"]:
        print("\n**Dry pass: tiny sizes, timings are meaningless.**", file=out)
    print("\n### Parts\n", file=out)
    print("| part | status | wall s | limit s | note |", file=out)
    print("|---|---|---:|---:|---|", file=out)
    for r in parts:
        note = r.get("skipped") or (f"{r['error']['type']}: {r['error']['message'][:100]}" if "error" in r else "")
        if r.get("timed_out"):
            note = f"cut short after: {', '.join(r.get('last_recorded', [])) or 'nothing recorded'}"
        print(
            f"| {r['part']} | {r['status']} | {_f(r.get('wall_s'), '{:.1f}')} | {_f(r.get('timeout_s'), '{:.0f}')} | "
            f"{note.replace('|', '/').replace(chr(10), ' ')} |",
            file=out,
        )
    dec = [r for r in parts if part_kind(r["part"]) in ("decoder", "decoder-warm") and "config" in r]
    if dec:
        base = next((r for r in dec if part_base(r["part"]) == "decoder:bf16" and "step" in r), None)
        print("\n### Decoder layer train step\n", file=out)
        print(
            "| part | first call s | first 2 steps s | traces / compiles (3 steps) | step ms (median) | p25-p75 | min "
            "| linear TFLOP/s | x bf16 | FP8 GEMMs | loss |",
            file=out,
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|", file=out)
        for r in dec:
            st = r.get("step", {})
            sp = base["step"]["median_s"] / st["median_s"] if base and "median_s" in st else None
            tc = f"{r.get('traces_first_3_steps', '-')} / {r.get('backend_compiles_first_3_steps', '-')}"
            print(
                f"| {r['part']} | {_f(r.get('first_call_s'))} | {_f(r.get('first_settled_s'))} | {tc} | "
                f"{_f(st.get('median_s'), '{:.3f}', 1e3)} | {_range(st)} | "
                f"{_f(st.get('min_s'), '{:.3f}', 1e3)} | {_f(r.get('linear_tflops'), '{:.1f}')} | {_f(sp)} | "
                f"{_check_cell(r.get('fp8_check'))} | {_f(r.get('loss'), '{:.4g}')} |",
                file=out,
            )
        warm = [r for r in dec if r.get("warm_cache")]
        for r in warm:
            cold = next((c for c in dec if c["part"] == r["part"].replace("decoder-warm", "decoder")), {})
            cache = r.get("cache_first_3_steps", {})
            print(
                f"\nWith the persistent cache warm ({r['part']}): first call {_f(r.get('first_call_s'))} s "
                f"(cold {_f(cold.get('first_call_s'))} s), first 2 steps {_f(r.get('first_settled_s'))} s "
                f"(cold {_f(cold.get('first_settled_s'))} s); over the first 3 steps: cache misses "
                f"{cache.get('misses', '-')}, hits {cache.get('hits', '-')}, requests {cache.get('requests', '-')}.",
                file=out,
            )
        for r in dec:
            sc = r.get("split_compile")
            if sc and "trace_lower_s" in sc:
                print(
                    f"\n{r['part']}: trace+lower {sc['trace_lower_s']:.2f} s, XLA compile {sc['xla_compile_s']:.2f} s "
                    "(after jax.clear_caches(); XLA's in-process autotuning results may be reused)",
                    file=out,
                )
    gem = [r for r in parts if part_kind(r["part"]) in ("gemm", "moe") and r.get("variants")]
    if gem:
        print("\n### Single and grouped GEMMs\n", file=out)
        print(
            "| part | variant | ms (median) | p25-p75 | TFLOP/s | x bf16 | compile s | FP8 GEMMs | GEMM FLOPs / useful |",
            file=out,
        )
        print("|---|---|---:|---:|---:|---:|---:|---|---:|", file=out)
        for r in gem:
            for v, i in r["variants"].items():
                prog = i.get("program", {})
                if "error" in i:
                    cells = ["ERROR: " + i["error"]["type"]] + ["-"] * 6
                else:
                    cells = [
                        _f(i.get("median_s"), "{:.3f}", 1e3),
                        _range(i),
                        _f(i.get("tflops"), "{:.1f}"),
                        _f(i.get("speedup_vs_bf16")),
                        _f(i.get("compile_s")),
                        _check_cell(i.get("fp8_check")),
                        _f(prog.get("gemm_flops_over_useful")),
                    ]
                print(f"| {r['part']} | {v} | " + " | ".join(cells) + " |", file=out)
        for r in gem:
            for v, i in r["variants"].items():
                if "program" in i:
                    print(f"\n{r['part']} {v}: GEMM outputs {', '.join(i['program']['gemm_out_shapes'])}", file=out)
    s = payload["summary"]
    print(
        f"\nParts: {len(s['parts_ok'])} ok, {len(s['parts_failed'])} failed, {len(s['parts_timed_out'])} timed out, "
        f"{len(s['parts_skipped'])} skipped. FP8 checks: {len(s['fp8_passed'])} PASS, {len(s['fp8_failed'])} FAIL"
        + (f" ({', '.join(s['fp8_failed'])})" if s["fp8_failed"] else "")
        + (" (n/a off a GPU)" if payload["dry"] and payload["machine"].get("backend") != "gpu" else "")
        + ". Linear TFLOP/s: the 21 projection GEMMs' FLOPs (2*M*N*K each) over the whole step's time.",
        file=out,
    )


# --------------------------------------------------------------------------------------
# Arguments


def _pairs(items: list[str], what: str, convert=str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {item!r}")
        out[key] = convert(value)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="JSON path (default bench/results/gpu_train_<device>.json); '' for none")
    p.add_argument("--parts", default=None, help="comma-separated parts, 'decoder', 'gemm' or 'all' (default)")
    p.add_argument("--dry", action="store_true", help="tiny sizes even on a GPU (automatic without one)")
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget for all parts (default 330)")
    p.add_argument("--steps", type=int, default=20, help="timed decoder steps after 3 warm-up steps (dry: 2)")
    p.add_argument("--gemm-reps", type=int, default=20, help="interleaved GEMM samples per variant (dry: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split-compile",
        action="store_true",
        help="decoder parts also time step.lower() and .compile() apart after jax.clear_caches() (recompiles)",
    )
    p.add_argument("--no-fp8-check", action="store_true", help="skip the decoder parts' FP8 check (a recompile)")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="persistent compilation cache for decoder:fp8ax and decoder-warm:fp8ax (default: a fresh temporary one)",
    )
    p.add_argument("--no-cache", action="store_true", help="no persistent cache, no decoder-warm part")
    p.add_argument(
        "--xla-flags-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="XLA flags that a part suffixed @NAME adds to XLA_FLAGS (repeatable; @triton is predefined: "
        "--xla_gpu_enable_triton_gemm=true, XLA's default)",
    )
    p.add_argument(
        "--base-xla-flags",
        default="--xla_gpu_enable_triton_gemm=false",
        help="XLA flags every part adds to XLA_FLAGS before its own (default: no Triton GEMMs, the setting "
        "docs/gpu.md recommends; with XLA's Triton GEMMs the fp8ax decoder alone compiles for minutes). "
        "'' for XLA's defaults",
    )
    p.add_argument("--autotune-log-dir", default=None, help="parts write XLA's autotuning logs to DIR/<part>.textproto")
    p.add_argument(
        "--part-timeout", action="append", default=[], metavar="PART=SECONDS", help="override a part's time limit"
    )
    p.add_argument(
        "--min-start", action="append", default=[], metavar="PART=SECONDS", help="override the least time to start"
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when an FP8 check fails")
    # The child's arguments (set by the parent).
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lines", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.flag_variants = {
        "triton": "--xla_gpu_enable_triton_gemm=true",
        **_pairs(args.xla_flags_variant, "--xla-flags-variant"),
    }
    args.part_timeouts = _pairs(args.part_timeout, "--part-timeout", float)
    args.min_start = _pairs(args.min_start, "--min-start", float)
    if args.steps < 1 or args.gemm_reps < 1:
        p.error("--steps and --gemm-reps must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
