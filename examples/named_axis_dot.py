"""FP8 named-axis matmuls: `hax.dot(..., dot_general=fp8ax.Fp8DotGeneral)` in your own module.

    python examples/named_axis_dot.py             # 100 steps, a few seconds on a CPU
    python examples/named_axis_dot.py --steps 500

`fp8ax.fp8_linear_layers` only finds `haliax.nn.Linear` and `equinox.nn.Linear`. For any
other matmul, hold an `fp8ax.Fp8DotGeneral` as a field of your module (one per matmul: it
carries that matmul's scaling state) and pass it as the `dot_general` of `hax.dot`. The
training step is unchanged: `partition_for_grad_overwrite` and `apply_updates` find every
`Fp8DotGeneral` in the model, wherever it sits.
"""

import argparse

import equinox as eqx
import haliax as hax
import jax
import optax

import fp8ax

Batch = hax.Axis("Batch", 128)
Embed = hax.Axis("Embed", 32)
Hidden = hax.Axis("Hidden", 128)


# --8<-- [start:module]
class ResidualMLP(eqx.Module):
    w_up: hax.NamedArray  # axes (Embed, Hidden)
    w_down: hax.NamedArray  # axes (Hidden, Embed)
    up_dot: fp8ax.Fp8DotGeneral
    down_dot: fp8ax.Fp8DotGeneral

    @staticmethod
    def init(*, key):
        k_up, k_down = jax.random.split(key)
        return ResidualMLP(
            w_up=hax.random.normal(k_up, (Embed, Hidden)) / Embed.size**0.5,
            w_down=hax.random.normal(k_down, (Hidden, Embed)) / Hidden.size**0.5,
            up_dot=fp8ax.Fp8DotGeneral.init(),
            down_dot=fp8ax.Fp8DotGeneral.init(),
        )

    def __call__(self, x):  # x: (Batch, Embed)
        h = hax.dot(x, self.w_up, axis=Embed, dot_general=self.up_dot)  # (Batch, Hidden)
        return x + hax.dot(hax.nn.relu(h), self.w_down, axis=Hidden, dot_general=self.down_dot)


# --8<-- [end:module]


def loss_fn(model, batch):
    x, y = batch
    return hax.mean((model(x) - y) ** 2).scalar()


opt = fp8ax.skip_fp8_state(optax.adam(3e-3))  # the optimizer never sees the FP8 state


@eqx.filter_jit
def step(model, opt_state, batch):
    grads = eqx.filter_grad(loss_fn)(model, batch)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return fp8ax.apply_updates(model, updates, overwrite), opt_state


def main(steps: int = 100):
    k_model, k_x = jax.random.split(jax.random.PRNGKey(0))
    x = hax.random.normal(k_x, (Batch, Embed))
    y = x + hax.sin(2 * x)  # a residual target
    batch = (x, y)

    model = ResidualMLP.init(key=k_model)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))

    evaluate = eqx.filter_jit(loss_fn)
    every = max(1, steps // 5)
    for i in range(steps):
        if i % every == 0:
            print(f"step {i:4d}  loss {float(evaluate(model, batch)):.4f}")
        model, opt_state = step(model, opt_state, batch)
    print(f"step {steps:4d}  loss {float(evaluate(model, batch)):.4f}")

    for name in ("up_dot", "down_dot"):
        dg = getattr(model, name)
        print(
            f"{name}: scales lhs {float(dg.lhs.scale):.3e}  rhs {float(dg.rhs.scale):.3e}  "
            f"grad {float(dg.grad.scale):.3e}"
        )
    report = fp8ax.gemm_report(step, model, opt_state, batch)
    print(f"dot_generals with FP8 operands in the training step: {report.lowered_fp8}/{report.lowered_total}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    main(steps=parser.parse_args().steps)
