"""FP8 grouped GEMMs (mixture of experts): CPU step overhead, and the program XLA:GPU builds.

    python bench/moe.py                  # CPU step times, bf16 vs FP8; writes bench/results/moe_cpu.json
    python bench/moe.py --quick          # smoke test (small sizes, 3 rounds; not written unless --out)
    /tmp/venvcuda/bin/python bench/moe.py --gpu-aot   # deviceless H100 compile; bench/results/moe_gpu_aot_h100.json

The model is the mixture-of-experts MLP of examples/moe_transformer_lm.py: a router picks
the top 2 of 8 experts per token, the tokens' copies are sorted by expert, and two
`haliax.nn.MoELinear` layers (Embed -> Mlp -> Embed, bf16 weights) run as grouped GEMMs,
trained with a mean-squared-error loss and SGD in one `eqx.filter_jit` step. Variants:
`bf16` (plain) and `fp8` (`fp8ax.fp8_linear_layers`: `fp8ax.Fp8MoELinear`, delayed scaling,
per-expert weight scales, calibrated once so that the histories are filled).

CPU: the median step time over interleaved rounds (one step of each variant per round,
`jax.block_until_ready`), after warm-up. On a CPU FP8 is emulated: this is the cost of the
emulation and of the scaling bookkeeping, not FP8 speed.

GPU (`--gpu-aot`, needs the CUDA plugin, no GPU): the step lowered on abstract arrays placed
on a described H100 (bench/gpu_aot.py's `topology_mesh`) and compiled, in a subprocess per
XLA flag setting (XLA reads its flags once): the default, and XLA's two experimental
grouped-GEMM switches `--xla_gpu_experimental_use_ragged_dot_grouped_gemm` and
`--xla_gpu_experimental_use_ragged_dot_fusion`. Reported per variant, with
bench/gpu_hlo.py's definitions: GEMMs, FP8 GEMMs and their paths, GEMM FLOPs (what the
compiled GEMMs compute) against the useful FLOPs (2 x tokens x k x in x out for each of
the five grouped GEMMs the step needs, plus the router's two), kernels, and the HBM bytes
of the non-GEMM kernels.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import _harness

SIZES = {"tokens": 1024, "embed": 256, "mlp": 512, "experts": 8, "top_k": 2}
QUICK = {"tokens": 256, "embed": 64, "mlp": 128, "experts": 4, "top_k": 2}
GPU_SIZES = {"tokens": 8192, "embed": 4096, "mlp": 14336, "experts": 8, "top_k": 2}
FLAGS = {
    "default": "",
    "grouped_gemm": "--xla_gpu_experimental_use_ragged_dot_grouped_gemm=true",
    "ragged_dot_fusion": "--xla_gpu_experimental_use_ragged_dot_fusion=true",
}


def build(sizes):
    """`(models, step, x, y)`: the bf16 and FP8 MoE MLPs and one training step."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp

    import fp8ax

    Tok, Embed = hax.Axis("tok", sizes["tokens"]), hax.Axis("embed", sizes["embed"])
    Mlp, Experts = hax.Axis("mlp", sizes["mlp"]), hax.Axis("experts", sizes["experts"])
    top_k = sizes["top_k"]

    class MoeMlp(eqx.Module):
        router: hax.nn.Linear
        up: hax.nn.MoELinear
        down: hax.nn.MoELinear

        def __call__(self, h):
            probs = jax.nn.softmax(self.router(h).array.astype(jnp.float32), axis=-1)
            weights, chosen = jax.lax.top_k(probs, top_k)
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
            order = jnp.argsort(chosen.reshape(-1), stable=True)
            token_of = order // top_k
            sizes_ = hax.named(jnp.bincount(chosen.reshape(-1), length=Experts.size).astype(jnp.int32), Experts)
            Slot = hax.Axis("slot", order.shape[0])
            y = self.down(hax.nn.gelu(self.up(hax.named(h.array[token_of], (Slot, Embed)), sizes_)), sizes_).array
            y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
            return hax.named(jnp.zeros_like(h.array).at[token_of].add(y), (Tok, Embed))

    k = jax.random.split(jax.random.key(0), 3)
    plain = MoeMlp(
        hax.nn.Linear.init(Embed, Experts, key=k[0], use_bias=False),
        hax.nn.MoELinear.init(Experts, Embed, Mlp, key=k[1], use_bias=False),
        hax.nn.MoELinear.init(Experts, Mlp, Embed, key=k[2], use_bias=False),
    )
    config = fp8ax.Fp8Config(targets=["up", "down"], recipe=fp8ax.DelayedScaling(calibrate_first_call=False))
    models = {
        "bf16": fp8ax.cast_floating(plain, jnp.bfloat16),
        "fp8": fp8ax.cast_floating(fp8ax.fp8_linear_layers(plain, config), jnp.bfloat16),
    }

    def step(model, x, y):
        loss = lambda m: hax.mean((m(x).astype(jnp.float32) - y) ** 2).scalar()  # noqa: E731
        grads = eqx.filter_grad(loss)(model)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates = jax.tree.map(lambda g: -1e-3 * g, grads)
        return fp8ax.apply_updates(model, updates, overwrite)

    return models, step, (Tok, Embed)


def cpu(sizes, rounds, warmup):
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp

    import fp8ax

    models, step, axes = build(sizes)
    kx, ky = jax.random.split(jax.random.key(1))
    x = hax.random.normal(kx, axes).astype(jnp.bfloat16)
    y = hax.random.normal(ky, axes)
    models["fp8"] = fp8ax.calibrate(models["fp8"], lambda m, x: hax.sum(m(x)).scalar(), [(x,)])
    jitted = eqx.filter_jit(step)

    def call(name):
        models[name] = jax.block_until_ready(jitted(models[name], x, y))

    times = _harness.interleaved(call, list(models), rounds, warmup=warmup)
    med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {
        "sizes": sizes,
        "rounds": rounds,
        "median_ms": med,
        "fp8_over_bf16": med["fp8"] / med["bf16"],
        "quartiles_ms": {n: [1e3 * q for q in statistics.quantiles(t, n=4)] for n, t in times.items()},
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "cpu_count": os.cpu_count(),
    }


def gpu_worker(sizes) -> dict:
    """One compile per variant on a described H100 (this process's XLA flags)."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import gpu_aot
    import gpu_hlo

    mesh = gpu_aot.topology_mesh()
    replicated = NamedSharding(mesh, P())
    out = {}
    models, step, axes = eqx.filter_eval_shape(lambda: build(sizes))  # no weights materialised
    # The useful FLOPs: five grouped GEMMs of tokens x k rows (both layers' forward and
    # weight gradients, the second layer's input gradient: the first one's input is data)
    # and the router's forward and weight-gradient GEMMs.
    t, e = sizes["tokens"], sizes["embed"]
    useful = 5 * 2 * t * sizes["top_k"] * e * sizes["mlp"] + 2 * 2 * t * e * sizes["experts"]
    for name, model in models.items():
        dyn, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
        leaves, treedef = jax.tree.flatten(dyn)
        shape = tuple(a.size for a in axes)

        def flat(x, y, *arrays, static=static, treedef=treedef):
            m = eqx.combine(jax.tree.unflatten(treedef, arrays), static)
            new = step(m, hax.named(x, axes), hax.named(y, axes))
            return jax.tree.leaves(eqx.filter(new, eqx.is_array))

        args = [
            jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct(shape, jnp.float32, sharding=replicated),
        ] + [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in leaves]
        try:
            text = jax.jit(flat).lower(*args).compile().as_text()
        except Exception as e:  # noqa: BLE001 (reported: a variant XLA cannot compile)
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        s = gpu_hlo.summary(text)
        s["useful_grouped_gemm_flops"] = useful
        s["gemm_flops_over_useful"] = s["gemm_flops"] / useful
        s["ragged_dot_instructions_left"] = text.count(" ragged-dot(")
        out[name] = s
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpu-aot", action="store_true", help="compile for a described H100 (needs jax[cuda12])")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.worker:  # one XLA flag setting, in its own process
        sizes = QUICK if a.quick else GPU_SIZES
        print(json.dumps(gpu_worker(sizes)))
        return
    if a.gpu_aot:
        results = {"sizes": QUICK if a.quick else GPU_SIZES, "target": "H100 SXM (bench/gpu_aot.py H100_TARGET)"}
        for label, flag in FLAGS.items():
            env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
            env.setdefault("CUDA_VISIBLE_DEVICES", "-1")
            env.setdefault("JAX_PLATFORMS", "cpu")
            cmd = [sys.executable, __file__, "--worker", label] + (["--quick"] if a.quick else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            results[label] = json.loads(lines[-1]) if lines else {"error": proc.stderr[-2000:]}
            print(label, json.dumps(results[label], indent=1)[:3000])
        out = a.out or (None if a.quick else str(_harness.RESULTS / "moe_gpu_aot_h100.json"))
    else:
        results = cpu(QUICK if a.quick else SIZES, 3 if a.quick else a.rounds, 1 if a.quick else a.warmup)
        print(json.dumps(results, indent=1))
        out = a.out or (None if a.quick else str(_harness.RESULTS / "moe_cpu.json"))
    if out:
        _harness.write_json(out, results, indent=1)
        print(f"written to {out}")


if __name__ == "__main__":
    main()
