"""A character-level Haliax transformer trained on Shakespeare, in bf16 and with FP8 matmuls.

    python examples/haliax_transformer_lm.py                   # 300 steps, about 80 s on a 2-core CPU
    python examples/haliax_transformer_lm.py --steps 1000 --plot lm_loss.png
    python examples/haliax_transformer_lm.py --steps 3 --layers 1 --seq 16 --batch 4 --embed 32   # smoke test

The model is a small decoder-only transformer: token and position embeddings, `--layers`
pre-norm blocks in a `haliax.nn.Stacked` (causal self-attention and an MLP, all projections
`haliax.nn.Linear`), and a linear head over the characters. It learns to predict the next
character of `examples/data/tinyshakespeare.txt` (public domain, see examples/data/README.md);
the last 10% of the text is held out.

Both runs start from the same weights, see the same batches in the same order and use the
same optimizer (Adam). They differ only in the matmuls of the linear layers inside the blocks:

- bf16: the whole model in bfloat16 (`fp8ax.cast_floating`).
- FP8: the same bf16 model after `fp8ax.fp8_linear_layers` with
  `Fp8Config(targets=r"blocks\\..*")`: the attention and MLP projections of every block run
  as FP8 GEMMs (E4M3 forward, E5M2 gradients, delayed scaling). The embeddings, the
  attention scores and the output head stay in bf16, as is usual for a language model.

The script prints which layers were converted (`fp8ax.conversion_report`), the training loss
of both runs side by side, the held-out loss at the end, the FP8 scaling statistics of every
layer on a held-out batch (`fp8ax.scaling_stats`: the flat dict you would log to W&B or
TensorBoard) and which matmuls of the FP8 training step are FP8 (`fp8ax.gemm_report`). It
saves a plot of the two loss curves (`--plot`) and one of the amax histories of the FP8
layers (`--amax-plot`, `fp8ax.plot_amax_history`); both need matplotlib
(`pip install -e ".[plot]"`). On a CPU, FP8 is emulated: you see FP8 numerics, not FP8 speed.
"""

import argparse
import pathlib
import time

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import optax

import fp8ax

DATA = pathlib.Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"

Qkv = hax.Axis("qkv", 3)


class Block(eqx.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    attn_norm: hax.nn.LayerNorm
    qkv_proj: hax.nn.Linear  # Embed -> (qkv, Heads, HeadSize)
    o_proj: hax.nn.Linear  # (Heads, HeadSize) -> Embed
    mlp_norm: hax.nn.LayerNorm
    up_proj: hax.nn.Linear  # Embed -> Mlp
    down_proj: hax.nn.Linear  # Mlp -> Embed
    Pos: hax.Axis = eqx.field(static=True)
    HeadSize: hax.Axis = eqx.field(static=True)

    @staticmethod
    def init(Pos, Embed, Heads, HeadSize, Mlp, *, key):
        k_qkv, k_o, k_up, k_down = jax.random.split(key, 4)
        return Block(
            attn_norm=hax.nn.LayerNorm.init(Embed),
            qkv_proj=hax.nn.Linear.init(Embed, (Qkv, Heads, HeadSize), key=k_qkv, use_bias=False),
            o_proj=hax.nn.Linear.init((Heads, HeadSize), Embed, key=k_o, use_bias=False),
            mlp_norm=hax.nn.LayerNorm.init(Embed),
            up_proj=hax.nn.Linear.init(Embed, Mlp, key=k_up),
            down_proj=hax.nn.Linear.init(Mlp, Embed, key=k_down),
            Pos=Pos,
            HeadSize=HeadSize,
        )

    def __call__(self, x):  # x: (Batch, Pos, Embed)
        KPos = self.Pos.alias("key_position")
        qkv = self.qkv_proj(self.attn_norm(x))
        q = qkv["qkv", 0]
        k = qkv["qkv", 1].rename({self.Pos: KPos})
        v = qkv["qkv", 2].rename({self.Pos: KPos})
        mask = hax.nn.attention.causal_mask(self.Pos, KPos)
        attn = hax.nn.attention.dot_product_attention(KPos, self.HeadSize, q, k, v, mask=mask)
        x = x + self.o_proj(attn)
        return x + self.down_proj(hax.nn.gelu(self.up_proj(self.mlp_norm(x))))


class CharTransformer(eqx.Module):
    token_embed: hax.nn.Embedding
    pos_embed: hax.NamedArray  # (Pos, Embed)
    blocks: hax.nn.Stacked  # Stacked[Block] over the Layers axis
    final_norm: hax.nn.LayerNorm
    head: hax.nn.Linear  # Embed -> Vocab

    @staticmethod
    def init(Vocab, Pos, Embed, Heads, HeadSize, Mlp, Layers, *, key):
        k_tok, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        blocks = hax.nn.Stacked.init(Layers, Block)(
            Pos, Embed, Heads, HeadSize, Mlp, key=jax.random.split(k_blocks, Layers.size)
        )
        return CharTransformer(
            token_embed=hax.nn.Embedding.init(Vocab, Embed, key=k_tok),
            pos_embed=hax.random.normal(k_pos, (Pos, Embed)) * 0.02,
            blocks=blocks,
            final_norm=hax.nn.LayerNorm.init(Embed),
            head=hax.nn.Linear.init(Embed, Vocab, key=k_head),
        )

    def __call__(self, tokens):  # tokens: (Batch, Pos) int32 -> logits (Batch, Pos, Vocab)
        x = self.token_embed(tokens) + self.pos_embed.astype(self.token_embed.weight.dtype)
        x = self.blocks.fold(x)
        return self.head(self.final_norm(x))


def loss_fn(model, inputs, targets):
    """Mean next-character cross-entropy, in float32."""
    logits = model(inputs).astype(jnp.float32)
    Vocab = model.head.Out
    log_probs = hax.nn.log_softmax(logits, axis=Vocab)
    return -hax.mean(hax.sum(log_probs * hax.nn.one_hot(targets, Vocab), axis=Vocab)).scalar()


def make_step(opt):
    # The training step of examples/haliax_mlp.py, also returning the loss. It trains the bf16
    # model too: without FP8 layers, `overwrite` is all `None`.
    @eqx.filter_jit
    def step(model, opt_state, inputs, targets):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, inputs, targets)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state, loss

    return step


def windows(ids, starts, Batch, Pos):
    """Input and target windows of `Pos` characters starting at `starts` (targets shifted by one)."""
    idx = starts[:, None] + jnp.arange(Pos.size + 1)[None, :]
    chunk = ids[idx]
    return hax.named(chunk[:, :-1], (Batch, Pos)), hax.named(chunk[:, 1:], (Batch, Pos))


def save_plot(path, steps, losses, held_out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f'matplotlib is not installed, so no plot was written (pip install -e ".[plot]" to get {path}).')
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("bf16", "tab:blue"), ("fp8", "tab:orange")):
        ax.plot(steps, losses[name], color=color, alpha=0.35, linewidth=0.8)
        ax.plot(steps, _smooth(losses[name]), color=color, label=f"{name} (held-out {held_out[name]:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per character)")
    ax.set_title("Char-level transformer on Shakespeare: bf16 vs FP8")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curves saved to {path}")


def _smooth(values, width=10):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= width:
            acc -= values[i - width]
        out.append(acc / min(i + 1, width))
    return out


# `--recipe`: the FP8 recipe of the converted layers.
RECIPES = {
    "delayed": fp8ax.DelayedScaling(),  # E4M3 forward, E5M2 gradients, one scale per tensor from its history
    "blockwise": fp8ax.BlockwiseScaling(),  # DeepSeek-V3: E4M3, 1x128 activation tiles, 128x128 weight blocks
    "current": fp8ax.CurrentScaling(),
    "mx": fp8ax.MXScaling(),  # MXFP8 as trained now: blocks of 32, scales rounded up, E4M3 everywhere
    "mx-ocp": fp8ax.MXScaling(grad_element="e5m2", scale_rule="floor"),  # the OCP spec's rule, E5M2 gradients
    # NVFP4 as NVIDIA trains it: E2M1, E4M3 scales per 16, a tensor scale, 16x16 weight blocks,
    # the Hadamard-rotated weight gradient, stochastically rounded gradients; then without
    # the rotation, without stochastic rounding, and without either.
    "nvfp4": fp8ax.NVFP4Scaling(),
    "nvfp4-no-rht": fp8ax.NVFP4Scaling(hadamard=False),
    "nvfp4-no-sr": fp8ax.NVFP4Scaling(stochastic_gradients=False),
    "nvfp4-rn": fp8ax.NVFP4Scaling(hadamard=False, stochastic_gradients=False),
}


def main(
    steps: int = 300,
    batch: int = 32,
    seq: int = 64,
    embed: int = 64,
    heads: int = 4,
    layers: int = 2,
    lr: float = 3e-3,
    seed: int = 0,
    plot: str | None = "lm_loss.png",
    every: int | None = None,
    amax_plot: str | None = "lm_amax.png",
    recipe: str = "delayed",
):
    if embed % heads:
        raise ValueError(f"`--embed` ({embed}) must be a multiple of `--heads` ({heads}).")
    text = DATA.read_text()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = jnp.array([index[c] for c in text], dtype=jnp.int32)
    split = int(0.9 * len(text))
    train_ids, val_ids = ids[:split], ids[split:]

    Vocab = hax.Axis("vocab", len(chars))
    Batch = hax.Axis("batch", batch)
    Pos = hax.Axis("position", seq)
    Embed = hax.Axis("embed", embed)
    Heads = hax.Axis("heads", heads)
    HeadSize = hax.Axis("head_size", embed // heads)
    Mlp = hax.Axis("mlp", 4 * embed)
    Layers = hax.Axis("layers", layers)

    k_model, k_data, k_val = jax.random.split(jax.random.PRNGKey(seed), 3)
    model = CharTransformer.init(Vocab, Pos, Embed, Heads, HeadSize, Mlp, Layers, key=k_model)
    # The block projections; embeddings and head stay bf16.
    config = fp8ax.Fp8Config(recipe=RECIPES[recipe], targets=r"blocks\..*")
    models = {
        "bf16": fp8ax.cast_floating(model, jnp.bfloat16),
        "fp8": fp8ax.cast_floating(fp8ax.fp8_linear_layers(model, config), jnp.bfloat16),
    }

    opt = fp8ax.skip_fp8_state(optax.adam(lr))  # the optimizer never sees the FP8 state
    step = make_step(opt)
    opt_states = {}
    for name, m in models.items():
        opt_states[name] = opt.init(eqx.filter(m, eqx.is_array))

    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(models["bf16"], eqx.is_inexact_array)))
    print(f"fp8ax {fp8ax.__version__}, JAX {jax.__version__} on {jax.default_backend()}")
    print(
        f"{len(text):,} characters ({len(chars)} distinct), {layers} layers x {heads} heads, embed {embed}, "
        f"context {seq}, batch {batch}, {n_params:,} parameters, Adam lr {lr}, {steps} steps, FP8 recipe {recipe}"
    )
    print(fp8ax.conversion_report(model, config), end="\n\n")

    get_batch = jax.jit(windows, static_argnums=(2, 3))
    starts = jax.random.randint(k_data, (steps, batch), 0, len(train_ids) - seq - 1)
    every = every or max(1, steps // 10)
    losses = {name: [] for name in models}
    print(f"{'step':>6}  {'bf16 loss':>9}  {'fp8 loss':>9}")
    t0 = time.perf_counter()
    for i in range(steps):
        inputs, targets = get_batch(train_ids, starts[i], Batch, Pos)  # the same batch for both runs
        for name in models:
            models[name], opt_states[name], loss = step(models[name], opt_states[name], inputs, targets)
            losses[name].append(float(loss))
        if i == 0 or (i + 1) % every == 0 or i + 1 == steps:
            print(f"{i + 1:6d}  {losses['bf16'][-1]:9.4f}  {losses['fp8'][-1]:9.4f}")
    elapsed = time.perf_counter() - t0

    # Held-out loss on fixed windows of the last 10% of the text (forward pass only).
    n_val = 8
    val_starts = jax.random.randint(k_val, (n_val, batch), 0, len(val_ids) - seq - 1)
    evaluate = eqx.filter_jit(loss_fn)
    held_out = {}
    for name, m in models.items():
        vals = [evaluate(m, *get_batch(val_ids, val_starts[j], Batch, Pos)) for j in range(n_val)]
        held_out[name] = float(sum(vals) / n_val)
    tail = max(1, steps // 10)
    mean = {name: sum(v[-tail:]) / tail for name, v in losses.items()}
    print(f"\nmean of the last {tail} steps: bf16 {mean['bf16']:.4f}, fp8 {mean['fp8']:.4f}")
    gap = 100 * (held_out["fp8"] - held_out["bf16"]) / held_out["bf16"]
    print(f"held-out loss:            bf16 {held_out['bf16']:.4f}, fp8 {held_out['fp8']:.4f} ({gap:+.1f}%)")
    print(f"training loop: {elapsed:.1f} s for both runs")

    # --8<-- [start:stats]
    # Per-layer scaling statistics on a held-out batch: scale, newest and largest amax of
    # each tensor, and the fractions of lhs/rhs that saturate or flush to zero. A flat
    # {name: float} dict: `wandb.log(stats, step=i)` or `writer.add_scalar(k, v, i)` as it is.
    stats = fp8ax.scaling_stats(models["fp8"], evaluate, *get_batch(val_ids, val_starts[0], Batch, Pos))
    # --8<-- [end:stats]
    print_stats(stats)

    report = fp8ax.gemm_report(step, models["fp8"], opt_states["fp8"], inputs, targets)
    print(f"\n{report}")
    print(f"every GEMM of the converted layers FP8 in the lowered program: {report.lowered_converted_all_fp8}")

    if plot:
        save_plot(plot, list(range(1, steps + 1)), losses, held_out)
    if amax_plot and config.settings.stateful:  # only delayed scaling has amax histories
        try:
            # --8<-- [start:plot]
            fp8ax.plot_amax_history(models["fp8"], amax_plot, title=f"amax histories after {steps} steps")
            # --8<-- [end:plot]
            print(f"amax histories saved to {amax_plot}")
        except ImportError as e:
            print(f"{e} No amax plot written.")


def print_stats(stats):
    """The `scaling_stats` dict as a table: one row per layer and tensor."""
    rows = {}
    for key, value in stats.items():
        layer, tensor, name = key.rsplit("/", 2)
        rows.setdefault((layer, tensor), {})[name] = value
    print("\nFP8 scaling on a held-out batch (fp8ax.scaling_stats):")
    width = max(len(layer) for layer, _ in rows)
    print(
        f"  {'layer':<{width}}  tensor  {'scale':>9}  {'amax':>9}  {'hist max':>9}  {'saturated':>9}  {'underflow':>9}"
    )
    for (layer, tensor), v in rows.items():
        cells = [f"{v[n]:9.3g}" if n in v else f"{'':>9}" for n in ("scale", "amax", "amax_history_max")]
        cells += [f"{v[n]:9.2%}" if n in v else f"{'':>9}" for n in ("saturation", "underflow")]
        print(f"  {layer:<{width}}  {tensor:<6}  " + "  ".join(cells))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch (default 32)")
    parser.add_argument("--seq", type=int, default=64, help="context length in characters (default 64)")
    parser.add_argument("--embed", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=None, help="print the losses every N steps (default steps/10)")
    parser.add_argument(
        "--plot", default="lm_loss.png", help="where to save the loss curves (default lm_loss.png); '' for no plot"
    )
    parser.add_argument(
        "--amax-plot",
        default="lm_amax.png",
        help="where to save the amax histories of the FP8 layers (default lm_amax.png); '' for no plot",
    )
    parser.add_argument(
        "--recipe",
        default="delayed",
        choices=sorted(RECIPES),
        help="FP8 recipe of the converted layers (default delayed)",
    )
    args = parser.parse_args()
    main(
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        embed=args.embed,
        heads=args.heads,
        layers=args.layers,
        lr=args.lr,
        seed=args.seed,
        plot=args.plot,
        every=args.every,
        amax_plot=args.amax_plot,
        recipe=args.recipe,
    )
