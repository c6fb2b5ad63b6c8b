"""bench/gpu_train.py's GEMM parts: single GEMMs through bench/gpu.py's layer, and the
grouped GEMM of a mixture of experts."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from _harness import block as _block
from _train_parts import DRY_DIVISOR, GEMM_PASSES, GEMM_SHAPES, GEMM_VARIANTS, MOE_FULL
from _train_record import Recorder, _compiled_text, error_info, fp8_check


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
    import _gpu_models as gpu  # (imports fp8ax: in the part only, as the imports below)
    import fp8ax

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
    import _gpu_models as gpu

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
    _time_variants(args, rec, calls, variants, flops)


def _time_variants(args, rec: Recorder, calls, variants: dict[str, dict[str, Any]], flops: float) -> None:
    """Times the compiled `calls` interleaved (bench/gpu.py's `time_interleaved`) into
    `variants`, with their rates for `flops`, and records them."""
    from _gpu_measure import time_interleaved

    timed = time_interleaved(
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
    import gpu_hlo

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
    import gpu_hlo

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
    _time_variants(args, rec, calls, variants, useful)
