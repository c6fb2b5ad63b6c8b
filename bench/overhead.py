"""Overhead of FP8 training with fp8ax vs Haliax's own FP8, on a Haliax MLP.

Measures, for a model `Embed -> Mlp -> Embed` built from two `haliax.nn.Linear` layers
(GELU in between), trained with mean squared error:

- the jitted train-step time (median over interleaved rounds) of three variants:
    * ``plain``   -- no FP8;
    * ``fp8ax``   -- ``fp8ax.fp8_linear_layers(model)``;
    * ``haliax``  -- ``haliax.quantization.quantize_linear_layers(model, QuantizationConfig(fp8=True))``;
- the compile time of each step: ``eqx.filter_jit(step).lower(...)`` (trace + lower) and
  ``.compile()`` (XLA), each after ``jax.clear_caches()``, median of a few, and the
  Python function calls that one ``.lower(...)`` makes (``cProfile``; the same in every run);
- the StableHLO op count of each step (``.lower(...).as_text()``) and what each
  converted layer adds to it relative to the plain step (see `count_ops` for exactly
  what is counted), plus the instruction count of the optimized HLO;

for float32 and for bfloat16 parameters and inputs. Prints a table and writes JSON.

On the CPU backend FP8 is emulated (XLA upcasts the FP8 operands before the dot), so
CPU step-time ratios measure the overhead of scaling/casting/bookkeeping, not GPU FP8
GEMM speed.

Run::

    python bench/overhead.py                 # full default run (spec sizes)
    python bench/overhead.py --quick         # tiny smoke config (~15 s), writes *_quick.json
    python bench/overhead.py --dtypes float32 --rounds 30 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import json
import os
import platform
import pstats
import re
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

import fp8ax

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "overhead_cpu.json"
QUICK_OUT = HERE / "results" / "overhead_cpu_quick.json"

VARIANTS = ("plain", "fp8ax", "fp8ax-cal", "haliax")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


# --------------------------------------------------------------------------------------
# Model and data


class Mlp(eqx.Module):
    """Embed -> Mlp -> Embed, two `haliax.nn.Linear` layers with a GELU between them."""

    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Hidden: hax.Axis, *, key) -> Mlp:
        k_up, k_down = jax.random.split(key)
        return Mlp(
            up=hnn.Linear.init(In=Embed, Out=Hidden, key=k_up),
            down=hnn.Linear.init(In=Hidden, Out=Embed, key=k_down),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        return self.down(hnn.gelu(self.up(x)))


def loss_fn(model: Mlp, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.sgd(lr)
    if name == "adam":
        return optax.adam(lr)
    raise ValueError(f"unknown optimizer {name!r}")


# --------------------------------------------------------------------------------------
# Train steps, one per variant. Same structure; only the partition/apply helpers differ.


def make_step(variant: str, opt: optax.GradientTransformation) -> Callable:
    if variant == "haliax":
        partition, apply = haxq.partition_for_grad_overwrite, haxq.apply_updates
    else:
        # For `plain` there is no FP8 state: the partition returns an all-None
        # `overwrite` and `apply_updates` is `param + update`.
        partition, apply = fp8ax.partition_for_grad_overwrite, fp8ax.apply_updates

    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        overwrite, grads = partition(grads)
        _, params = partition(model)
        updates, opt_state = opt.update(grads, opt_state, params=eqx.filter(params, eqx.is_inexact_array))
        model = apply(model, updates, overwrite)
        return model, opt_state

    return eqx.filter_jit(step)


def opt_params(model, variant: str):
    """What the optimizer state is built from: the arrays of `model` as the partition
    leaves them (fp8ax: the FP8 state as zeros; Haliax: removed)."""
    partition = haxq.partition_for_grad_overwrite if variant == "haliax" else fp8ax.partition_for_grad_overwrite
    _, params = partition(model)
    return eqx.filter(params, eqx.is_inexact_array)


def build_model(variant: str, base: Mlp, dtype, batch=None) -> Mlp:
    if variant == "plain":
        return fp8ax.cast_floating(base, dtype)
    if variant == "fp8ax":
        return fp8ax.cast_floating(fp8ax.fp8_linear_layers(base), dtype)
    if variant == "fp8ax-cal":
        # Histories filled by `fp8ax.calibrate` on one batch: the same one program as
        # `fp8ax`, whose first step then takes its scales from the histories.
        return fp8ax.calibrate(build_model("fp8ax", base, dtype), loss_fn, [batch])
    if variant == "haliax":
        # Cast first: Haliax's Fp8DotGeneralOp state must stay float32, and a blanket
        # cast of the quantized model would cast it too.
        cast = fp8ax.cast_floating(base, dtype)
        return haxq.quantize_linear_layers(cast, haxq.QuantizationConfig(fp8=True))
    raise ValueError(variant)


def count_fp8_layers(model) -> int:
    leaves = jax.tree_util.tree_leaves(
        model, is_leaf=lambda x: isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp)
    )
    return sum(isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp) for x in leaves)


def fp8_state_dtypes(model) -> list[str]:
    """dtypes of the FP8 state leaves (checks that the bf16 cast left them float32)."""
    out = set()
    for node in jax.tree_util.tree_leaves(
        model, is_leaf=lambda x: isinstance(x, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp)
    ):
        if isinstance(node, fp8ax.Fp8DotGeneral | haxq.Fp8DotGeneralOp):
            out.update(str(a.dtype) for a in jax.tree_util.tree_leaves(node) if eqx.is_array(a))
    return sorted(out)


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


# --------------------------------------------------------------------------------------
# Benchmark


def machine_info() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        commit = None
    try:
        # Uncommitted changes to the library itself (the benchmark measures the working tree).
        dirty = subprocess.run(
            ["git", "-C", str(HERE.parent), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        dirty = [line.strip() for line in dirty if line.strip()]
    except Exception:
        dirty = None
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import equinox
    import haliax

    return {
        "devices": [repr(d) for d in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        "equinox_version": equinox.__version__,
        "haliax_version": getattr(haliax, "__version__", None) or _dist_version("haliax"),
        "optax_version": optax.__version__,
        "fp8ax_version": fp8ax.__version__,
        "fp8ax_git_commit": commit,
        "fp8ax_src_uncommitted_changes": dirty,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _dist_version(name: str):
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _jaxlib_version():
    return _dist_version("jaxlib")


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


def run_dtype(args, dtype_name: str, log) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    Batch = hax.Axis("batch", args.batch)
    Embed = hax.Axis("embed", args.embed)
    Hidden = hax.Axis("mlp", args.hidden)
    k_model, k_x, k_y = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    base = Mlp.init(Embed, Hidden, key=k_model)
    x = hax.random.normal(k_x, (Batch, Embed)).astype(dtype)
    y = hax.random.normal(k_y, (Batch, Embed)).astype(dtype)
    opt = make_optimizer(args.optimizer, args.lr)

    variants = [v for v in VARIANTS if v in args.variants]
    states, steps, info = {}, {}, {}
    for v in variants:
        model = build_model(v, base, dtype, (x, y))
        opt_state = opt.init(opt_params(model, v))
        states[v] = (model, opt_state)
        steps[v] = make_step(v, opt)
        info[v] = {"fp8_layers": count_fp8_layers(model), "fp8_state_dtypes": fp8_state_dtypes(model)}

    # ---- lowering, op counts and compile time (interleaved, median of compile_reps) ----
    # Rep 0 is untimed: it absorbs one-time costs (first tracing of jnp/haliax helpers,
    # LLVM start-up) and gives the op counts. The order of the variants rotates per rep.
    lower_s = {v: [] for v in variants}
    compile_s = {v: [] for v in variants}
    for rep in range(args.compile_reps + 1):
        for v in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            model, opt_state = states[v]
            # Drop JAX's in-memory tracing/lowering/executable caches, so every rep
            # traces, lowers and compiles from scratch.
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = steps[v].lower(model, opt_state, x, y)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            if rep > 0:
                lower_s[v].append(t1 - t0)
                compile_s[v].append(t2 - t1)
            else:
                text = lowered.as_text()
                ops = count_ops(text)
                hlo = count_hlo(compiled.compiled.as_text())
                info[v].update(
                    stablehlo_ops=stablehlo_total(ops["textual"]),
                    stablehlo_ops_inlined=stablehlo_total(ops["inlined"]),
                    calls=ops["calls"],
                    private_funcs=ops["private_funcs"],
                    hlo_instructions_total=hlo["total"],
                    hlo_instructions_entry=hlo["entry"],
                    hlo_entry_kernels=hlo["kernels"],
                    op_counts=dict(ops["textual"].most_common()),
                    op_counts_inlined=dict(ops["inlined"].most_common()),
                )
                if args.dump_dir:
                    d = Path(args.dump_dir)
                    d.mkdir(parents=True, exist_ok=True)
                    (d / f"{v}_{dtype_name}.stablehlo.mlir").write_text(text)
                    (d / f"{v}_{dtype_name}.optimized.hlo").write_text(compiled.compiled.as_text())
    for v in variants:
        total = [a + b for a, b in zip(lower_s[v], compile_s[v])]
        info[v]["lower_compile_s_median"] = statistics.median(total)
        info[v]["lower_s_median"] = statistics.median(lower_s[v])
        info[v]["compile_s_median"] = statistics.median(compile_s[v])
        info[v]["lower_s_all"] = lower_s[v]
        info[v]["compile_s_all"] = compile_s[v]
        info[v]["lower_python_calls"] = lower_python_calls(steps[v], *states[v], x, y)

    # ---- warm-up (first call compiles through the jit cache) ----
    for v in variants:
        for _ in range(args.warmup):
            states[v] = jax.block_until_ready(steps[v](*states[v], x, y))

    # ---- timed rounds, interleaved; the order rotates each round ----
    times = {v: [] for v in variants}
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for v in order:
            t0 = time.perf_counter()
            states[v] = jax.block_until_ready(steps[v](*states[v], x, y))
            times[v].append(time.perf_counter() - t0)
    rounds_wall = time.perf_counter() - t_start

    for v in variants:
        info[v]["step_s_median"] = statistics.median(times[v])
        info[v]["step_s_min"] = min(times[v])
        if len(times[v]) >= 4:
            q = statistics.quantiles(times[v], n=4)
            info[v]["step_s_p25"], info[v]["step_s_p75"] = q[0], q[2]
        info[v]["step_s_all"] = times[v]
        loss = loss_fn(states[v][0], x, y)
        info[v]["final_loss"] = float(loss)

    # ---- ratios vs plain ----
    if "plain" in info:
        p = info["plain"]
        for v in variants:
            if v == "plain":
                continue
            n = max(info[v]["fp8_layers"], 1)
            info[v]["vs_plain"] = {
                "step_ratio": info[v]["step_s_median"] / p["step_s_median"],
                "compile_ratio": info[v]["lower_compile_s_median"] / p["lower_compile_s_median"],
                "xla_compile_ratio": info[v]["compile_s_median"] / p["compile_s_median"],
                "lower_ratio": info[v]["lower_s_median"] / p["lower_s_median"],
                "stablehlo_ops_added_per_layer": (info[v]["stablehlo_ops"] - p["stablehlo_ops"]) / n,
                "stablehlo_ops_inlined_added_per_layer": (info[v]["stablehlo_ops_inlined"] - p["stablehlo_ops_inlined"])
                / n,
                "hlo_entry_instructions_added_per_layer": (
                    info[v]["hlo_instructions_entry"] - p["hlo_instructions_entry"]
                )
                / n,
                "hlo_entry_kernels_added_per_layer": (info[v]["hlo_entry_kernels"] - p["hlo_entry_kernels"]) / n,
                "hlo_total_instructions_added_per_layer": (
                    info[v]["hlo_instructions_total"] - p["hlo_instructions_total"]
                )
                / n,
                "op_kinds_added_per_layer_inlined": _diff_counts(
                    info[v]["op_counts_inlined"], p["op_counts_inlined"], n
                ),
                "op_kinds_added_per_layer_textual": _diff_counts(info[v]["op_counts"], p["op_counts"], n),
            }
    log(f"  [{dtype_name}] {args.rounds} rounds took {rounds_wall:.1f}s")
    return {"variants": info, "rounds_wall_s": rounds_wall}


def _diff_counts(a: dict, b: dict, n: int) -> dict[str, float]:
    keys = set(a) | set(b)
    d = {k: (a.get(k, 0) - b.get(k, 0)) / n for k in keys}
    return dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: (-kv[1], kv[0])))


def print_table(results: dict, out=sys.stdout):
    hdr = (
        f"{'dtype':<9} {'variant':<9} {'step ms':>9} {'x plain':>7} {'compile s':>9} {'x plain':>7} "
        f"{'SHLO ops':>8} {'+/layer':>8} {'inlined':>7} {'+/layer':>8} {'HLO entry':>9} {'+/layer':>8} "
        f"{'kernels':>7} {'+/layer':>8}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)

    def fmt(vp, key, spec, default):
        return format(vp[key], spec) if vp else default

    for dtype_name, res in results.items():
        for v, i in res["variants"].items():
            vp = i.get("vs_plain")
            one, dash = ("1", "-") if v == "plain" else ("n/a", "n/a")
            print(
                f"{dtype_name:<9} {v:<9} {i['step_s_median'] * 1e3:>9.2f} "
                f"{fmt(vp, 'step_ratio', '.3f', one):>7} "
                f"{i['lower_compile_s_median']:>9.3f} {fmt(vp, 'compile_ratio', '.2f', one):>7} "
                f"{i['stablehlo_ops']:>8d} {fmt(vp, 'stablehlo_ops_added_per_layer', '+.1f', dash):>8} "
                f"{i['stablehlo_ops_inlined']:>7d} {fmt(vp, 'stablehlo_ops_inlined_added_per_layer', '+.1f', dash):>8} "
                f"{i['hlo_instructions_entry']:>9d} {fmt(vp, 'hlo_entry_instructions_added_per_layer', '+.1f', dash):>8} "
                f"{i['hlo_entry_kernels']:>7d} {fmt(vp, 'hlo_entry_kernels_added_per_layer', '+.1f', dash):>8}",
                file=out,
            )
    print(
        "\ncompile s: trace+lower+XLA compile of the step (median).\n"
        "SHLO ops: `stablehlo.*` op lines in Lowered.as_text() (private funcs counted once); inlined: the same "
        "with every `call` expanded;\nHLO entry: instructions in the ENTRY computation of the optimized HLO "
        "(~ kernels that run); kernels: the same less parameter/constant/tuple/get-tuple-element/bitcast.\n"
        "+/layer: (variant - plain) / number of FP8 layers.\n",
        file=out,
    )
    for dtype_name, res in results.items():
        for v, i in res["variants"].items():
            vp = i.get("vs_plain")
            if not vp:
                continue
            top = list(vp["op_kinds_added_per_layer_inlined"].items())[:10]
            s = ", ".join(f"{k.removeprefix('stablehlo.')} {c:+g}" for k, c in top)
            print(f"{dtype_name:<9} {v:<7} top op kinds added per layer (inlined): {s}", file=out)
    print(file=out)
    for dtype_name, res in results.items():
        vs = res["variants"]
        for name in ("fp8ax", "fp8ax-cal"):
            if name not in vs or "haliax" not in vs:
                continue
            f, h = vs[name], vs["haliax"]
            print(
                f"{dtype_name:<9} {name} / haliax: step {f['step_s_median'] / h['step_s_median']:.3f}x, "
                f"compile {f['lower_compile_s_median'] / h['lower_compile_s_median']:.2f}x "
                f"(lower {f['lower_s_median'] / h['lower_s_median']:.2f}x, XLA {f['compile_s_median'] / h['compile_s_median']:.2f}x; "
                f"Python calls to lower {f['lower_python_calls'] / 1e3:.0f}k vs {h['lower_python_calls'] / 1e3:.0f}k), "
                f"StableHLO ops {f['stablehlo_ops'] / h['stablehlo_ops']:.2f}x "
                f"(inlined {f['stablehlo_ops_inlined'] / h['stablehlo_ops_inlined']:.2f}x)",
                file=out,
            )
            fp, hp = f.get("vs_plain"), h.get("vs_plain")
            if fp and hp:
                print(
                    f"{'':<9} per converted layer: kernels added "
                    f"{fp['hlo_entry_kernels_added_per_layer']:+.1f} vs {hp['hlo_entry_kernels_added_per_layer']:+.1f} "
                    f"({fp['hlo_entry_kernels_added_per_layer'] / hp['hlo_entry_kernels_added_per_layer']:.2f}x), "
                    f"entry instructions {fp['hlo_entry_instructions_added_per_layer']:+.1f} vs "
                    f"{hp['hlo_entry_instructions_added_per_layer']:+.1f}; step overhead vs plain "
                    f"{fp['step_ratio']:.3f} vs {hp['step_ratio']:.3f}",
                    file=out,
                )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, each runs every variant once (default 50)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 256)")
    p.add_argument("--embed", type=int, default=None, help="Embed axis size (default 1024)")
    p.add_argument("--hidden", type=int, default=None, help="Mlp axis size (default 4096)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per variant before timing (default 3)")
    p.add_argument(
        "--compile-reps", type=int, default=None, help="timed compiles per variant, after one untimed (default 5)"
    )
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke config: embed 64, hidden 128, batch 16, rounds 3")
    p.add_argument(
        "--out",
        default=None,
        help=f"JSON output path (default {DEFAULT_OUT.relative_to(HERE.parent)}; "
        f"with --quick {QUICK_OUT.relative_to(HERE.parent)}); '' for none",
    )
    p.add_argument("--dump-dir", default=None, help="also write each step's StableHLO and optimized HLO here")
    args = p.parse_args(argv)

    defaults = dict(rounds=50, batch=256, embed=1024, hidden=4096, warmup=3, compile_reps=5)
    quick = dict(rounds=3, batch=16, embed=64, hidden=128, warmup=1, compile_reps=1)
    for k, v in (quick if args.quick else defaults).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = str(QUICK_OUT if args.quick else DEFAULT_OUT)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r}; choose from {sorted(DTYPES)}")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {VARIANTS}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.compile_reps < 1:
        p.error("--compile-reps must be >= 1")
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the first call compiles)")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    jax.config.update("jax_enable_compilation_cache", False)  # no persistent cache hits
    load_before = _loadavg()
    t0 = time.perf_counter()
    log(
        f"fp8ax overhead benchmark: batch {args.batch}, embed {args.embed}, hidden {args.hidden}, "
        f"rounds {args.rounds}, dtypes {args.dtypes}, optimizer {args.optimizer}, backend {jax.default_backend()}"
    )
    results = {}
    for d in args.dtypes:
        log(f"running {d} ...")
        results[d] = run_dtype(args, d, log)
    total = time.perf_counter() - t0

    print_table(results)
    payload = {
        "benchmark": "bench/overhead.py",
        "machine": machine_info(),
        "config": {
            "batch": args.batch,
            "embed": args.embed,
            "hidden": args.hidden,
            "fp8_layers": 2,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "compile_reps": args.compile_reps,
            "dtypes": args.dtypes,
            "variants": args.variants,
            "optimizer": args.optimizer,
            "lr": args.lr,
            "seed": args.seed,
            "quick": args.quick,
            "model": "Mlp: hnn.Linear(Embed->Mlp) -> gelu -> hnn.Linear(Mlp->Embed), MSE loss",
            "step": "eqx.filter_jit(filter_grad -> partition_for_grad_overwrite -> optax update -> apply_updates)",
            "timing": "per round each variant runs one step in turn (order rotates each round), "
            "jax.block_until_ready; median over rounds",
            "compile_time": "wall time of eqx.filter_jit(step).lower(...) (trace+lower) and of .compile() (XLA), "
            "after jax.clear_caches(); lower_compile_s = their sum; medians over compile_reps; "
            "compile_ratio uses lower_compile_s, xla_compile_ratio only .compile()",
            "op_count": "stablehlo_ops: lines of Lowered.as_text() whose op name starts with 'stablehlo.' "
            "(with or without a result, stablehlo.return included; a private func such as @_where or @clip "
            "counted once however often it is called); stablehlo_ops_inlined: the same with every `call` "
            "replaced by the callee's ops; hlo_instructions_total/entry: instructions of Compiled.as_text() "
            "(optimized, post-fusion HLO) in all computations / in the ENTRY computation; "
            "*_added_per_layer = (variant - plain) / fp8_layers",
        },
        "total_wall_s": total,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "results": results,
    }
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {out}")
    log(f"total wall time {total:.1f}s")
    return payload


if __name__ == "__main__":
    main()
