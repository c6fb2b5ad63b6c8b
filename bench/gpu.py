"""FP8 GEMM and MLP-block speed on a GPU: bf16 vs fp8ax (direct, qdq) vs Haliax's own FP8.

One command measures, on the first JAX device:

- **single GEMMs**, ``y = x @ w.T`` as a linear layer computes it (``x``: tokens x in
  features, ``w``: out features x in features, the layout of ``haliax.nn.Linear`` and
  ``eqx.nn.Linear``), at square sizes 4096, 8192 and 16384 and at the MLP shapes of
  Llama-3 8B and 70B. Each shape is timed forward only (1 GEMM) and forward plus
  backward (``eqx.filter_value_and_grad`` of ``sum(y * g)`` with respect to the layer and
  ``x``: 3 GEMMs, forward, input gradient and weight gradient);
- **a transformer MLP block train step** (``haliax.nn.Linear`` up, GELU,
  ``haliax.nn.Linear`` down, no biases, bf16 parameters via ``fp8ax.cast_floating``,
  mean squared error, optax Adam or SGD, ``eqx.filter_jit`` step with
  ``fp8ax.partition_for_grad_overwrite`` / ``fp8ax.apply_updates`` as in
  ``bench/overhead.py``);

in four variants:

- ``bf16``          -- plain ``lax.dot_general`` on bf16 operands (bf16 result; XLA
  accumulates in float32, as for ``jnp.matmul``);
- ``fp8ax_direct``  -- ``fp8ax.Fp8DotGeneral.init(mode="direct")``
  (``fp8ax.Fp8Config(mode="direct")`` for the MLP block);
- ``fp8ax_qdq``     -- ``fp8ax.Fp8DotGeneral.init(mode="qdq")``;
  both fp8ax variants are run through ``fp8ax.calibrate`` on the timed data first, so the
  timed program is pure delayed scaling (no first-call conditional);
- ``haliax_fp8``    -- ``haliax.quantization.Fp8DotGeneralOp.init()``
  (``quantize_linear_layers(model, QuantizationConfig(fp8=True))`` for the MLP block);

and reports the median time (and quartiles), TFLOP/s (2*M*N*K per GEMM) and the
speed-up over bf16.

It also checks that every GEMM an FP8 variant should run in FP8 compiled to an FP8 GEMM,
on either path XLA:GPU's autotuner may pick: it counts, in the optimized HLO
(``jitted.lower(...).compile().as_text()``, read by bench/gpu_hlo.py), the FP8 cuBLASLt
calls (``custom_call_target`` ``__cublas$lt$matmul$f8``; bf16 ones are ``__cublas$gemm``
or ``__cublas$lt$matmul``) and the Triton or cuDNN GEMM fusions whose dot multiplies FP8
values, and compares the count with the GEMMs the function has: 1 forward, 3
forward+backward, 5 in the MLP train step (3 per layer, less the input gradient of the
first layer, which nothing needs: the input is data). ``gemm_paths`` in the JSON says
which path each GEMM took and the dtype it writes. ``fp8ax.gemm_report`` of the same function goes in the JSON too.

Without a GPU (``jax.default_backend() != "gpu"``), or with ``--dry``, it runs the same
code on tiny shapes (every size divided by 64) with 1 warm-up and 2 reps: a smoke test of
the script (about 25 s on a 2-core CPU), whose timings mean nothing. The FP8 check then reads "n/a on cpu". On a
GPU, a failed FP8 check (or a variant that errors) makes the exit status 1, after
everything has been printed and written.

Run::

    python bench/gpu.py                          # full run; writes bench/results/gpu_<device>.json
    python bench/gpu.py --dry                    # tiny shapes, ~25 s on a CPU; bench/results/gpu_dry_<backend>.json
    python bench/gpu.py --shapes square_8192,llama3_8b_mlp_up --skip-mlp --reps 50
    python bench/gpu.py --skip-gemm --tokens 16384 --hidden 8192 --mlp 28672
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import haliax.quantization as haxq
import jax
import jax.numpy as jnp
import optax
from jax import lax

import fp8ax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_hlo  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

VARIANTS = ("bf16", "fp8ax_direct", "fp8ax_qdq", "haliax_fp8")
FP8_VARIANTS = VARIANTS[1:]

# XLA:GPU's custom-call targets for cuBLAS(Lt) GEMMs (xla/service/gpu/cublas_cudnn.cc).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
CUBLASLT_TARGET = "__cublas$lt$matmul"
CUBLAS_GEMM_TARGET = "__cublas$gemm"

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
# Counting GEMM kernels in optimized HLO

_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_DOT_RE = re.compile(r"\sdot\(")


def count_gemm_kernels(hlo_text: str) -> dict[str, int]:
    """Counts the GEMMs of an optimized HLO module (``Compiled.as_text()``) by kind.

    One instruction per line. Keys:

    - ``cublaslt_f8``: ``custom-call``s with ``custom_call_target="__cublas$lt$matmul$f8"``
      (FP8 cuBLASLt GEMMs, what an FP8 variant should compile to on a GPU);
    - ``cublaslt``: ``custom_call_target="__cublas$lt$matmul"`` (bf16/f32 cuBLASLt);
    - ``cublas_gemm``: ``custom_call_target="__cublas$gemm"`` (bf16/f32 cuBLAS);
    - ``other_gemm_custom_call``: any other custom call whose target names a GEMM/matmul;
    - ``triton_gemm``: fusions XLA emits as Triton GEMMs (``"kind":"__triton_gemm"``);
    - ``cudnn_fusion``: fusions run by cuDNN (``"kind":"__cudnn$fusion"``, usually GEMMs);
    - ``dot``: plain ``dot(`` instructions (what a CPU runs; on a GPU, dots inside Triton
      or cuDNN fusions).
    """
    counts = dict(
        cublaslt_f8=0, cublaslt=0, cublas_gemm=0, other_gemm_custom_call=0, triton_gemm=0, cudnn_fusion=0, dot=0
    )
    for line in hlo_text.splitlines():
        if "custom-call(" in line:
            m = _TARGET_RE.search(line)
            target = m.group(1) if m else ""
            if target == FP8_GEMM_TARGET:
                counts["cublaslt_f8"] += 1
            elif target == CUBLASLT_TARGET:
                counts["cublaslt"] += 1
            elif target == CUBLAS_GEMM_TARGET:
                counts["cublas_gemm"] += 1
            elif re.search(r"gemm|matmul", target, re.IGNORECASE):
                counts["other_gemm_custom_call"] += 1
        elif '"kind":"__triton_gemm"' in line:
            counts["triton_gemm"] += 1
        elif '"kind":"__cudnn$fusion"' in line:
            counts["cudnn_fusion"] += 1
        elif _DOT_RE.search(line):
            counts["dot"] += 1
    return counts


def count_fp8_cublaslt(hlo_text: str) -> int:
    """Number of FP8 cuBLASLt GEMM custom calls (``__cublas$lt$matmul$f8``) in optimized HLO."""
    return count_gemm_kernels(hlo_text)["cublaslt_f8"]


def fp8_check(variant: str, hlo_text: str, expected: int, backend: str) -> dict[str, Any]:
    """The FP8 check of one compiled function: found vs expected FP8 GEMMs, where an FP8
    GEMM is an FP8 cuBLASLt call or a Triton/cuDNN GEMM fusion whose dot multiplies FP8
    values (bench/gpu_hlo.py); `gemm_paths` says which path each GEMM took and what it
    writes (e.g. ``"triton:fp8->bf16"``, ``"cublas:wide->bf16"``)."""
    kernels = count_gemm_kernels(hlo_text)
    program = gpu_hlo.summary(hlo_text)
    found = program["fp8_gemms"]
    if variant == "bf16":
        status = "baseline"  # nothing to check; the counts show which bf16 GEMMs ran
        expected = 0
    elif backend != "gpu":
        status = f"n/a on {backend}"
    else:
        status = "PASS" if found == expected else "FAIL"
    return {
        "target": f"{FP8_GEMM_TARGET} or a GEMM fusion on FP8 operands",
        "expected": expected,
        "found": found,
        "status": status,
        "gemm_kernels": kernels,
        "gemm_paths": program["gemm_paths"],
    }


def report_dict(report) -> dict[str, Any]:
    return {
        "lowered_fp8": report.lowered_fp8,
        "lowered_total": report.lowered_total,
        "compiled_fp8": report.compiled_fp8,
        "compiled_total": report.compiled_total,
        "all_fp8": report.all_fp8,
    }


# --------------------------------------------------------------------------------------
# Timing


def _stats(times: list[float]) -> dict[str, Any]:
    out = {"median_s": statistics.median(times), "min_s": min(times)}
    if len(times) >= 2:
        q = statistics.quantiles(times, n=4, method="inclusive")
        out["p25_s"], out["p75_s"] = q[0], q[2]
    else:
        out["p25_s"] = out["p75_s"] = times[0]
    out["all_s"] = times
    return out


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
    return {**failed, **{v: {**_stats(times[v]), "inner": n_inner[v]} for v in names}}


# --------------------------------------------------------------------------------------
# Single GEMMs

GEMM_DIMS = (((1,), (1,)), ((), ()))  # contract x's features with w's in features: x @ w.T


class PlainDotGeneral(eqx.Module):
    """``lax.dot_general`` as a module (the bf16 baseline)."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


class GemmLayer(eqx.Module):
    """A bias-free linear layer on plain arrays with a pluggable ``dot_general``."""

    weight: jax.Array  # (out features, in features)
    dot_general: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dot_general(x, self.weight, GEMM_DIMS)


def make_dot_general(variant: str):
    if variant == "bf16":
        return PlainDotGeneral()
    if variant == "fp8ax_direct":
        return fp8ax.Fp8DotGeneral.init(mode="direct")
    if variant == "fp8ax_qdq":
        return fp8ax.Fp8DotGeneral.init(mode="qdq")
    if variant == "haliax_fp8":
        return haxq.Fp8DotGeneralOp.init()
    raise ValueError(variant)


def gemm_function(layer: GemmLayer, pass_name: str):
    """A ``jax.jit`` function of (flat layer arrays, x, g) and its arguments' builder.

    The layer's arrays are passed as a flat list so that each call goes through JAX's C++
    dispatch path (no Python pytree flattening of the module per call).
    """
    dyn, static = eqx.partition(layer, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dyn)

    def rebuild(leaves):
        return eqx.combine(jax.tree.unflatten(treedef, leaves), static)

    if pass_name == "fwd":

        def fn(leaves, x, g):
            del g
            return rebuild(leaves)(x)

    else:

        def loss(layer_and_x, g):
            layer, x = layer_and_x
            return jnp.sum(layer(x) * g, dtype=jnp.float32)

        def fn(leaves, x, g):
            # Gradients for the layer and for x: forward, input-gradient and weight-gradient
            # GEMMs. The value keeps the forward GEMM alive (d loss / d y = g needs no y).
            return eqx.filter_value_and_grad(loss)((rebuild(leaves), x), g)

    return jax.jit(fn), leaves


def _gemm_loss(layer: GemmLayer, x: jax.Array, g: jax.Array) -> jax.Array:
    return jnp.sum((layer(x) * g).astype(jnp.float32))


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
                        layer = fp8ax.calibrate(layer, _gemm_loss, [(x, g)])
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


class MlpBlock(eqx.Module):
    """Embed -> Mlp -> Embed: two bias-free ``haliax.nn.Linear`` layers, GELU in between."""

    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Mlp: hax.Axis, *, key) -> MlpBlock:
        k_up, k_down = jax.random.split(key)
        return MlpBlock(
            up=hnn.Linear.init(In=Embed, Out=Mlp, key=k_up, use_bias=False),
            down=hnn.Linear.init(In=Mlp, Out=Embed, key=k_down, use_bias=False),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(hnn.gelu(self.up(x)))


def mlp_loss(model: MlpBlock, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def build_mlp(variant: str, base: MlpBlock, batch=None) -> MlpBlock:
    if variant == "bf16":
        return fp8ax.cast_floating(base, jnp.bfloat16)
    if variant in ("fp8ax_direct", "fp8ax_qdq"):
        config = fp8ax.Fp8Config(mode=variant.removeprefix("fp8ax_"))
        model = fp8ax.cast_floating(fp8ax.fp8_linear_layers(base, config), jnp.bfloat16)
        # Filled histories, no first-call conditional in the timed step (`fp8ax.calibrate`).
        return model if batch is None else fp8ax.calibrate(model, mlp_loss, [batch])
    if variant == "haliax_fp8":
        # Cast first, so that Haliax's FP8 state stays float32.
        return haxq.quantize_linear_layers(fp8ax.cast_floating(base, jnp.bfloat16), haxq.QuantizationConfig(fp8=True))
    raise ValueError(variant)


def _partition_fns(variant: str):
    if variant == "haliax_fp8":
        return haxq.partition_for_grad_overwrite, haxq.apply_updates
    return fp8ax.partition_for_grad_overwrite, fp8ax.apply_updates


def make_mlp_step(variant: str, opt: optax.GradientTransformation):
    partition, apply = _partition_fns(variant)

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(mlp_loss)(model, x, y)
        overwrite, grads = partition(grads)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes float and int32 (bias correction)
            updates, opt_state = opt.update(grads, opt_state, params=opt_params(model, variant))
        return apply(model, updates, overwrite), opt_state

    return eqx.filter_jit(step)


def opt_params(model, variant: str):
    """What the optimizer sees: the model without its FP8 state."""
    partition, _ = _partition_fns(variant)
    _, params = partition(model)
    return eqx.filter(params, eqx.is_inexact_array)


def count_fp8_layers(model) -> int:
    kinds = fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp
    return sum(isinstance(n, kinds) for n in jax.tree_util.tree_leaves(model, is_leaf=lambda n: isinstance(n, kinds)))


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


# --------------------------------------------------------------------------------------
# Report


def _fmt_check(info: dict[str, Any]) -> tuple[str, str, str]:
    if "error" in info:
        return "-", "-", "ERROR"
    c, r = info["fp8_check"], info["gemm_report"]
    found = f"{c['found']}/{c['expected']}" if c["status"] != "baseline" else f"{c['found']}"
    rep = f"{r['lowered_fp8']}/{r['lowered_total']}, {r['compiled_fp8']}/{r['compiled_total']}"
    return found, rep, "-" if c["status"] == "baseline" else c["status"]


def _fmt_time(info: dict[str, Any]) -> tuple[str, str, str, str]:
    if "median_s" not in info:
        return "-", "-", "-", "-"
    sp = info.get("speedup_vs_bf16")
    return (
        f"{info['median_s'] * 1e3:.3f}",
        f"{info['p25_s'] * 1e3:.3f}-{info['p75_s'] * 1e3:.3f}",
        f"{info['tflops']:.1f}" if info["tflops"] >= 0.1 else f"{info['tflops']:.3g}",
        f"{sp:.2f}" if sp else "-",
    )


def print_tables(payload: dict[str, Any], out=sys.stdout) -> None:
    cols = (
        "ms (median)",
        "ms (p25-p75)",
        "TFLOP/s",
        "x bf16",
        "FP8 GEMMs found/expected",
        "gemm_report lowered, compiled FP8/total",
        "FP8 check",
    )
    if payload["gemm"]:
        print("\n### Single GEMMs\n", file=out)
        print("| shape | M x K -> N | pass | variant | " + " | ".join(cols) + " |", file=out)
        print("|---|---|---|---|" + "---:|" * 4 + "---|---|---|", file=out)
        for e in payload["gemm"]:
            for v, info in e["variants"].items():
                print(
                    f"| {e['shape']} | {e['m']} x {e['k']} -> {e['n']} | {e['pass']} | {v} | "
                    + " | ".join(_fmt_time(info) + _fmt_check(info))
                    + " |",
                    file=out,
                )
    if payload["mlp"]:
        m = payload["mlp"]
        print(
            f"\n### MLP block train step (tokens {m['tokens']}, hidden {m['hidden']} -> mlp {m['mlp']} -> hidden, "
            f"bf16, {m['optimizer']})\n",
            file=out,
        )
        print("| variant | " + " | ".join(cols) + " |", file=out)
        print("|---|" + "---:|" * 4 + "---|---|---|", file=out)
        for v, info in m["variants"].items():
            print(f"| {v} | " + " | ".join(_fmt_time(info) + _fmt_check(info)) + " |", file=out)
    print(
        f'\nFP8 GEMMs: custom calls with custom_call_target="{FP8_GEMM_TARGET}" in the optimized HLO, '
        "against the GEMMs the function should run in FP8 (1 forward, 3 forward+backward, 5 in the MLP "
        "step: 3 per layer less the first layer's input gradient, which nothing needs).\ngemm_report: fp8ax.gemm_report's lowered_fp8/lowered_total, "
        "compiled_fp8/compiled_total. TFLOP/s counts 2*M*N*K per GEMM.",
        file=out,
    )


def _all_infos(payload):
    for e in payload["gemm"]:
        for v, info in e["variants"].items():
            yield f"{e['shape']} {e['pass']} {v}", info
    if payload["mlp"]:
        for v, info in payload["mlp"]["variants"].items():
            yield f"mlp {v}", info


def summarise(payload: dict[str, Any]) -> dict[str, Any]:
    backend = payload["machine"]["backend"]
    errors = [name for name, info in _all_infos(payload) if "error" in info]
    failed = [name for name, info in _all_infos(payload) if info.get("fp8_check", {}).get("status") == "FAIL"]
    passed = [name for name, info in _all_infos(payload) if info.get("fp8_check", {}).get("status") == "PASS"]
    if backend != "gpu":
        status = f"n/a on {backend}"
    else:
        status = "FAIL" if failed else "PASS"
    return {"status": status, "target": FP8_GEMM_TARGET, "passed": len(passed), "failed": failed, "errors": errors}


# --------------------------------------------------------------------------------------
# Machine information


def _dist_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], cwd=None):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=cwd, timeout=30).stdout.strip()
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    dirty = _run(["git", "status", "--porcelain", "--", "src"], cwd=HERE.parent)
    jax_dists = sorted(
        {
            f"{d.metadata['Name']}=={d.version}"
            for d in importlib.metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith(("jax", "nvidia-cublas", "nvidia-cudnn"))
        }
    )
    nvidia_smi = None
    if shutil.which("nvidia-smi"):
        nvidia_smi = _run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        )
    return {
        "device_kind": jax.devices()[0].device_kind,
        "devices": [repr(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": _dist_version("jaxlib"),
            "equinox": _dist_version("equinox"),
            "haliax": _dist_version("haliax"),
            "optax": optax.__version__,
            "fp8ax": fp8ax.__version__,
            "python": sys.version.split()[0],
            "jax_and_cuda_distributions": jax_dists,
        },
        "nvidia_smi": nvidia_smi,
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "git_commit": _run(["git", "rev-parse", "HEAD"], cwd=HERE.parent),
        "src_uncommitted_changes": dirty.splitlines() if dirty else ([] if dirty is not None else None),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


# --------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dry",
        action="store_true",
        help="tiny shapes (sizes / 64), 1 warm-up, 2 reps, even on a GPU (automatic without a GPU)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="JSON output path (default bench/results/gpu_<device kind>.json; "
        "dry pass bench/results/gpu_dry_<backend>.json); '' for none",
    )
    p.add_argument("--reps", type=int, default=None, help="timed samples per variant (default 30; dry 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant first (default 3; dry 1)")
    p.add_argument(
        "--inner",
        type=int,
        default=None,
        help="GEMM calls per timed sample, blocked once; 0 = enough for --sample-ms (default 0; dry 1)",
    )
    p.add_argument("--sample-ms", type=float, default=20.0, help="target length of one GEMM sample with --inner 0")
    p.add_argument(
        "--shapes", default=None, help=f"comma-separated subset of {', '.join(SHAPE_NAMES)}, or 'all' (default)"
    )
    p.add_argument("--skip-gemm", action="store_true", help="skip the single-GEMM benchmark")
    p.add_argument("--skip-mlp", action="store_true", help="skip the MLP-block train step")
    p.add_argument(
        "--tokens", type=int, default=None, help=f"MLP block: tokens per step (default {MLP_DEFAULTS['tokens']})"
    )
    p.add_argument(
        "--hidden", type=int, default=None, help=f"MLP block: hidden size (default {MLP_DEFAULTS['hidden']})"
    )
    p.add_argument("--mlp", type=int, default=None, help=f"MLP block: MLP size (default {MLP_DEFAULTS['mlp']})")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="MLP block optimizer (default adam)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    args.backend = jax.default_backend()
    args.no_gpu = args.backend != "gpu"
    args.dry = args.dry or args.no_gpu
    full, dry = dict(reps=30, warmup=3, inner=0), dict(reps=2, warmup=1, inner=1)
    for k, v in (dry if args.dry else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, v in (MLP_DRY if args.dry else MLP_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.shapes is None or args.shapes.strip() == "all":
        args.shapes = ",".join(SHAPE_NAMES)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in SHAPE_NAMES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPE_NAMES)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1")
    if args.inner < 0:
        p.error("--inner must be >= 0")
    for k in ("tokens", "hidden", "mlp"):
        if getattr(args, k) < 1:
            p.error(f"--{k} must be >= 1")
    args.sample_s = args.sample_ms / 1e3
    if args.out is None:
        name = f"gpu_dry_{args.backend}.json" if args.dry else f"gpu_{_slug(jax.devices()[0].device_kind)}.json"
        args.out = str(RESULTS / name)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    if args.no_gpu:
        print(
            f"No GPU found (backend: {args.backend}): running a small dry pass of the same code on "
            f"{args.backend.upper()}; no timings are meaningful",
            flush=True,
        )
    elif args.dry:
        print("--dry: running a small dry pass on the GPU (sizes / 64); the timings mean little", flush=True)
    device_kind = jax.devices()[0].device_kind
    log(
        f"fp8ax GPU benchmark on {device_kind} (backend {args.backend}){' [dry pass]' if args.dry else ''}: "
        f"reps {args.reps}, warmup {args.warmup}, inner {args.inner or 'auto'}"
    )

    gemm = [] if args.skip_gemm else run_gemms(args, args.backend, log)
    mlp = None if args.skip_mlp else run_mlp(args, args.backend, log)
    payload: dict[str, Any] = {
        "benchmark": "bench/gpu.py",
        "dry": args.dry,
        "meaningful_timings": not args.dry,
        "machine": machine_info(),
        "config": {
            "reps": args.reps,
            "warmup": args.warmup,
            "inner": args.inner,
            "sample_ms": args.sample_ms,
            "shapes": args.shapes,
            "dry_divisor": DRY_DIVISOR if args.dry else 1,
            "skip_gemm": args.skip_gemm,
            "skip_mlp": args.skip_mlp,
            "seed": args.seed,
            "variants": {
                "bf16": "lax.dot_general on bf16 operands (bf16 result, float32 accumulation)",
                "fp8ax_direct": 'fp8ax.Fp8DotGeneral.init(mode="direct") / Fp8Config(mode="direct")',
                "fp8ax_qdq": 'fp8ax.Fp8DotGeneral.init(mode="qdq") / Fp8Config(mode="qdq")',
                "haliax_fp8": "haliax.quantization.Fp8DotGeneralOp.init() / "
                "quantize_linear_layers(QuantizationConfig(fp8=True))",
            },
            "gemm": "y = x @ w.T, x (m, k) bf16, w (n, k) bf16; fwd: the layer call; fwd_bwd: "
            "eqx.filter_value_and_grad of sum(y * g) w.r.t. (layer, x), 3 GEMMs; jax.jit of the flat layer "
            "arrays; FP8 state fixed (fresh) across calls",
            "mlp_block": "hnn.Linear(embed->mlp, no bias) -> gelu -> hnn.Linear(mlp->embed, no bias), bf16 params "
            "(fp8ax.cast_floating), MSE loss; eqx.filter_jit(filter_grad -> partition_for_grad_overwrite "
            "-> optax update -> apply_updates), state threaded through the steps",
            "timing": "after warmup blocked calls, reps samples per variant, interleaved (order rotates per round); "
            "a sample runs `inner` calls back to back and blocks once (jax.block_until_ready); times per call; "
            "median and quartiles",
            "flops": "2*m*n*k per GEMM; fwd 1 GEMM, fwd_bwd 3, MLP step 5 (3 per layer, less the input gradient of the "
            "first layer, which is not computed)",
            "fp8_check": f"FP8 GEMMs in jitted.lower(...).compile().as_text(): custom calls with "
            f'custom_call_target="{FP8_GEMM_TARGET}", or Triton/cuDNN GEMM fusions whose dot '
            "multiplies FP8 values (bench/gpu_hlo.py), expected 1 (fwd), 3 (fwd_bwd), 3 per FP8 layer "
            "less the first layer's input gradient (MLP step: 5); applies only on a GPU",
        },
        "fp8_gemm_target": FP8_GEMM_TARGET,
        "gemm": gemm,
        "mlp": mlp,
    }
    payload["fp8_check"] = summarise(payload)
    payload["total_wall_s"] = time.perf_counter() - t_start

    if args.dry:
        print(f"\n**{'CPU' if args.no_gpu else 'GPU'} dry pass: tiny shapes, timings are meaningless.**", flush=True)
    print_tables(payload)
    s = payload["fp8_check"]
    print(
        f'\nFP8 cuBLASLt check (custom_call_target="{FP8_GEMM_TARGET}"): {s["status"]}'
        + (f" ({s['passed']} functions passed)" if s["status"] == "PASS" else "")
        + (f"; failed: {', '.join(s['failed'])}" if s["failed"] else "")
        + (f"; errors: {', '.join(s['errors'])}" if s["errors"] else ""),
        flush=True,
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {out}")
    log(f"total wall time {payload['total_wall_s']:.1f}s")
    return 1 if s["errors"] or s["status"] == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
