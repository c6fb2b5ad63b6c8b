"""bench/gpu_llama.py's model: a stack of Llama layers (Haliax), in each layout, and the
README's training step for each variant."""

from __future__ import annotations


def _attention(q, k, v, impl):
    import jax

    # (batch, position, heads, head_size) arrays; causal; cuDNN's fused kernel on a GPU.
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def build_model(s: dict[str, int], layout: str, key, impl):
    import equinox as eqx
    import haliax as hax
    import jax

    Embed, Mlp = hax.Axis("embed", s["hidden"]), hax.Axis("mlp", s["mlp"])
    Heads, HeadSize = hax.Axis("heads", s["heads"]), hax.Axis("head_size", s["head_size"])
    order = ("batch", "position", "heads", "head_size")

    class Layer(eqx.Module):
        norm1: hax.nn.RmsNorm
        q: hax.nn.Linear
        k: hax.nn.Linear
        v: hax.nn.Linear
        o: hax.nn.Linear
        norm2: hax.nn.RmsNorm
        gate: hax.nn.Linear
        up: hax.nn.Linear
        down: hax.nn.Linear

        @staticmethod
        def init(key):
            ks = jax.random.split(key, 7)
            lin = lambda i, o, k: hax.nn.Linear.init(i, o, key=k, use_bias=False)  # noqa: E731
            return Layer(
                hax.nn.RmsNorm.init(Embed, use_bias=False),
                lin(Embed, (Heads, HeadSize), ks[0]),
                lin(Embed, (Heads, HeadSize), ks[1]),
                lin(Embed, (Heads, HeadSize), ks[2]),
                lin((Heads, HeadSize), Embed, ks[3]),
                hax.nn.RmsNorm.init(Embed, use_bias=False),
                lin(Embed, Mlp, ks[4]),
                lin(Embed, Mlp, ks[5]),
                lin(Mlp, Embed, ks[6]),
            )

        def __call__(self, x):
            h = self.norm1(x)
            q, k, v = (p(h).rearrange(order).array for p in (self.q, self.k, self.v))
            att = hax.named(_attention(q, k, v, impl), order)
            x = x + self.o(att)
            h = self.norm2(x)
            return x + self.down(hax.nn.silu(self.gate(h)) * self.up(h))

    Layers = hax.Axis("layers", s["layers"])
    if layout == "unrolled":
        return tuple(Layer.init(k) for k in jax.random.split(key, s["layers"]))
    stacked = hax.nn.Stacked.init(Layers, Layer, gradient_checkpointing=layout == "scan_remat")
    return stacked(key=jax.random.split(key, s["layers"]))


def forward(model, x):
    if isinstance(model, tuple):
        for layer in model:
            x = layer(x)
        return x
    return model.fold(x)


def make_step(variant: str, model, opt):
    """`(model, opt_state, step)`: the README's training step for `variant`, jitted as a
    user would (FP8 variants and `bf16_notriton` with `fp8ax.compiler_options()`)."""
    import equinox as eqx
    import haliax as hax
    import haliax.quantization as haxq
    import jax.numpy as jnp

    import fp8ax

    def loss_fn(model, x, y):
        return hax.mean(hax.square((forward(model, x) - y).astype(jnp.float32))).scalar()

    options = {} if variant == "bf16" else {"compiler_options": fp8ax.compiler_options()}
    if variant in ("bf16", "bf16_notriton"):

        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return eqx.apply_updates(model, updates), opt_state, loss

        return model, opt.init(eqx.filter(model, eqx.is_array)), eqx.filter_jit(step, **options)
    if variant == "haliax_fp8":
        model = haxq.quantize_linear_layers(model, haxq.QuantizationConfig(fp8=True))
        trained = lambda m: eqx.filter(haxq.partition_for_grad_overwrite(m)[1], eqx.is_array)  # noqa: E731

        def step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            overwrite, grads = haxq.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=trained(model))
            return haxq.apply_updates(model, updates, overwrite), opt_state, loss

        return model, opt.init(trained(model)), eqx.filter_jit(step, **options)
    recipe = {
        "fp8ax": fp8ax.DelayedScaling(),
        "fp8ax_current": fp8ax.CurrentScaling(),
        "fp8ax_nocal": fp8ax.DelayedScaling(calibrate_first_call=False),
    }[variant]
    model = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(recipe=recipe))
    opt = fp8ax.skip_fp8_state(opt)

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    return model, opt.init(eqx.filter(model, eqx.is_array)), eqx.filter_jit(step, **options)


def step_flops(s: dict[str, int]) -> float:
    """Model FLOPs of one training step (forward and backward, no recomputation): the
    linear layers' 6 * parameters * tokens, and causal attention's 6 * batch * seq^2 *
    heads * head_size per layer (the useful half of QK^T and PV, forward and backward)."""
    d, a, m = s["hidden"], s["heads"] * s["head_size"], s["mlp"]
    tokens = s["batch"] * s["seq"]
    linear = 6 * tokens * (4 * d * a + 3 * d * m)
    attention = 6 * s["batch"] * s["seq"] ** 2 * a
    return s["layers"] * (linear + attention)


def setup(variant: str, layout: str, s: dict[str, int], gpu: bool):
    """`(model, opt_state, step, x, y)` for `variant` in `layout`, built and on the device
    (the model, input and target made by one jitted function: one compile, not one per op)."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp
    import optax

    import fp8ax

    impl = "cudnn" if gpu else None

    @eqx.filter_jit
    def make(key):
        k_model, k_x, k_y = jax.random.split(key, 3)
        model = fp8ax.cast_floating(build_model(s, layout, k_model, impl), jnp.bfloat16)
        shape = (s["batch"], s["seq"], s["hidden"])
        return model, jax.random.normal(k_x, shape, jnp.bfloat16), jax.random.normal(k_y, shape, jnp.bfloat16)

    model, x, y = make(jax.random.key(0, impl="rbg"))
    axes = (hax.Axis("batch", s["batch"]), hax.Axis("position", s["seq"]), hax.Axis("embed", s["hidden"]))
    x, y = hax.named(x, axes), hax.named(y, axes)
    model, opt_state, step = make_step(variant, model, optax.adam(1e-4))
    jax.block_until_ready(eqx.filter((model, opt_state, x, y), eqx.is_array))
    return model, opt_state, step, x, y
