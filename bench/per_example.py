"""Per-example layers under `jax.vmap`: FP8 train step vs the plain model, on CPU.

Equinox models call their layers one example at a time and `jax.vmap` the model (and
`eqx.nn.MultiheadAttention` vmaps its projections over positions internally). This
times a train step of two models written that way, after the models in Equinox's own
docs:

- ``cnn``: the MNIST CNN of Equinox's "Convolutional neural network" example
  (Conv2d 1->3, 4x4 -> max pool -> ReLU -> flatten -> Linear 1728->512 -> ReLU ->
  Linear 512->64 -> ReLU -> Linear 64->10 -> log-softmax), batch 64, 28x28 inputs.
  fp8ax converts the three `eqx.nn.Linear` (the Conv2d stays in float32).
- ``vit``: a vision transformer in the style of Equinox's ViT example, 512 wide: 4x4
  patches of a 32x32x3 image (64 patches) embedded by `eqx.nn.Linear`, a class token,
  learned position embeddings, ``--vit-layers`` pre-LayerNorm blocks of
  `eqx.nn.MultiheadAttention` (8 heads) and a 512->2048->512 GELU MLP, and a linear head
  (10 classes), batch ``--vit-batch``. fp8ax converts every `eqx.nn.Linear` (the
  attention projections included).

Variants: ``plain`` (float32), ``fp8ax`` (`fp8ax.fp8_linear_layers(model)`, default
delayed scaling) and ``fp8ax-cal`` (the same after `fp8ax.calibrate` on one batch). The
step is cross-entropy, `eqx.filter_grad`, `fp8ax.partition_for_grad_overwrite`,
`optax.adam`, `fp8ax.apply_updates`, under one `eqx.filter_jit`. Step time is the median
over interleaved rounds (each round runs every variant once, in rotating order); compile
time is `lower + compile` after `jax.clear_caches()`, median of 3.

On CPU, FP8 is emulated (XLA widens FP8 operands before the dot), so the ratio measures
fp8ax's overhead, not GPU FP8 speed.

Run::

    python bench/per_example.py            # writes bench/results/per_example_cpu.json
    python bench/per_example.py --quick    # tiny sizes, a few seconds (tests run this)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import _harness
import fp8ax

VARIANTS = ("plain", "fp8ax", "fp8ax-cal")


class CNN(eqx.Module):
    layers: list

    def __init__(self, key, width: int = 512):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=k1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, width, key=k2),
            jax.nn.relu,
            eqx.nn.Linear(width, 64, key=k3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=k4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):  # one example: (1, 28, 28)
        for layer in self.layers:
            x = layer(x)
        return x


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, heads, hidden, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, hidden, key=k2)
        self.down = eqx.nn.Linear(hidden, dim, key=k3)

    def __call__(self, x):  # (positions, dim)
        y = jax.vmap(self.norm1)(x)
        x = x + self.attn(y, y, y)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(y)


class ViT(eqx.Module):
    patch: eqx.nn.Linear
    cls: jax.Array
    pos: jax.Array
    blocks: list
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear
    patch_size: int = eqx.field(static=True)

    def __init__(self, key, dim=512, layers=2, heads=8, image=32, patch_size=4, channels=3, classes=10):
        keys = jax.random.split(key, layers + 4)
        n = (image // patch_size) ** 2
        self.patch_size = patch_size
        self.patch = eqx.nn.Linear(patch_size * patch_size * channels, dim, key=keys[0])
        self.cls = jax.random.normal(keys[1], (1, dim)) * 0.02
        self.pos = jax.random.normal(keys[2], (n + 1, dim)) * 0.02
        self.blocks = [Block(dim, heads, 4 * dim, k) for k in keys[4:]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=keys[3])

    def __call__(self, img):  # one example: (channels, image, image)
        c, h, w = img.shape
        p = self.patch_size
        patches = img.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape(-1, p * p * c)
        x = jnp.concatenate([self.cls, jax.vmap(self.patch)(patches)]) + self.pos
        for block in self.blocks:
            x = block(x)
        return jax.nn.log_softmax(self.head(self.norm(x[0])))


def make_step(opt):
    def loss_fn(model, x, y):
        logp = jax.vmap(model)(x)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    return loss_fn, step


def variants(model, loss_fn, x, y):
    fp8 = fp8ax.fp8_linear_layers(model)
    return {
        "plain": model,
        "fp8ax": fp8,
        "fp8ax-cal": fp8ax.calibrate(fp8, loss_fn, [(x, y)]),
    }


def run_model(name, model, x, y, rounds, compile_reps):
    opt = optax.adam(1e-3)
    loss_fn, step = make_step(opt)
    models = variants(model, loss_fn, x, y)
    # The optimizer state holds arrays only (not eqx.nn.Lambda's functions).
    states = {
        k: opt.init(eqx.filter(fp8ax.partition_for_grad_overwrite(m)[1], eqx.is_inexact_array))
        for k, m in models.items()
    }
    out = {}
    for k, m in models.items():
        times = []
        for _ in range(compile_reps):
            jax.clear_caches()
            t = time.perf_counter()
            step.lower(m, states[k], x, y).compile()
            times.append(time.perf_counter() - t)
        out[k] = {"compile_s": statistics.median(times)}

    def call(k):
        models[k], states[k] = jax.block_until_ready(step(models[k], states[k], x, y))

    # Warm-up: compile into the cache and run twice.
    samples = _harness.interleaved(call, list(models), rounds, warmup=2)
    for k in models:
        out[k]["step_s"] = statistics.median(samples[k])
        out[k]["step_min_s"] = min(samples[k])
        out[k]["loss_after"] = float(loss_fn(models[k], x, y))
    for k in ("fp8ax", "fp8ax-cal"):
        out[k]["step_ratio_vs_plain"] = out[k]["step_s"] / out["plain"]["step_s"]
        out[k]["compile_ratio_vs_plain"] = out[k]["compile_s"] / out["plain"]["compile_s"]
    print(f"\n{name}: {x.shape[0]} examples per step, {rounds} rounds")
    print(f"  {'variant':10s} {'step ms':>9s} {'x plain':>8s} {'compile s':>10s} {'x plain':>8s}")
    for k, v in out.items():
        print(
            f"  {k:10s} {1e3 * v['step_s']:9.1f} {v.get('step_ratio_vs_plain', 1.0):8.2f}"
            f" {v['compile_s']:10.2f} {v.get('compile_ratio_vs_plain', 1.0):8.2f}"
        )
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--vit-layers", type=int, default=2)
    parser.add_argument("--vit-batch", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    key = jax.random.PRNGKey(0)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    results = {
        "meta": {
            "date": _harness.now(),
            "backend": jax.default_backend(),
            "devices": str(jax.devices()),
            "jax": jax.__version__,
            "fp8ax": fp8ax.__version__,
            "python": _harness.python_version(),
            "machine": platform.processor() or platform.machine(),
            "quick": args.quick,
        }
    }
    if args.quick:
        rounds, reps = 2, 1
        cnn, cb = CNN(k1, width=32), 4
        vit, vb, dim = ViT(k2, dim=32, layers=1, heads=2, image=8), 2, 32
    else:
        rounds, reps = args.rounds, 3
        cnn, cb = CNN(k1), 64
        vit, vb, dim = ViT(k2, layers=args.vit_layers), args.vit_batch, 512
    del dim
    x = jax.random.normal(k3, (cb, 1, 28, 28))
    y = jax.random.randint(k4, (cb,), 0, 10)
    results["cnn"] = run_model("cnn (Equinox MNIST CNN)", cnn, x, y, rounds, reps)
    img = 8 if args.quick else 32
    x = jax.random.normal(k3, (vb, 3, img, img))
    y = jax.random.randint(k4, (vb,), 0, 10)
    results["vit"] = run_model("vit (512 wide)" if not args.quick else "vit (quick)", vit, x, y, rounds, reps)
    out = args.out or _harness.RESULTS / ("per_example_cpu_quick.json" if args.quick else "per_example_cpu.json")
    _harness.write_json(out, results)
    print(f"\nwrote {out}")
    return results


if __name__ == "__main__":
    main()
