"""Serving benchmark: checkpoint bytes and forward (serving step) time of a Haliax MLP,
plain (float32, bf16) against its serving forms (`fp8ax.to_serving`: FP8 delayed
scaling, FP8 current scaling, int8, MX E4M3, MX FP4).

    python bench/serving.py            # writes bench/results/serving_cpu.json
    python bench/serving.py --quick    # small model, few rounds; writes serving_cpu_quick.json (git-ignored)

Model: `Embed (1024) -> Mlp (4096) -> Embed (1024)`, two `haliax.nn.Linear` with GELU between,
batch 256, weights and inputs bf16 (the serving variants are converted from the bf16 model;
delayed scaling is calibrated on one batch with `fp8ax.calibrate` first).

- checkpoint bytes: `len` of `eqx.tree_serialise_leaves` of each model (in memory);
- step time: one jitted forward (`eqx.filter_jit(lambda m, x: m(x).array)`), after warm-up;
  each round runs every variant once, in a rotating order, with `jax.block_until_ready`;
  the median over rounds is reported (plus quartiles in the JSON). On a CPU XLA emulates
  FP8 (it converts FP8 operands to float before the dot), so these times say what the
  emulation costs, not what FP8 hardware gives.
"""

from __future__ import annotations

import argparse
import io
import statistics

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

import _harness
import fp8ax


class Mlp(eqx.Module):
    up: hax.nn.Linear
    down: hax.nn.Linear

    def __call__(self, x):
        return self.down(hax.nn.gelu(self.up(x)))


def nbytes(tree) -> int:
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, tree)
    return len(buf.getvalue())


def build(embed: int, hidden: int, batch: int, seed: int = 0):
    Embed, Hidden, Batch = hax.Axis("embed", embed), hax.Axis("mlp", hidden), hax.Axis("batch", batch)
    k1, k2, kx = jax.random.split(jax.random.PRNGKey(seed), 3)
    f32 = Mlp(hax.nn.Linear.init(Embed, Hidden, key=k1), hax.nn.Linear.init(Hidden, Embed, key=k2))
    bf16 = fp8ax.cast_floating(f32, jnp.bfloat16)
    x = hax.random.normal(kx, (Batch, Embed)).astype(jnp.bfloat16)

    def serve(recipe):
        model = fp8ax.fp8_linear_layers(bf16, fp8ax.Fp8Config(recipe=recipe))
        if recipe.stateful:
            model = fp8ax.calibrate(model, lambda m, x: hax.sum(m(x)).scalar().astype(jnp.float32), [(x,)])
        return model, fp8ax.to_serving(model)

    delayed_train, delayed = serve(fp8ax.DelayedScaling())
    models = {
        "float32": f32,
        "bf16": bf16,
        "fp8-training (delayed)": delayed_train,
        "fp8-serving (delayed)": delayed,
        "fp8-serving (current)": serve(fp8ax.CurrentScaling())[1],
        "int8-serving": serve(fp8ax.Int8Scaling())[1],
        "mx-e4m3-serving": serve(fp8ax.MXScaling())[1],
        "mx-fp4-serving": serve(fp8ax.MXScaling(fwd_element="e2m1"))[1],
    }
    return models, x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embed", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="embed 64, hidden 256, batch 16, 3 rounds")
    parser.add_argument("--out", default=None, help="JSON path ('' for none)")
    args = parser.parse_args()
    if args.quick:
        args.embed, args.hidden, args.batch, args.rounds, args.warmup = 64, 256, 16, 3, 1
    out = (
        args.out
        if args.out is not None
        else str(_harness.RESULTS / ("serving_cpu_quick.json" if args.quick else "serving_cpu.json"))
    )

    load_before = _harness.loadavg()
    models, x = build(args.embed, args.hidden, args.batch)
    sizes = {name: nbytes(m) for name, m in models.items()}
    n_weights = 2 * args.embed * args.hidden
    print(
        f"Haliax MLP {args.embed} -> {args.hidden} -> {args.embed} ({n_weights:,} weights), batch {args.batch}, "
        f"{jax.default_backend()}"
    )
    print(f"\n{'variant':<24} {'checkpoint bytes':>17} {'x bf16':>7} {'x float32':>9}")
    for name, n in sizes.items():
        print(f"{name:<24} {n:>17,} {n / sizes['bf16']:>7.3f} {n / sizes['float32']:>9.3f}")

    timed = [n for n in models if n != "float32"]
    forward = eqx.filter_jit(lambda m, x: m(x).array)
    times = _harness.interleaved(
        lambda name: jax.block_until_ready(forward(models[name], x)), timed, args.rounds, warmup=args.warmup
    )
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"\n{'variant':<24} {'forward ms (median)':>20} {'x bf16':>7}")
    for name in timed:
        print(f"{name:<24} {1e3 * med[name]:>20.2f} {med[name] / med['bf16']:>7.2f}")

    if out:
        result = {
            "config": vars(args),
            "machine": _harness.machine(),
            "loadavg_before": load_before,
            "loadavg_after": _harness.loadavg(),
            "weights": n_weights,
            "checkpoint_bytes": sizes,
            "forward_seconds": {
                name: {"median": med[name], "min": min(ts), "quartiles": statistics.quantiles(ts, n=4)}
                for name, ts in times.items()
            },
        }
        _harness.write_json(out, result)
        print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
