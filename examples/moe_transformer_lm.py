"""A small mixture-of-experts transformer, trained on Shakespeare in bf16 and with FP8 experts.

    python examples/moe_transformer_lm.py                  # 300 steps, a few minutes on a 2-core CPU
    python examples/moe_transformer_lm.py --steps 3 --layers 1 --seq 16 --batch 4 --embed 32   # smoke test

The model of examples/haliax_transformer_lm.py (character-level, pre-norm blocks in a
`haliax.nn.Stacked`, the same data, batches and held-out split) with its MLP replaced by a
mixture of experts: a router (`haliax.nn.Linear`, Embed -> Experts) picks the top `--top-k`
of `--experts` experts for every token, the token's copies are sorted by expert, and two
`haliax.nn.MoELinear` layers (Embed -> Mlp -> Embed, one weight per expert) run on the
sorted copies as grouped GEMMs (`jax.lax.ragged_dot`); their outputs, weighted by the
router's renormalized probabilities, are added back to their tokens.

`fp8ax.fp8_linear_layers` turns each `MoELinear` into an `fp8ax.Fp8MoELinear`, whose three
grouped GEMMs (forward, input gradient, weight gradient) run on FP8 operands with one
scale per expert for the weights (`fp8ax.Fp8RaggedDot`); the attention projections become
FP8 too. The router (4 outputs), embeddings, attention scores and the head stay in bf16.

Printed: the conversion report, both runs' training losses side by side, the held-out
losses, the time per step of each run (on a CPU FP8 is emulated, so this is the cost of
the emulation, not FP8 speed), and the per-expert weight scales of the first MoE layer.
"""

import argparse
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax
from haliax_transformer_lm import DATA, Qkv, loss_fn, make_step, windows

import fp8ax


class MoeBlock(eqx.Module):
    """Pre-norm block: causal multi-head self-attention, then a top-k mixture of experts."""

    attn_norm: hax.nn.LayerNorm
    qkv_proj: hax.nn.Linear
    o_proj: hax.nn.Linear
    moe_norm: hax.nn.LayerNorm
    router: hax.nn.Linear  # Embed -> Experts
    up: hax.nn.MoELinear  # (Experts, Embed, Mlp)
    down: hax.nn.MoELinear  # (Experts, Mlp, Embed)
    Pos: hax.Axis = eqx.field(static=True)
    HeadSize: hax.Axis = eqx.field(static=True)
    top_k: int = eqx.field(static=True)

    @staticmethod
    def init(Pos, Embed, Heads, HeadSize, Mlp, Experts, top_k, *, key):
        k = jax.random.split(key, 5)
        return MoeBlock(
            attn_norm=hax.nn.LayerNorm.init(Embed),
            qkv_proj=hax.nn.Linear.init(Embed, (Qkv, Heads, HeadSize), key=k[0], use_bias=False),
            o_proj=hax.nn.Linear.init((Heads, HeadSize), Embed, key=k[1], use_bias=False),
            moe_norm=hax.nn.LayerNorm.init(Embed),
            router=hax.nn.Linear.init(Embed, Experts, key=k[2], use_bias=False),
            up=hax.nn.MoELinear.init(Experts, Embed, Mlp, key=k[3]),
            down=hax.nn.MoELinear.init(Experts, Mlp, Embed, key=k[4]),
            Pos=Pos,
            HeadSize=HeadSize,
            top_k=top_k,
        )

    def __call__(self, x):  # x: (Batch, Pos, Embed)
        KPos = self.Pos.alias("key_position")
        qkv = self.qkv_proj(self.attn_norm(x))
        q = qkv["qkv", 0]
        k = qkv["qkv", 1].rename({self.Pos: KPos})
        v = qkv["qkv", 2].rename({self.Pos: KPos})
        mask = hax.nn.attention.causal_mask(self.Pos, KPos)
        x = x + self.o_proj(hax.nn.attention.dot_product_attention(KPos, self.HeadSize, q, k, v, mask=mask))
        return x + self.experts(self.moe_norm(x))

    def experts(self, h):
        Batch, Pos, Embed = h.axes
        Experts = self.up.Experts
        tokens = h.array.reshape(-1, Embed.size)  # (T, Embed)
        probs = jax.nn.softmax(self.router(h).array.reshape(-1, Experts.size).astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)  # (T, k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        # Each token's k copies, sorted by expert: the groups of the grouped GEMMs.
        order = jnp.argsort(chosen.reshape(-1), stable=True)
        token_of = order // self.top_k
        sizes = hax.named(jnp.bincount(chosen.reshape(-1), length=Experts.size).astype(jnp.int32), Experts)
        Slot = hax.Axis("slot", order.shape[0])
        y = self.down(hax.nn.gelu(self.up(hax.named(tokens[token_of], (Slot, Embed)), sizes)), sizes).array
        y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
        out = jnp.zeros_like(tokens).at[token_of].add(y)
        return hax.named(out.reshape(Batch.size, Pos.size, Embed.size), (Batch, Pos, Embed))


class MoeTransformer(eqx.Module):
    token_embed: hax.nn.Embedding
    pos_embed: hax.NamedArray
    blocks: hax.nn.Stacked
    final_norm: hax.nn.LayerNorm
    head: hax.nn.Linear

    @staticmethod
    def init(Vocab, Pos, Embed, Heads, HeadSize, Mlp, Experts, top_k, Layers, *, key):
        k_tok, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        blocks = hax.nn.Stacked.init(Layers, MoeBlock)(
            Pos, Embed, Heads, HeadSize, Mlp, Experts, top_k, key=jax.random.split(k_blocks, Layers.size)
        )
        return MoeTransformer(
            token_embed=hax.nn.Embedding.init(Vocab, Embed, key=k_tok),
            pos_embed=hax.random.normal(k_pos, (Pos, Embed)) * 0.02,
            blocks=blocks,
            final_norm=hax.nn.LayerNorm.init(Embed),
            head=hax.nn.Linear.init(Embed, Vocab, key=k_head),
        )

    def __call__(self, tokens):
        x = self.token_embed(tokens) + self.pos_embed.astype(self.token_embed.weight.dtype)
        return self.head(self.final_norm(self.blocks.fold(x)))


def main(steps=300, batch=32, seq=64, embed=64, heads=4, layers=2, experts=4, top_k=2, lr=3e-3, seed=0, every=None):
    text = DATA.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = jnp.array([index[c] for c in text], dtype=jnp.int32)
    split = int(0.9 * len(text))
    train_ids, val_ids = ids[:split], ids[split:]

    Vocab, Batch, Pos = hax.Axis("vocab", len(chars)), hax.Axis("batch", batch), hax.Axis("position", seq)
    Embed, Heads = hax.Axis("embed", embed), hax.Axis("heads", heads)
    HeadSize, Mlp = hax.Axis("head_size", embed // heads), hax.Axis("mlp", 2 * embed)
    Experts, Layers = hax.Axis("experts", experts), hax.Axis("layers", layers)

    k_model, k_data, k_val = jax.random.split(jax.random.PRNGKey(seed), 3)
    model = MoeTransformer.init(Vocab, Pos, Embed, Heads, HeadSize, Mlp, Experts, top_k, Layers, key=k_model)
    # Attention projections and experts in FP8; the router, embeddings and head in bf16.
    config = fp8ax.Fp8Config(targets=r"blocks\.stacked\.(qkv_proj|o_proj|up|down)")
    models = {
        "bf16": fp8ax.cast_floating(model, jnp.bfloat16),
        "fp8": fp8ax.cast_floating(fp8ax.fp8_linear_layers(model, config), jnp.bfloat16),
    }
    opt = fp8ax.skip_fp8_state(optax.adam(lr))  # the optimizer never sees the FP8 state
    step = make_step(opt)
    opt_states = {name: opt.init(eqx.filter(m, eqx.is_array)) for name, m in models.items()}

    print(f"fp8ax {fp8ax.__version__}, JAX {jax.__version__} on {jax.default_backend()}")
    print(
        f"{layers} layers, {experts} experts (top {top_k}), embed {embed}, context {seq}, batch {batch}, "
        f"Adam lr {lr}, {steps} steps"
    )
    print(fp8ax.conversion_report(model, config), end="\n\n")

    get_batch = jax.jit(windows, static_argnums=(2, 3))
    starts = jax.random.randint(k_data, (steps, batch), 0, len(train_ids) - seq - 1)
    every = every or max(1, steps // 10)
    losses = {name: [] for name in models}
    seconds = {name: 0.0 for name in models}
    print(f"{'step':>6}  {'bf16 loss':>9}  {'fp8 loss':>9}")
    for i in range(steps):
        inputs, targets = get_batch(train_ids, starts[i], Batch, Pos)
        for name in models:
            t0 = time.perf_counter()
            models[name], opt_states[name], loss = step(models[name], opt_states[name], inputs, targets)
            losses[name].append(float(loss))  # waits for the step
            if i >= 2:  # after the compilation (each run compiles its step once) and a warm-up step
                seconds[name] += time.perf_counter() - t0
        if i == 0 or (i + 1) % every == 0 or i + 1 == steps:
            print(f"{i + 1:6d}  {losses['bf16'][-1]:9.4f}  {losses['fp8'][-1]:9.4f}")

    n_val = 8
    val_starts = jax.random.randint(k_val, (n_val, batch), 0, len(val_ids) - seq - 1)
    evaluate = eqx.filter_jit(loss_fn)
    held_out = {}
    for name, m in models.items():
        vals = [evaluate(m, *get_batch(val_ids, val_starts[j], Batch, Pos)) for j in range(n_val)]
        held_out[name] = float(sum(vals) / n_val)
    gap = 100 * (held_out["fp8"] - held_out["bf16"]) / held_out["bf16"]
    print(f"\nheld-out loss: bf16 {held_out['bf16']:.4f}, fp8 {held_out['fp8']:.4f} ({gap:+.1f}%)")
    if steps > 2:
        ms = {name: 1000 * s / (steps - 2) for name, s in seconds.items()}
        print(f"time per step: bf16 {ms['bf16']:.1f} ms, fp8 {ms['fp8']:.1f} ms ({ms['fp8'] / ms['bf16']:.2f}x)")
    stats = fp8ax.scaling_stats(models["fp8"])
    scales = [v for k, v in stats.items() if k.startswith("blocks.stacked.up.ragged[0]/rhs[") and k.endswith("/scale")]
    print("first MoE layer, per-expert weight scales:", ", ".join(f"{s:.3g}" for s in scales))
    return held_out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=None)
    a = parser.parse_args()
    main(a.steps, a.batch, a.seq, a.embed, a.heads, a.layers, a.experts, a.top_k, a.lr, a.seed, a.every)
