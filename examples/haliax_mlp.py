"""The README's TL;DR on a Haliax MLP: convert the linear layers to FP8, then train.

python examples/haliax_mlp.py             # 100 steps, a few seconds on a CPU
python examples/haliax_mlp.py --steps 500
python examples/haliax_mlp.py --microbatches 4   # gradient accumulation over 4 microbatches
"""

import argparse

import equinox as eqx
import haliax as hax
import jax
import optax

import fp8ax

# --8<-- [start:model]
Batch = hax.Axis("Batch", 128)
In = hax.Axis("In", 32)
Mid = hax.Axis("Mid", 128)
Out = hax.Axis("Out", 16)


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
        return self.down_proj(hax.nn.relu(self.up_proj(x)))


def loss_fn(model, batch):
    x, y = batch
    return hax.mean((model(x) - y) ** 2).scalar()


# --8<-- [end:model]


opt = fp8ax.skip_fp8_state(optax.adam(1e-2))  # the optimizer never sees the FP8 state


# --8<-- [start:step]
@eqx.filter_jit
def step(model, opt_state, batch):
    grads = eqx.filter_grad(loss_fn)(model, batch)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return fp8ax.apply_updates(model, updates, overwrite), opt_state


# --8<-- [end:step]


# --8<-- [start:microbatch_step]
@eqx.filter_jit
def microbatch_step(model, opt_state, x, y, k):
    # `loss_fn` is a mean, so the gradients are averaged over the k microbatches
    # (`average=True`); the FP8 state is merged with max, never divided.
    grad_fn = fp8ax.microbatched(lambda m, x, y: eqx.filter_grad(loss_fn)(m, (x, y)), k, average=True)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grad_fn(model, x, y))
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return fp8ax.apply_updates(model, updates, overwrite), opt_state


# --8<-- [end:microbatch_step]


def main(steps: int = 100, microbatches: int = 1):
    k_model, k_x, k_w = jax.random.split(jax.random.PRNGKey(0), 3)
    # A fixed regression problem: y = tanh(x . w_true).
    x = hax.random.normal(k_x, (Batch, In))
    y = hax.tanh(hax.dot(x, hax.random.normal(k_w, (In, Out)), axis=In) / In.size**0.5)
    batch = (x, y)

    # --8<-- [start:convert]
    model = MLP.init(key=k_model)
    model = fp8ax.fp8_linear_layers(model)  # every linear layer; see fp8ax.Fp8Config(targets=...)

    opt_state = opt.init(eqx.filter(model, eqx.is_array))  # as Equinox does it
    # --8<-- [end:convert]

    evaluate = eqx.filter_jit(loss_fn)
    every = max(1, steps // 5)
    for i in range(steps):
        if i % every == 0:
            print(f"step {i:4d}  loss {float(evaluate(model, batch)):.4f}")
        if microbatches > 1:
            model, opt_state = microbatch_step(model, opt_state, x, y, microbatches)
        else:
            model, opt_state = step(model, opt_state, batch)
    print(f"step {steps:4d}  loss {float(evaluate(model, batch)):.4f}")

    # --8<-- [start:inspect]
    state = model.up_proj.dot_general.lhs  # also .rhs (the weight) and .grad (the output gradient)
    print("up_proj input: scale", float(state.scale), "latest amax", float(state.amax_history[0]))
    # --8<-- [end:inspect]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    parser.add_argument("--microbatches", type=int, default=1, help="split each batch into this many (default 1)")
    args = parser.parse_args()
    main(steps=args.steps, microbatches=args.microbatches)
