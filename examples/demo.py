"""Train one small Haliax MLP twice, in bf16 and with FP8 matmuls, and compare them.

    python examples/demo.py                 # 400 steps, about 10 s on a laptop CPU
    python examples/demo.py --steps 2000    # longer run

The task is regression onto a fixed random "teacher" MLP (In 64 -> Mid 256 -> Out 32),
with a fresh batch of Gaussian inputs at every step. Both runs start from the same
weights, see the same batches and use the same optimizer (Adam). They differ only in how
the two matmuls of each linear layer are done:

- bf16: parameters, activations and matmuls in bfloat16 (via `fp8ax.cast_floating`).
  Plain bf16 trains this model as well as float32 does (the losses agree to a few
  percent), so it is the baseline an FP8 run has to match.
- FP8: the same bf16 model after `fp8ax.fp8_linear_layers`: E4M3 inputs and weights in
  the forward pass, E5M2 output gradients in the backward pass, per-tensor delayed
  scaling. `cast_floating` keeps the FP8 scaling state in float32.

On a CPU, XLA emulates FP8 (it rounds values to FP8, then multiplies in float32), so the
FP8 run shows FP8 *numerics* but is slower, not faster. The speed-up needs a GPU with FP8
tensor cores (H100 and later); the `gemm_report` printed at the end is how you check that
the compiled program really uses FP8 GEMMs there.

The training step is the one from the README, unchanged apart from also returning the loss.
"""

import argparse
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax

import fp8ax

In = hax.Axis("In", 64)
Mid = hax.Axis("Mid", 256)
Out = hax.Axis("Out", 32)


class MLP(eqx.Module):
    up_proj: hax.nn.Linear
    down_proj: hax.nn.Linear

    @staticmethod
    def init(*, key):
        k_up, k_down = jax.random.split(key)
        return MLP(
            up_proj=hax.nn.Linear.init(In, Mid, key=k_up),
            down_proj=hax.nn.Linear.init(Mid, Out, key=k_down),
        )

    def __call__(self, x):
        return self.down_proj(hax.nn.gelu(self.up_proj(x)))


def make_batch(teacher, key, Batch, dtype):
    x = hax.random.normal(key, (Batch, In))
    y = teacher(x)
    return x.astype(dtype), y.astype(dtype)


def loss_fn(model, batch):
    x, y = batch
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def make_step(opt):
    # The README's training step (it also returns the loss). The same function trains the
    # bf16 model, which has no FP8 state: there `overwrite` is all `None`.
    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    return step


def fp8_layers(model):
    """(dotted path, Fp8DotGeneral) for every FP8 layer of `model`."""
    is_dg = lambda x: isinstance(x, fp8ax.Fp8DotGeneral)  # noqa: E731
    leaves, _ = jtu.tree_flatten_with_path(model, is_leaf=is_dg)
    return [
        (jtu.keystr(path, simple=True, separator=".").removesuffix(".dot_general"), dg)
        for path, dg in leaves
        if is_dg(dg)
    ]


def report_rows(steps):
    marks = [1] + [s for s in (10, 25, 50, 100, 200, 300, 500, 1000, 2000, 5000, 10000) if s < steps] + [steps]
    return sorted(set(marks))


def main(steps: int = 400, every: int | None = None, batch: int = 256, lr: float = 3e-3, seed: int = 0):
    every = every or max(1, steps // 10)
    Batch = hax.Axis("Batch", batch)
    k_model, k_teacher, k_data, k_eval = jax.random.split(jax.random.PRNGKey(seed), 4)

    teacher = MLP.init(key=k_teacher)
    model = MLP.init(key=k_model)
    models = {
        "bf16": fp8ax.cast_floating(model, jnp.bfloat16),
        "fp8": fp8ax.cast_floating(fp8ax.fp8_linear_layers(model), jnp.bfloat16),
    }

    opt = fp8ax.skip_fp8_state(optax.adam(lr))  # the optimizer never sees the FP8 state
    step = make_step(opt)
    get_batch = eqx.filter_jit(make_batch)
    opt_states = {}
    for name, m in models.items():
        opt_states[name] = opt.init(eqx.filter(m, eqx.is_array))

    print(f"fp8ax {fp8ax.__version__}, JAX {jax.__version__} on {jax.default_backend()}")
    print(f"MLP {In.size} -> {Mid.size} -> {Out.size}, batch {batch}, Adam lr {lr}, {steps} steps")
    print("FP8 layers:", ", ".join(path for path, _ in fp8_layers(models["fp8"])))
    print()

    losses = {name: [] for name in models}
    seconds = dict.fromkeys(models, 0.0)
    keys = jax.random.split(k_data, steps)
    t_start = time.perf_counter()
    for i in range(steps):
        batch_i = get_batch(teacher, keys[i], Batch, jnp.bfloat16)
        for name in models:
            t0 = time.perf_counter()
            models[name], opt_states[name], loss = step(models[name], opt_states[name], batch_i)
            losses[name].append(float(loss))  # float() waits for the step to finish
            if i > 0:  # step 1 includes compilation
                seconds[name] += time.perf_counter() - t0
        if (i + 1) % every == 0 or i == 0 or i + 1 == steps:
            bf, f8 = losses["bf16"][-1], losses["fp8"][-1]
            print(f"step {i + 1:5d}/{steps}   bf16 loss {bf:.4f}   fp8 loss {f8:.4f}")
    elapsed = time.perf_counter() - t_start

    # Held-out loss: 8192 fresh examples, forward pass only (the FP8 state is used, not updated).
    Eval = hax.Axis("Batch", 8192)
    eval_batch = make_batch(teacher, k_eval, Eval, jnp.bfloat16)
    held_out = {name: float(eqx.filter_jit(loss_fn)(m, eval_batch)) for name, m in models.items()}

    print("\nLoss (training loss at the step, before its update)")
    print(f"  {'step':>14}  {'bf16':>8}  {'fp8':>8}  {'fp8 vs bf16':>11}")

    def row(label, bf, f8):
        print(f"  {label:>14}  {bf:8.4f}  {f8:8.4f}  {100 * (f8 - bf) / bf:+10.1f}%")

    for s in report_rows(steps):
        row(str(s), losses["bf16"][s - 1], losses["fp8"][s - 1])
    tail = max(1, steps // 10)
    mean = {name: sum(v[-tail:]) / tail for name, v in losses.items()}
    row(f"mean last {tail}", mean["bf16"], mean["fp8"])
    row("held-out", held_out["bf16"], held_out["fp8"])

    print("\nFP8 scaling state after training (dequantization scales: quantize as x / scale)")
    print(
        f"  {'layer':<10} {'tensor':<5} {'format':<7} {'scale':>10} {'amax':>10} "
        f"{'max(history)':>13} {'next scale':>11}  observed"
    )
    for path, dg in fp8_layers(models["fp8"]):
        for tensor in ("lhs", "rhs", "grad"):
            state = getattr(dg, tensor)
            dtype = dg.recipe.grad_dtype if tensor == "grad" else dg.recipe.fwd_dtype
            fp8_max = float(jnp.finfo(dtype).max)
            hist = state.amax_history
            amax_max = float(jnp.max(hist))
            print(
                f"  {path:<10} {tensor:<5} {'E5M2' if tensor == 'grad' else 'E4M3':<7} "
                f"{float(state.scale):10.3e} {float(hist[0]):10.3e} {amax_max:13.3e} "
                f"{amax_max / fp8_max:11.3e}  {int(jnp.sum(hist > 0))} steps"
            )
    print(
        "  lhs = layer input, rhs = weight, grad = gradient of the layer output.\n"
        "  scale = the scale the last step used; amax = max|x| that step saw (newest history entry);\n"
        "  next scale = max(history) / fp8_max (448 for E4M3, 57344 for E5M2), what the next step uses."
    )

    dtypes = {str(x.dtype) for x in jtu.tree_leaves(models["fp8"]) if eqx.is_array(x)}
    print(f"\nFP8 model array dtypes: {sorted(dtypes)} (weights bf16, FP8 state float32)")

    report = fp8ax.gemm_report(step, models["fp8"], opt_states["fp8"], batch_i)
    print(
        f"gemm_report on {report.backend}: {report.lowered_fp8}/{report.lowered_total} dot_generals in the "
        f"lowered program take FP8 operands; {report.compiled_fp8}/{report.compiled_total} matmuls in the "
        "compiled program run in FP8."
    )
    if report.backend == "cpu":
        print(
            "  XLA's CPU backend upcasts FP8 operands before each matmul, so 0 is expected here. Run the same\n"
            "  check on the GPU you train on: there `compiled_fp8` counts the matmuls XLA really runs in FP8."
        )

    per_step = {name: 1000 * s / max(1, steps - 1) for name, s in seconds.items()}
    print(
        f"\nTime per step (after compilation): bf16 {per_step['bf16']:.1f} ms, fp8 {per_step['fp8']:.1f} ms; "
        f"training loop {elapsed:.1f} s in total."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--every", type=int, default=None, help="print the losses every N steps (default steps/10)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, every=args.every, batch=args.batch, lr=args.lr, seed=args.seed)
