"""bench/gpu.py's measurements: the shapes, the interleaved timing, the single GEMMs and
the MLP block's train step."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax

import _harness
import fp8ax
from _gpu_check import fp8_check, report_dict
from _gpu_models import (
    GemmLayer,
    MlpBlock,
    build_mlp,
    count_fp8_layers,
    gemm_function,
    gemm_loss,
    make_dot_general,
    make_mlp_step,
    opt_params,
)

VARIANTS = ("bf16", "fp8ax_direct", "fp8ax_qdq", "haliax_fp8")
FP8_VARIANTS = VARIANTS[1:]

DRY_DIVISOR = 64  # the dry pass divides every size by this


@dataclasses.dataclass(frozen=True)
class Shape:
    """A linear layer's GEMM: ``x[m, k] @ w[n, k].T -> y[m, n]``."""

    name: str
    m: int  # tokens (rows of x)
    k: int  # in features
    n: int  # out features
    note: str

    def scaled(self, divisor: int) -> Shape:
        return dataclasses.replace(self, m=self.m // divisor, k=self.k // divisor, n=self.n // divisor)


SHAPES = (
    Shape("square_4096", 4096, 4096, 4096, "M = K = N = 4096"),
    Shape("square_8192", 8192, 8192, 8192, "M = K = N = 8192"),
    Shape("square_16384", 16384, 16384, 16384, "M = K = N = 16384"),
    Shape("llama3_8b_mlp_up", 8192, 4096, 14336, "8192 tokens, hidden 4096 -> MLP 14336 (Llama-3 8B up/gate)"),
    Shape("llama3_8b_mlp_down", 8192, 14336, 4096, "8192 tokens, MLP 14336 -> hidden 4096 (Llama-3 8B down)"),
    Shape("llama3_70b_mlp_up", 8192, 8192, 28672, "8192 tokens, hidden 8192 -> MLP 28672 (Llama-3 70B up/gate)"),
)
SHAPE_NAMES = tuple(s.name for s in SHAPES)

PASSES = {"fwd": 1, "fwd_bwd": 3}  # GEMMs per pass of one linear layer

MLP_DEFAULTS = dict(tokens=8192, hidden=4096, mlp=14336)
MLP_DRY = {k: v // DRY_DIVISOR for k, v in MLP_DEFAULTS.items()}


# --------------------------------------------------------------------------------------
# Timing


def time_interleaved(
    calls: dict[str, Callable[[], Any]], *, reps: int, warmup: int, inner: int, target_s: float, max_inner: int = 200
) -> dict[str, dict[str, Any]]:
    """Times each ``calls[v]()`` (which returns something to block on), interleaved.

    After ``warmup`` blocked calls each, one more blocked call estimates the time of a call;
    with ``inner == 0`` a sample then runs ``ceil(target_s / estimate)`` calls back to back
    (at most ``max_inner``) and blocks once, so that launch and sync latency do not count
    against short GEMMs; otherwise ``inner`` calls. Each round runs one sample of every
    variant, the order rotating per round. Times are per call. A variant whose warm-up
    raises (out of memory, say) gets ``{"error": ...}`` instead of timings.
    """
    failed, n_inner = {}, {}
    for v in list(calls):
        try:
            for _ in range(warmup):
                jax.block_until_ready(calls[v]())
            t0 = time.perf_counter()
            jax.block_until_ready(calls[v]())
            est = time.perf_counter() - t0
        except Exception as e:
            failed[v] = {"error": f"{type(e).__name__}: {e}"}
            continue
        n_inner[v] = inner if inner > 0 else max(1, min(max_inner, math.ceil(target_s / max(est, 1e-9))))
    names = list(n_inner)
    times = {v: [] for v in names}
    for r in range(reps if names else 0):
        for v in names[r % len(names) :] + names[: r % len(names)]:
            out = None
            t0 = time.perf_counter()
            for _ in range(n_inner[v]):
                out = calls[v]()
            jax.block_until_ready(out)
            times[v].append((time.perf_counter() - t0) / n_inner[v])
            del out
    return {**failed, **{v: {**_harness.stats(times[v]), "inner": n_inner[v]} for v in names}}


# --------------------------------------------------------------------------------------
# Single GEMMs


def run_gemms(args, backend: str, log) -> list[dict[str, Any]]:
    shapes = [s.scaled(DRY_DIVISOR) if args.dry else s for s in SHAPES if s.name in args.shapes]
    entries = []
    key = jax.random.PRNGKey(args.seed)
    for shape in shapes:
        kx, kw, kg, key = jax.random.split(key, 4)
        x = jax.random.normal(kx, (shape.m, shape.k), jnp.bfloat16)
        w = (jax.random.normal(kw, (shape.n, shape.k), jnp.float32) / math.sqrt(shape.k)).astype(jnp.bfloat16)
        g = jax.random.normal(kg, (shape.m, shape.n), jnp.bfloat16)
        for pass_name, n_gemms in PASSES.items():
            flops = 2.0 * shape.m * shape.n * shape.k * n_gemms
            entry = {
                "shape": shape.name,
                "pass": pass_name,
                "m": shape.m,
                "k": shape.k,
                "n": shape.n,
                "note": shape.note,
                "gemms": n_gemms,
                "flops": flops,
                "variants": {},
            }
            calls = {}
            for v in VARIANTS:
                info: dict[str, Any] = {}
                entry["variants"][v] = info
                try:
                    layer = GemmLayer(w, make_dot_general(v))
                    if v.startswith("fp8ax"):
                        # Filled histories, no first-call conditional: the lean program.
                        layer = fp8ax.calibrate(layer, gemm_loss, [(x, g)])
                    jitted, leaves = gemm_function(layer, pass_name)
                    t0 = time.perf_counter()
                    compiled = jitted.lower(leaves, x, g).compile()
                    info["compile_s"] = time.perf_counter() - t0
                    info["fp8_check"] = fp8_check(v, compiled.as_text(), n_gemms, backend)
                    t0 = time.perf_counter()
                    info["gemm_report"] = report_dict(fp8ax.gemm_report(jitted, leaves, x, g))
                    info["gemm_report_s"] = time.perf_counter() - t0
                    calls[v] = lambda c=compiled, a=leaves: c(a, x, g)
                except Exception as e:  # keep going: one broken variant should not hide the others
                    info["error"] = f"{type(e).__name__}: {e}"
                    log(f"  {shape.name} {pass_name} {v}: ERROR {info['error']}")
            timed = time_interleaved(
                calls, reps=args.reps, warmup=args.warmup, inner=args.inner, target_s=args.sample_s
            )
            for v, t in timed.items():
                entry["variants"][v].update(t)
            _add_rates(entry["variants"], flops)
            entries.append(entry)
            log(
                f"  {shape.name} ({shape.m}x{shape.k} -> {shape.n}) {pass_name}: "
                + ", ".join(
                    f"{v} {i['median_s'] * 1e3:.3f} ms" for v, i in entry["variants"].items() if "median_s" in i
                )
            )
            del calls
    return entries


def _add_rates(variants: dict[str, dict[str, Any]], flops: float) -> None:
    base = variants.get("bf16", {}).get("median_s")
    for info in variants.values():
        if "median_s" not in info:
            continue
        info["tflops"] = flops / info["median_s"] / 1e12
        info["speedup_vs_bf16"] = base / info["median_s"] if base else None


# --------------------------------------------------------------------------------------
# MLP block train step


def run_mlp(args, backend: str, log) -> dict[str, Any]:
    Batch, Embed, Mlp = hax.Axis("batch", args.tokens), hax.Axis("embed", args.hidden), hax.Axis("mlp", args.mlp)
    k_model, k_x, k_y = jax.random.split(jax.random.PRNGKey(args.seed + 1), 3)
    base = eqx.filter_jit(MlpBlock.init)(Embed, Mlp, key=k_model)  # one compile instead of many eager ops
    x = hax.named(jax.random.normal(k_x, (Batch.size, Embed.size), jnp.bfloat16), (Batch, Embed))
    y = hax.named(jax.random.normal(k_y, (Batch.size, Embed.size), jnp.bfloat16), (Batch, Embed))
    opt = optax.adam(args.lr) if args.optimizer == "adam" else optax.sgd(args.lr)
    # 5 GEMMs of 2*tokens*hidden*mlp FLOPs: forward and weight gradient of both layers, and the
    # input gradient of `down` (that of `up` is not computed: x is data, not a parameter).
    n_gemms = 5
    flops = 2.0 * args.tokens * args.hidden * args.mlp * n_gemms

    variants: dict[str, dict[str, Any]] = {}
    states, calls = {}, {}
    for v in VARIANTS:
        info: dict[str, Any] = {}
        variants[v] = info
        try:
            model = build_mlp(v, base, (x, y))
            opt_state = opt.init(opt_params(model, v))
            info["fp8_layers"] = count_fp8_layers(model)
            step = make_mlp_step(v, opt)
            t0 = time.perf_counter()
            compiled = step.lower(model, opt_state, x, y).compile()
            info["compile_s"] = time.perf_counter() - t0
            expected = max(3 * info["fp8_layers"] - 1, 0)  # 3 per FP8 layer, less `up`'s input gradient
            info["fp8_check"] = fp8_check(v, compiled.compiled.as_text(), expected, backend)
            t0 = time.perf_counter()
            info["gemm_report"] = report_dict(fp8ax.gemm_report(step, model, opt_state, x, y))
            info["gemm_report_s"] = time.perf_counter() - t0
            states[v] = (model, opt_state)

            def call(v=v, compiled=compiled):
                states[v] = compiled(*states[v], x, y)
                return states[v]

            calls[v] = call
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
            log(f"  mlp {v}: ERROR {info['error']}")
    for v, t in time_interleaved(calls, reps=args.reps, warmup=args.warmup, inner=1, target_s=0.0).items():
        variants[v].update(t)
    _add_rates(variants, flops)
    log("  mlp step: " + ", ".join(f"{v} {i['median_s'] * 1e3:.3f} ms" for v, i in variants.items() if "median_s" in i))
    return {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "mlp": args.mlp,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "gemms": n_gemms,
        "flops": flops,
        "variants": variants,
    }
