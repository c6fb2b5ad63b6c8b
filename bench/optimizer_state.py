"""What the optimizer state for the FP8 state costs: memory, CPU step time, H100 program.

    python bench/optimizer_state.py            # bytes, CPU step times; bench/results/optimizer_state_cpu.json
    python bench/optimizer_state.py --quick    # smoke test (small sizes, 2 + 3 steps; not written unless --out)
    CUDA_VISIBLE_DEVICES=-1 JAX_PLATFORMS=cpu /path/to/cuda-venv/bin/python bench/optimizer_state.py --gpu-aot
                                               # deviceless H100 compile; bench/results/optimizer_state_gpu_aot_h100.json

`fp8ax.partition_for_grad_overwrite(grads)` returns `(overwrite, rest)`, and `rest` holds,
in place of each FP8 module, the module filled with float32 zeros (it used to hold
`None`). The optimizer state can then be built from the whole model, but it carries
moments for the FP8 state (per layer three scales and three amax histories of 1024
float32) and computes updates for it, which
`fp8ax.apply_updates` ignores. Two variants of the same `eqx.filter_jit` train step
(MSE loss, `optax.adamw(1e-3, weight_decay=0.1)` with `params=model`,
`fp8ax.apply_updates`):

- `zeros` (fp8ax now): `fp8ax.partition_for_grad_overwrite(grads)`, the optimizer state
  from `eqx.filter(model, eqx.is_array)`;
- `none` (the optimizer without the FP8 state, as before): `eqx.partition(grads, is_fp8,
  is_leaf=is_fp8)`, the optimizer state from the model without its FP8 modules.

The model: `haliax.nn.Stacked` residual MLP blocks (Embed -> Mlp -> Embed, two bias-free
`haliax.nn.Linear`, GELU) and a linear head, converted by `fp8ax.fp8_linear_layers`
(DelayedScaling) and calibrated by `fp8ax.calibrate` on one batch.

Reported: the optimizer state bytes of each variant and their difference (per FP8 layer
too). CPU: the median step time over interleaved rounds (one step of each variant per
round, the order alternating, `jax.block_until_ready`) after warm-up, the same for the
optimizer's part of the step alone (partition, `opt.update`, apply, on fixed gradients),
the compiles of each step during warm-up, and a check that both variants leave
bit-identical parameters and FP8 state. `--gpu-aot` (needs the CUDA
plugin, no GPU): the step at LLM sizes, bf16 parameters (`fp8ax.cast_floating`), lowered
on abstract arrays placed on a described H100 (bench/gpu_aot.py's `topology_mesh`) and
compiled; per variant bench/gpu_hlo.py's kernel counts and HBM bytes of the non-GEMM
kernels of the entry computation (each layer loop, a `while`, is one kernel there; the
kernels of the loop bodies are counted apart), and `compiled.memory_analysis()`.
"""

import argparse
import json
import math
import os
import re
import statistics
import time

import _harness

SIZES = {"batch": 128, "embed": 256, "mlp": 1024, "layers": 8}
QUICK = {"batch": 16, "embed": 64, "mlp": 128, "layers": 2}
GPU_SIZES = {"batch": 8192, "embed": 4096, "mlp": 14336, "layers": 32}
GPU_QUICK = {"batch": 512, "embed": 256, "mlp": 896, "layers": 4}
VARIANTS = ("zeros", "none")
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")


def build(sizes, dtype=None):
    """`(model, x, y)`: the converted, calibrated model and one batch."""
    import equinox as eqx
    import haliax as hax
    import haliax.nn as hnn
    import jax
    import jax.numpy as jnp

    import fp8ax

    Batch, Embed = hax.Axis("batch", sizes["batch"]), hax.Axis("embed", sizes["embed"])
    Mlp, Layers = hax.Axis("mlp", sizes["mlp"]), hax.Axis("layers", sizes["layers"])
    Out = Embed.alias("out")

    class Block(eqx.Module):
        up: hnn.Linear
        down: hnn.Linear

        @staticmethod
        def init(*, key):
            k1, k2 = jax.random.split(key)
            return Block(
                hnn.Linear.init(Embed, Mlp, key=k1, use_bias=False), hnn.Linear.init(Mlp, Embed, key=k2, use_bias=False)
            )

        def __call__(self, x):
            return x + self.down(hnn.gelu(self.up(x))).astype(x.dtype)

    class Model(eqx.Module):
        blocks: hnn.Stacked
        head: hnn.Linear

        def __call__(self, x):
            return self.head(self.blocks.fold(x))

    k = jax.random.split(jax.random.key(0), 4)
    blocks = hnn.Stacked.init(Layers, Block)(key=jax.random.split(k[0], Layers.size))
    model = fp8ax.fp8_linear_layers(Model(blocks, hnn.Linear.init(Embed, Out, key=k[1], use_bias=False)))
    if dtype is not None:
        model = fp8ax.cast_floating(model, dtype)
    x = hax.random.normal(k[2], (Batch, Embed)).astype(dtype or jnp.float32)
    y = hax.random.normal(k[3], (Batch, Out))
    return fp8ax.calibrate(model, loss, [(x, y)]), x, y


def loss(model, x, y):
    import haliax as hax
    import jax.numpy as jnp

    return hax.mean((model(x).astype(jnp.float32) - y) ** 2).scalar()


def is_fp8(x):
    import fp8ax

    return isinstance(x, fp8ax.Fp8DotGeneral)


def opt_params(variant, model):
    """What the optimizer state is built from."""
    import equinox as eqx

    if variant == "none":
        model = eqx.partition(model, is_fp8, is_leaf=is_fp8)[1]
    return eqx.filter(model, eqx.is_array)


def make_update(variant, opt):
    """The optimizer's part of the step: partition the gradients, `opt.update`, apply."""
    import equinox as eqx

    import fp8ax

    def update(model, opt_state, grads):
        if variant == "zeros":
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        else:
            overwrite, grads = eqx.partition(grads, is_fp8, is_leaf=is_fp8)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    return update


def make_step(variant, opt):
    import equinox as eqx

    update = make_update(variant, opt)

    def step(model, opt_state, x, y):
        return update(model, opt_state, eqx.filter_grad(loss)(model, x, y))

    return step


def nbytes(tree) -> int:
    import jax

    return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree) if hasattr(a, "dtype"))


def memory(model, opt_states) -> dict:
    """Bytes of the parameters, the FP8 state and each optimizer state."""
    import equinox as eqx
    import jax

    arrays = eqx.filter(model, lambda a: eqx.is_array(a) or isinstance(a, jax.ShapeDtypeStruct))
    fp8, params = eqx.partition(arrays, is_fp8, is_leaf=is_fp8)
    modules = [m for m in jax.tree.leaves(model, is_leaf=is_fp8) if is_fp8(m)]
    layers = sum(math.prod(m.lhs.batch_shape) for m in modules)  # a Stacked module is `layers` layers
    state = {n: nbytes(s) for n, s in opt_states.items()}
    return {
        "param_bytes": nbytes(params),
        "fp8_state_bytes": nbytes(fp8),
        "fp8_state_dtypes": {  # per field: scale, amax_history
            jax.tree_util.keystr(path[-1:], simple=True): str(a.dtype)
            for path, a in jax.tree_util.tree_leaves_with_path(fp8)
        },
        "param_dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(params)}),
        "fp8_layers": layers,
        "opt_state_bytes": state,
        "opt_state_extra_bytes": state["zeros"] - state["none"],
        "opt_state_extra_bytes_per_fp8_layer": (state["zeros"] - state["none"]) / layers,
        "opt_state_extra_over_params": (state["zeros"] - state["none"]) / nbytes(params),
    }


def cpu(sizes, rounds, warmup) -> dict:
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    model, x, y = build(sizes)
    opt = optax.adamw(1e-3, weight_decay=0.1)
    traces = dict.fromkeys(VARIANTS, 0)  # one trace per compile of the step

    def counted(v):
        def step(*args):
            traces[v] += 1
            return make_step(v, opt)(*args)

        return eqx.filter_jit(step)

    steps = {v: counted(v) for v in VARIANTS}
    carry = {v: (model, opt.init(opt_params(v, model))) for v in VARIANTS}
    out = {"sizes": sizes, "rounds": rounds, "warmup": warmup}
    out["opt_state_bytes_at_init"] = {v: nbytes(s) for v, (_, s) in carry.items()}
    out["warmup_step_s"] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for _ in range(warmup):
            t0 = time.perf_counter()
            carry[v] = jax.block_until_ready(steps[v](*carry[v], x, y))
            out["warmup_step_s"][v].append(time.perf_counter() - t0)
    out["compiles_in_warmup"] = dict(traces)
    out.update(memory(model, {v: s for v, (_, s) in carry.items()}))
    times = interleaved(steps, carry, (x, y), rounds)
    assert traces == out["compiles_in_warmup"], f"the step compiled again in the timed rounds: {traces}"
    # The same steps from the same model: the same parameters and FP8 state, bit for bit.
    a, b = (jax.tree.leaves(eqx.filter(carry[v][0], eqx.is_array)) for v in VARIANTS)
    assert len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b)), "the variants' models differ"
    out["bit_identical_after_steps"] = warmup + rounds
    out["step"] = summarise(times)
    # The optimizer's part alone (the same gradients every call), where the extra work is
    # a larger share of the time; a call is short, so 5x the rounds.
    grads = eqx.filter_jit(eqx.filter_grad(loss))(model, x, y)
    updates = {v: eqx.filter_jit(make_update(v, opt)) for v in VARIANTS}
    out["optimizer_only"] = summarise(interleaved(updates, carry, (grads,), 5 * rounds, warmup))
    out.update(jax=jax.__version__, device=jax.devices()[0].device_kind, cpu_count=os.cpu_count())
    out["loadavg"] = os.getloadavg()
    return out


def interleaved(fns, carry, args, rounds, warmup=0):
    """Per variant, the seconds of each call: one call of every variant per round, the
    order alternating, after `warmup` untimed calls each. `carry` is updated in place."""
    import jax

    def call(v):
        carry[v] = jax.block_until_ready(fns[v](*carry[v], *args))

    return _harness.interleaved(call, VARIANTS, rounds, warmup=warmup)


def summarise(times) -> dict:
    ratios = [z / n for z, n in zip(times["zeros"], times["none"])]
    return {
        "median_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "quartiles_ms": {v: [1e3 * q for q in statistics.quantiles(t, n=4)] for v, t in times.items()},
        "min_ms": {v: 1e3 * min(t) for v, t in times.items()},
        "median_ratio_zeros_over_none": statistics.median(ratios),  # of the two calls of a round
        "ratio_quartiles": statistics.quantiles(ratios, n=4),
    }


def loop_kernels(hlo_text) -> dict:
    """The `while` loops of the entry computation (a `Stacked` layer loop is one kernel in
    bench/gpu_hlo.py's count): `(trip count, kernels in the body)` each."""
    import gpu_hlo

    entry, comps = gpu_hlo.parse(hlo_text)
    loops = []
    for w in (i for i in comps[entry] if i.opcode == "while"):
        body = re.search(r"\bbody=%([\w.\-]+)", w.attrs).group(1)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', w.attrs)
        kernels = sum(i.opcode not in gpu_hlo.NOT_KERNELS for i in comps[body])
        loops.append((int(trips.group(1)) if trips else 1, kernels))
    return {"loops": loops}


def gpu_aot(sizes, repeat) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import gpu_aot
    import gpu_hlo

    replicated = NamedSharding(gpu_aot.topology_mesh(), P())
    opt = optax.adamw(1e-3, weight_decay=0.1)

    def abstract():
        # The optimizer state of the steady step (after one step; the same as at `opt.init`).
        model, x, y = build(sizes, jnp.bfloat16)
        states = {v: make_step(v, opt)(model, opt.init(opt_params(v, model)), x, y)[1] for v in VARIANTS}
        return model, x, y, states

    model, x, y, opt_states = eqx.filter_eval_shape(abstract)  # nothing materialised
    out = {"sizes": sizes, "target": "H100 SXM (bench/gpu_aot.py H100_TARGET)", "jax": jax.__version__}
    out.update(memory(model, opt_states))
    for v in VARIANTS:
        dyn, static = eqx.partition((model, opt_states[v], x, y), lambda a: isinstance(a, jax.ShapeDtypeStruct))
        leaves, treedef = jax.tree.flatten(dyn)

        def flat(*arrays, static=static, treedef=treedef, v=v):
            new = make_step(v, opt)(*eqx.combine(jax.tree.unflatten(treedef, arrays), static))
            return jax.tree.leaves(eqx.filter(new, eqx.is_array))

        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in leaves]
        times = []
        for _ in range(repeat):  # the fastest of `repeat` compiles, each from scratch
            jax.clear_caches()
            t0 = time.perf_counter()
            compiled = jax.jit(flat).lower(*args).compile()
            times.append(time.perf_counter() - t0)
        text = compiled.as_text()
        info = {"compile_s": min(times), "compile_s_all": times, **gpu_hlo.summary(text), **loop_kernels(text)}
        info["kernel_launches"] = info["kernels"] - len(info["loops"]) + sum(n * k for n, k in info["loops"])
        m = compiled.memory_analysis()
        info["memory_analysis"] = {k: getattr(m, k) for k in MEMORY_FIELDS}
        out[v] = info
        print(v, {k: info[k] for k in ("kernels", "kernel_launches", "non_gemm_bytes", "loops", "compile_s")})
    z, n = out["zeros"], out["none"]
    out["difference_zeros_minus_none"] = {
        k: z[k] - n[k]
        for k in ("kernels", "kernel_launches", "non_gemm_kernels", "gemms", "non_gemm_bytes", "gemm_bytes")
    }
    out["difference_zeros_minus_none"].update(
        {k: z["memory_analysis"][k] - n["memory_analysis"][k] for k in MEMORY_FIELDS}
    )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--repeat", type=int, default=2, help="--gpu-aot: compile each variant this many times, report the fastest"
    )
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--gpu-aot", action="store_true", help="compile for a described H100 (needs jax[cuda12])")
    p.add_argument("--out", default=None, help="JSON path ('' for none)")
    a = p.parse_args()
    if a.gpu_aot:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        sizes = dict(GPU_QUICK if a.quick else GPU_SIZES, **({"layers": a.layers} if a.layers else {}))
        results, name = gpu_aot(sizes, a.repeat), "optimizer_state_gpu_aot_h100.json"
    else:
        sizes = dict(QUICK if a.quick else SIZES, **({"layers": a.layers} if a.layers else {}))
        results = cpu(sizes, 3 if a.quick else a.rounds, 2 if a.quick else a.warmup)
        name = "optimizer_state_cpu.json"
    results["benchmark"] = "bench/optimizer_state.py"
    results["date"] = _harness.now(timespec="auto")
    results["versions"] = _harness.versions(
        ("jax", "jaxlib", "jax-cuda12-plugin", "equinox", "haliax", "optax"), missing="not installed"
    )
    print(json.dumps(results, indent=1))
    out = a.out if a.out is not None else (None if a.quick else str(_harness.RESULTS / name))
    if out:
        _harness.write_json(out, results, indent=1)
        print(f"written to {out}")


if __name__ == "__main__":
    main()
