"""bench/gpu_train.py's parent process: runs each part in a process of its own under its
time limit, gathers what the parts recorded, writes the results file."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness
from _train_parts import (
    DECODER_DRY,
    DECODER_FULL,
    EXIT_GRACE_S,
    MIN_START,
    parse_parts,
    part_base,
    part_kind,
    part_limit,
    uses_cache,
)
from _train_report import print_tables, summarise

SCRIPT = _harness.HERE / "gpu_train.py"


def _merge(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


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
    slug = _harness.slug(part)
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
        name = _harness.slug(part.replace("decoder-warm", "decoder")) if cache_dir else slug
        flags.append(f"--xla_gpu_dump_autotune_logs_to={Path(args.autotune_log_dir).resolve() / name}.textproto")
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in flags if f).strip())
    result: dict[str, Any] = {"part": part, "timeout_s": round(timeout, 1), "xla_flags": env["XLA_FLAGS"]}
    t0 = time.monotonic()
    with open(log, "w") as out:
        # A new session, so that a kill takes the whole process group (XLA may run ptxas).
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=_harness.ROOT, env=env, start_new_session=True
        )
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
            args.autotune_log_dir, _harness.slug(part.replace("decoder-warm", "decoder")) if cache_dir else slug
        )
    return result


def parent_main(args, t_start: float) -> int:
    """`t_start`: when the script started (before its imports): the budget counts them too."""

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
                cache_dir = str(
                    Path(cache_root) / _harness.slug(part_base(part).split(":")[1] + "@" + part.partition("@")[2])
                )
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
    payload: dict[str, Any] = {
        "benchmark": "bench/gpu_train.py",
        "dry": dry,
        "meaningful_timings": not dry,
        "machine": {
            **machine,
            "parent_python": _harness.python_version(),
            "git_commit": _harness.git_commit(),
            "src_uncommitted_changes": _harness.src_changes(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "date": _harness.now(),
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
        name = name or f"gpu_train_{_harness.slug(machine.get('device_kind', 'unknown'))}.json"
        out = str(_harness.RESULTS / name)
    if out:
        _harness.write_json(out, _harness.jsonable(payload))
        log(f"wrote {out}")
    print_tables(payload)
    log(f"total wall time {payload['total_wall_s']:.1f}s")
    return 1 if args.strict and payload["summary"]["fp8_failed"] else 0
