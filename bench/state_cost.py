"""What FP8 state costs a training step: fp8ax's default recipe against Haliax's FP8.

Each model is trained with the step its library documents, `optax.adam`, under one
`eqx.filter_jit`:

- ``plain``: no FP8; ``opt.init(eqx.filter(model, eqx.is_array))``, ``eqx.apply_updates``.
- ``haliax``: ``haliax.quantization.quantize_linear_layers(model, QuantizationConfig(fp8=True))``,
  Haliax's set-up (the optimizer built from ``partition_for_grad_overwrite(model)[1]``,
  Haliax's ``apply_updates``).
- ``fp8ax``: ``fp8ax.fp8_linear_layers(model)`` (``DelayedScaling()``, the default recipe;
  no first-call calibration since run G),
  ``opt = fp8ax.skip_fp8_state(optax.adam(...))`` built from the whole model (the
  documented path).
- ``fp8ax-bare``: the same model with a bare ``optax.adam`` built from the whole model
  (Equinox's pattern without the wrapper: its moments cover the FP8 state).
- ``fp8ax-cal``: ``DelayedScaling(calibrate_first_call=True)``: what the in-step
  first-call calibration (the default before run G) costs a settled step.
- ``fp8ax-current``: ``Fp8Config(recipe=CurrentScaling())``: no state, the same step.

Models (Haliax linear layers, float32; on the CPU FP8 is emulated, so only ratios and
counts mean anything):

- ``mlp``: Embed 1024 -> Mlp 4096 -> Embed 1024, two bias-free linears, GELU, batch 256.
- ``stack16``: 16 unrolled residual GLU blocks of 3 linears each at tiny sizes (embed 32,
  hidden 64, batch 8): host and per-op costs only.
- ``decoder``: a Llama-style decoder stack built with ``haliax.nn.Stacked`` (``lax.scan``, as
  Levanter builds models): 4 layers of RMS norm, causal attention (q, k, v, o projections)
  and a GLU MLP (gate, up, down), 7 linears per layer; embed 64, 4 heads, seq 32, batch 4.
- ``depth1``, ``depth4`` (and ``stack16``): the same blocks at depth 1 and 4, for how the
  first step's time grows with depth.

Per model and variant: the leaves of ``(model, opt_state)``; XLA's kernels per step (the
instructions of the optimized HLO that launch work, inside a ``while`` body times its trip
count; see `kernels`) and what the variant adds over ``plain`` per converted layer; the first
step's time (trace + lower + compile after ``jax.clear_caches()``, the best of
``--compile-reps``, taken round-robin over the variants) and that run's trace + lower
(``lower_s``) and compile (``compile_s``) apart; the step time (median over interleaved rounds) and the host time a
call of the jitted step takes: flattening the model and optimizer state in, the cache
lookup and the dispatch, and rebuilding both out (`host_us`; it matters most on ``stack16``, whose compute
is negligible); and the same call without the rebuilding, what ``eqx.filter_jit`` spends before the
program runs (`dispatch_us`); the objects Python's collector tracks that such a call leaves
alive (`kept_objects`: the rebuilt trees), and the mean of that call over ``20 * --rounds``
calls with the collector running (`host_mean_us`, its full passes included, which the
median leaves out). ``--target h100`` compiles the same steps for an H100 without one (the
CUDA plugin is needed: ``pip install "jax[cuda12]"``) and reports kernels only.

Run::

    python bench/state_cost.py                  # bench/results/state_cost_cpu.json
    python bench/state_cost.py --target h100    # bench/results/state_cost_h100.json (deviceless)
    python bench/state_cost.py --dry            # tiny sizes, one round: what CI runs
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import haliax.quantization as haxq
import jax
import optax

import _harness
import fp8ax

VARIANTS = ("plain", "haliax", "fp8ax", "fp8ax-bare", "fp8ax-cal", "fp8ax-current")
MODELS = ("mlp", "stack16", "decoder", "depth1", "depth4")
NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier", "after-all"}


# --------------------------------------------------------------------------------------
# Models


class Mlp(eqx.Module):
    up: hnn.Linear
    down: hnn.Linear

    def __call__(self, x):
        return self.down(hnn.gelu(self.up(x)))


class Glu(eqx.Module):
    gate: hnn.Linear
    up: hnn.Linear
    down: hnn.Linear

    def __call__(self, x):
        return self.down(hnn.silu(self.gate(x)) * self.up(x))


class Blocks(eqx.Module):
    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


class DecoderLayer(eqx.Module):
    norm1: hnn.RmsNorm
    q: hnn.Linear
    k: hnn.Linear
    v: hnn.Linear
    o: hnn.Linear
    norm2: hnn.RmsNorm
    mlp: Glu

    @staticmethod
    def init(Embed, Heads, HeadSize, Mlp_, *, key):
        k = jax.random.split(key, 7)
        lin = lambda i, o, kk: hnn.Linear.init(In=i, Out=o, key=kk, use_bias=False)  # noqa: E731
        return DecoderLayer(
            hnn.RmsNorm.init(Embed, use_bias=False),
            lin(Embed, (Heads, HeadSize), k[0]),
            lin(Embed, (Heads, HeadSize), k[1]),
            lin(Embed, (Heads, HeadSize), k[2]),
            lin((Heads, HeadSize), Embed, k[3]),
            hnn.RmsNorm.init(Embed, use_bias=False),
            Glu(lin(Embed, Mlp_, k[4]), lin(Embed, Mlp_, k[5]), lin(Mlp_, Embed, k[6])),
        )

    def __call__(self, x):
        h = self.norm1(x)
        q, k, v = self.q(h), self.k(h).rename({"position": "key_position"}), self.v(h)
        v = v.rename({"position": "key_position"})
        Pos, KPos = x.resolve_axis("position"), k.resolve_axis("key_position")
        mask = hnn.attention.causal_mask(Pos, KPos)
        att = hnn.attention.dot_product_attention("key_position", "head_size", q, k, v, mask=mask)
        x = x + self.o(att)
        return x + self.mlp(self.norm2(x))


class Decoder(eqx.Module):
    layers: hnn.Stacked

    def __call__(self, x):
        return self.layers.fold(x)


def build(name: str, dry: bool, key):
    """`(model, x, y, converted layers)` of model `name`."""
    if name == "mlp":
        n = 4 if dry else 1
        Batch, Embed, Hidden = hax.Axis("batch", 256 // n), hax.Axis("embed", 1024 // n), hax.Axis("mlp", 4096 // n)
        k1, k2, k3 = jax.random.split(key, 3)
        lin = lambda i, o, kk: hnn.Linear.init(In=i, Out=o, key=kk, use_bias=False)  # noqa: E731
        model, layers = Mlp(lin(Embed, Hidden, k1), lin(Hidden, Embed, k2)), 2
        x = hax.random.normal(k3, (Batch, Embed))
    elif name == "decoder":
        Batch, Pos, Embed = hax.Axis("batch", 4), hax.Axis("position", 32), hax.Axis("embed", 64)
        Heads, HeadSize, Hidden = hax.Axis("heads", 4), hax.Axis("head_size", 16), hax.Axis("mlp", 128)
        Layers = hax.Axis("layers", 2 if dry else 4)
        k1, k2 = jax.random.split(key)
        stack = hnn.Stacked.init(Layers, DecoderLayer)(
            Embed, Heads, HeadSize, Hidden, key=jax.random.split(k1, Layers.size)
        )
        model, layers = Decoder(stack), 7 * Layers.size
        x = hax.random.normal(k2, (Batch, Pos, Embed))
    else:
        depth = {"stack16": 4 if dry else 16, "depth1": 1, "depth4": 4}[name]
        Batch, Embed, Hidden = hax.Axis("batch", 8), hax.Axis("embed", 32), hax.Axis("mlp", 64)
        keys = jax.random.split(key, 3 * depth + 1)
        lin = lambda i, o, kk: hnn.Linear.init(In=i, Out=o, key=kk, use_bias=False)  # noqa: E731
        blocks = [
            Glu(
                lin(Embed, Hidden, keys[3 * i]),
                lin(Embed, Hidden, keys[3 * i + 1]),
                lin(Hidden, Embed, keys[3 * i + 2]),
            )
            for i in range(depth)
        ]
        model, layers = Blocks(blocks), 3 * depth
        x = hax.random.normal(keys[-1], (Batch, Embed))
    return model, x, hax.sin(x), layers


def variant(model, name: str):
    """`(model, opt, opt_state, step)` for one variant (see the module docstring)."""
    adam = optax.adam(1e-3)
    if name == "plain":
        opt, partition, apply = adam, None, None
    elif name == "haliax":
        model = haxq.quantize_linear_layers(model, haxq.QuantizationConfig(fp8=True))
        opt, partition, apply = adam, haxq.partition_for_grad_overwrite, haxq.apply_updates
    else:
        recipe = {
            "fp8ax-current": fp8ax.CurrentScaling(),
            "fp8ax-cal": fp8ax.DelayedScaling(calibrate_first_call=True),
        }.get(name, fp8ax.DelayedScaling())
        config = fp8ax.Fp8Config(recipe=recipe)
        model = fp8ax.fp8_linear_layers(model, config)
        opt = adam if name == "fp8ax-bare" else fp8ax.skip_fp8_state(adam)
        partition, apply = fp8ax.partition_for_grad_overwrite, fp8ax.apply_updates
    params = partition(model)[1] if name == "haliax" else eqx.filter(model, eqx.is_array)
    opt_state = opt.init(params)

    def loss(m, x, y):
        return hax.mean((m(x) - y) ** 2).scalar()

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss)(model, x, y)
        if partition is None:
            updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state
        overwrite, grads = partition(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return apply(model, updates, overwrite), opt_state

    return model, opt_state, step


# --------------------------------------------------------------------------------------
# Counting


def kernels(hlo: str) -> int:
    """Kernels one run of an optimized HLO module launches: the entry computation's
    instructions less those that launch nothing (`NOT_KERNELS`); a `while` counts its
    body's kernels times its known trip count (once if unknown), a `conditional` its
    largest branch."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None and line.startswith("  ") and "=" in line:
            comps[current].append(line.strip())

    def count(name: str) -> int:
        total = 0
        for ins in comps.get(name, []):
            op = re.match(r"(?:ROOT )?%?[\w.\-]+ = .*? ([\w\-]+)\(", ins)
            if op is None or op.group(1) in NOT_KERNELS:
                continue
            if op.group(1) == "while":
                body = re.search(r"body=%?([\w.\-]+)", ins)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins)
                total += (int(trips.group(1)) if trips else 1) * (count(body.group(1)) if body else 0)
            elif op.group(1) == "conditional":
                branches = [n for n in re.findall(r"%([\w.\-]+)", ins.split("(", 1)[1]) if n in comps]
                total += 1 + max((count(b) for b in branches), default=0)
            else:
                total += 1
        return total

    return count(entry) if entry else 0


def host_us(model, opt_state, x, y, rounds: int) -> float:
    """The host's share of a call of a jitted step on these arguments, in seconds: the
    median time of `_host_call`'s call (see there), for a program that computes nothing."""
    return _median_call_s(_host_call(model, opt_state, x, y), rounds)


def _host_call(model, opt_state, x, y):
    """A call of an `eqx.filter_jit` function of the step's arguments that returns the
    model and optimizer state as they came (donated, so the program copies nothing): the
    same flattening of both in, the same cache lookup and dispatch, and the same
    rebuilding of both out (Equinox's `combine` of the program's outputs with the static
    half) as the step's. Each call replaces the state it holds with what it returned."""
    # (The data first, the one argument not donated.)
    same = eqx.filter_jit(lambda data, model, opt_state: (model, opt_state), donate="all-except-first")
    # (Copies: the model and optimizer state are donated.)
    state = [jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, t) for t in (model, opt_state)]

    def call():
        state[:] = jax.block_until_ready(same((x, y), *state))  # (the donated inputs are gone)

    return call


def kept_objects(model, opt_state, x, y) -> int:
    """How many objects Python's collector tracks that one call of `_host_call`'s leaves
    alive (the rebuilt model and optimizer state: modules, states, arrays, and the
    tuples and dictionaries they keep). Each is walked again by every full pass of the
    collector, and the more a step keeps, the more often those passes come: on a model
    whose compute is negligible they cost more than the rebuilding itself (bench/README.md,
    run O). Counted with the collector paused, after three warm-up calls."""
    call = _host_call(model, opt_state, x, y)
    for _ in range(3):
        call()
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        call()
        return sum(id(o) not in before for o in gc.get_objects())
    finally:
        gc.enable()


def host_mean_us(model, opt_state, x, y, calls: int) -> float:
    """The mean time of `calls` calls of `_host_call`'s, in seconds, after one to compile,
    with Python's collector running as it does in a training loop: its passes, which the
    median of `host_us` leaves out, are in the mean."""
    call = _host_call(model, opt_state, x, y)
    call()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - t0) / calls


def dispatch_us(model, opt_state, x, y, rounds: int) -> float:
    """The time `eqx.filter_jit` spends before the program runs, in seconds: the median
    time of a call of an `eqx.filter_jit` function of the step's arguments that computes
    nothing and returns nothing: flattening the model and optimizer state in, the cache
    lookup and the dispatch (what `host_us` measures, without rebuilding the outputs)."""
    nothing = eqx.filter_jit(lambda data, model, opt_state: None)
    return _median_call_s(lambda: jax.block_until_ready(nothing((x, y), model, opt_state)), rounds)


def _median_call_s(call, rounds: int) -> float:
    """The median time of `call()` over at least 5 calls, after one to compile."""
    call()
    ts = []
    for _ in range(max(rounds, 5)):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def first_step_s(step, args, reps: int, lower_for=None) -> tuple[float, float, float, str]:
    """The best of `reps` first steps, each after `jax.clear_caches()`: its time (trace +
    lower + compile), that run's trace + lower and compile times apart, and the optimized
    HLO. `lower_for()` lowers the step another way (for another device)."""
    best, text = (float("inf"), 0.0, 0.0), ""
    for _ in range(reps):
        jax.clear_caches()
        # Each first step starts with Python's collector emptied, so that the passes it
        # makes during the step (a full one visits every object of this process) depend
        # on what the step allocates, not on what the variants timed before it left.
        gc.collect()
        t0 = time.perf_counter()
        lowered = (lower_for or (lambda: step.lower(*args)))()
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        if t2 - t0 < best[0]:
            best = (t2 - t0, t1 - t0, t2 - t1)
        text = getattr(compiled, "compiled", compiled).as_text()  # (Equinox's wrapper holds JAX's)
    return (*best, text)


def h100_lower(step, args):
    """A lowering for an H100 described from its specifications (bench/gpu_aot.py)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    import gpu_aot

    mesh = gpu_aot.topology_mesh()
    arrays, static = eqx.partition(args, eqx.is_array)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), arrays)
    return lambda: jax.jit(lambda a: step(*eqx.combine(a, static))).lower(abstract)


# --------------------------------------------------------------------------------------


def run(args) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = jax.random.PRNGKey(0)
    for mname in args.models:
        base, x, y, layers = build(mname, args.dry, key)
        row: dict[str, Any] = {"converted_layers": layers}
        built = {v: variant(base, v) for v in args.variants}
        # The first steps round-robin over the variants, best of `--compile-reps` each: a
        # slow spell of the machine then slows every variant's round alike. Timed one
        # variant after another, the same code gave the Stacked decoder 1.21 times
        # Haliax's first step, against 1.05 round-robin (bench/README.md, run R).
        best: dict[str, tuple[float, float, float]] = {}
        hlos: dict[str, str] = {}  # (the same program at every repetition)
        for _ in range(args.compile_reps):
            for v, (model, opt_state, step) in built.items():
                call = (model, opt_state, x, y)
                lower_for = h100_lower(step, call) if args.target == "h100" else None
                secs, lower_s, compile_s, hlos[v] = first_step_s(step, call, 1, lower_for)
                if v not in best or secs < best[v][0]:
                    best[v] = (secs, lower_s, compile_s)
        for v, (model, opt_state, _) in built.items():
            row[v] = {
                "leaves": len(jax.tree.leaves((model, opt_state))),
                "first_step_s": best[v][0],
                "lower_s": best[v][1],
                "compile_s": best[v][2],
                "kernels": kernels(hlos[v]),
            }
        if args.target == "cpu" and mname in ("mlp", "stack16", "decoder"):
            state = {v: (m, s) for v, (m, s, _) in built.items()}
            for v, (m, s, step) in built.items():  # warm-up
                jax.block_until_ready(step(m, s, x, y))

            def call(v):
                state[v] = jax.block_until_ready(built[v][2](*state[v], x, y))

            times = _harness.interleaved(call, built, args.rounds)
            for v in built:
                row[v]["step_ms"] = 1e3 * statistics.median(times[v])
                row[v]["host_us"] = 1e6 * host_us(*state[v], x, y, args.rounds)
                row[v]["dispatch_us"] = 1e6 * dispatch_us(*state[v], x, y, args.rounds)
                row[v]["kept_objects"] = kept_objects(*state[v], x, y)
                row[v]["host_mean_us"] = 1e6 * host_mean_us(*state[v], x, y, 20 * args.rounds)
        if "plain" in row:
            for v in args.variants:
                if v != "plain":
                    row[v]["kernels_added_per_layer"] = (row[v]["kernels"] - row["plain"]["kernels"]) / layers
        out[mname] = row
        print(table({mname: row}), flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    lines = []
    for mname, row in results.items():
        lines.append(f"{mname} ({row['converted_layers']} converted layers)")
        lines.append(
            f"  {'variant':14} {'leaves':>7} {'kernels':>8} {'+/layer':>8} {'first s':>8} {'lower s':>8} "
            f"{'comp. s':>8} {'step ms':>8} {'host us':>8} {'disp. us':>8} {'kept':>6} {'mean us':>8}"
        )
        for v, r in row.items():
            if not isinstance(r, dict):
                continue
            added = r.get("kernels_added_per_layer")
            lines.append(
                f"  {v:14} {r['leaves']:7d} {r['kernels']:8d} {'' if added is None else f'{added:+.1f}':>8} "
                f"{r['first_step_s']:8.2f} {r['lower_s']:8.2f} {r['compile_s']:8.2f} "
                f"{r.get('step_ms', float('nan')):8.2f} {r.get('host_us', float('nan')):8.0f} "
                f"{r.get('dispatch_us', float('nan')):8.0f} {r.get('kept_objects', -1):6d} "
                f"{r.get('host_mean_us', float('nan')):8.0f}"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--target", choices=("cpu", "h100"), default="cpu")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--compile-reps", type=int, default=3)
    p.add_argument("--dry", action="store_true", help="tiny sizes, one round, one compile: a smoke test")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    args.models, args.variants = args.models.split(","), args.variants.split(",")
    if args.dry:
        args.rounds, args.compile_reps = 1, 1
    if args.target == "h100" and importlib.util.find_spec("jax_cuda12_plugin") is None:
        print("state_cost.py --target h100 needs the CUDA plugin: pip install 'jax[cuda12]'", file=sys.stderr)
        return 2
    results = run(args)
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "target": args.target,
        "dry": args.dry,
        "versions": _harness.versions(("jax", "equinox", "optax", "fp8ax"))
        | _harness.versions(("haliax",), missing="?"),
        "results": results,
    }
    out = args.out or (_harness.RESULTS / f"state_cost_{args.target}{'_dry' if args.dry else ''}.json")
    _harness.write_json(out, record, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
