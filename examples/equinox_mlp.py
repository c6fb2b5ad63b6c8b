"""FP8 training of a plain `equinox.nn.MLP`, called per example under `jax.vmap`.

    python examples/equinox_mlp.py             # 100 steps, a few seconds on a CPU
    python examples/equinox_mlp.py --steps 500

`fp8ax.fp8_linear_layers` replaces each `eqx.nn.Linear` inside the MLP by an
`fp8ax.Fp8Linear` that keeps its `weight` and `bias`. Under `jax.vmap` every example's
call observes its own amax; fp8ax merges them with a max, so each layer records one amax
per step for the whole batch, exactly as if it had been called on the batch at once.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import fp8ax


# --8<-- [start:loss]
def loss_fn(model, batch):
    x, y = batch  # x: (batch, 32), y: (batch, 8)
    pred = jax.vmap(model)(x)  # the model sees one example, shape (32,), at a time
    return jnp.mean((pred - y) ** 2)


# --8<-- [end:loss]


opt = fp8ax.skip_fp8_state(optax.adam(3e-3))  # the optimizer never sees the FP8 state


@eqx.filter_jit
def step(model, opt_state, batch):
    grads = eqx.filter_grad(loss_fn)(model, batch)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return fp8ax.apply_updates(model, updates, overwrite), opt_state


def main(steps: int = 100):
    k_model, k_x, k_w = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k_x, (256, 32))
    y = jnp.sin(x @ jax.random.normal(k_w, (32, 8)) / 32**0.5)
    batch = (x, y)

    # --8<-- [start:convert]
    model = eqx.nn.MLP(in_size=32, out_size=8, width_size=128, depth=2, key=k_model)
    model = fp8ax.fp8_linear_layers(model)  # layers.0, layers.1, layers.2 -> fp8ax.Fp8Linear

    # eqx.nn.MLP also holds its activation functions: give the optimizer only the arrays.
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    # --8<-- [end:convert]
    print("layers:", [type(layer).__name__ for layer in model.layers])

    evaluate = eqx.filter_jit(loss_fn)
    every = max(1, steps // 5)
    for i in range(steps):
        if i % every == 0:
            print(f"step {i:4d}  loss {float(evaluate(model, batch)):.4f}")
        model, opt_state = step(model, opt_state, batch)
    print(f"step {steps:4d}  loss {float(evaluate(model, batch)):.4f}")

    for i, layer in enumerate(model.layers):
        dg = layer.dot_general
        print(
            f"layers.{i}: input amax {float(dg.lhs.amax_history[0]):.3f}  "
            f"weight amax {float(dg.rhs.amax_history[0]):.3f}  "
            f"grad amax {float(dg.grad.amax_history[0]):.2e}"
        )
    # One amax per step for the whole batch, not one per example (and not a sum of them):
    print("amax of the first layer's input, last step:", float(model.layers[0].dot_general.lhs.amax_history[0]))
    print("max |x| over the batch:                     ", float(jnp.max(jnp.abs(x))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    main(steps=parser.parse_args().steps)
