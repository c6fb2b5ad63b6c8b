"""bench/gpu_train.py's decoder parts: the Llama-shaped decoder layer, its train step per
variant, and what a decoder part measures (bench/gpu_profile.py builds the same layer)."""

from __future__ import annotations

import math
import time
from typing import Any

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp

from _harness import block as _block, stats as _stats
from _train_parts import (
    DECODER_DRY,
    DECODER_FULL,
    DECODER_GEMMS,
    EV_BACKEND_COMPILE,
    EV_TRACE,
    FP8AX_RECIPES,
    MARGIN_S,
)
from _train_record import Events, Recorder, _compiled_text, _time_left, cache_counts, error_info, fp8_check

# --------------------------------------------------------------------------------------
# The decoder layer


class RMSNorm(eqx.Module):
    """``x / rms(x) * weight`` over the embedding axis, in float32, weight only."""

    weight: hax.NamedArray
    eps: float = eqx.field(static=True, default=1e-5)

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:
        Embed = self.weight.axes[0]
        x32 = x.astype(jnp.float32)
        inv = hax.rsqrt(hax.mean(x32 * x32, axis=Embed) + self.eps)
        return (x32 * inv * self.weight.astype(jnp.float32)).astype(x.dtype)


class DecoderLayer(eqx.Module):
    """One Llama-shaped layer: RMSNorm, causal attention, residual; RMSNorm, SwiGLU, residual."""

    attn_norm: RMSNorm
    q: hnn.Linear
    k: hnn.Linear
    v: hnn.Linear
    o: hnn.Linear
    mlp_norm: RMSNorm
    gate: hnn.Linear
    up: hnn.Linear
    down: hnn.Linear

    @staticmethod
    def init(Embed: hax.Axis, Heads: hax.Axis, HeadSize: hax.Axis, Mlp: hax.Axis, *, key) -> DecoderLayer:
        kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)

        def linear(In, Out, k):
            return hnn.Linear.init(In=In, Out=Out, key=k, use_bias=False)

        return DecoderLayer(
            attn_norm=RMSNorm(hax.ones(Embed)),
            q=linear(Embed, (Heads, HeadSize), kq),
            k=linear(Embed, (Heads, HeadSize), kk),
            v=linear(Embed, (Heads, HeadSize), kv),
            o=linear((Heads, HeadSize), Embed, ko),
            mlp_norm=RMSNorm(hax.ones(Embed)),
            gate=linear(Embed, Mlp, kg),
            up=linear(Embed, Mlp, ku),
            down=linear(Mlp, Embed, kd),
        )

    def __call__(self, x: hax.NamedArray) -> hax.NamedArray:  # (batch, position, embed)
        Pos = x.resolve_axis("position")
        KPos = Pos.alias("key_position")
        h = self.attn_norm(x)
        q = self.q(h)
        k = self.k(h).rename({"position": "key_position"})
        v = self.v(h).rename({"position": "key_position"})
        head_size = q.resolve_axis("head_size").size
        scores = hax.dot(q, k, axis="head_size").astype(jnp.float32) / math.sqrt(head_size)
        scores = hax.where(hnn.attention.causal_mask(Pos, KPos), scores, -1e9)
        weights = hnn.softmax(scores, axis=KPos).astype(x.dtype)
        x = x + self.o(hax.dot(weights, v, axis=KPos))
        h = self.mlp_norm(x)
        return x + self.down(hnn.silu(self.gate(h)) * self.up(h))


def decoder_loss(model, x: hax.NamedArray, y: hax.NamedArray) -> jax.Array:
    err = (model(x) - y).astype(jnp.float32)
    return hax.mean(err * err).scalar()


def decoder_flops(s: dict[str, int]) -> dict[str, Any]:
    tokens, d, f = s["batch"] * s["seq"], s["hidden"], s["mlp"]
    hd = s["heads"] * s["head_size"]
    in_out = 3 * d * hd + hd * d + 2 * d * f + f * d  # q, k, v, o, gate, up, down
    return {
        "linear_flops": 3 * 2 * tokens * in_out,
        "linear_flops_formula": "3 GEMMs (forward, input gradient, weight gradient) x 2*M*N*K for each of the 7 "
        "projections, M = batch*seq tokens: 6 * tokens * (3*hidden*heads*head_size + heads*head_size*hidden "
        "+ 2*hidden*mlp + mlp*hidden); attention's batched GEMMs not counted",
        "attention_flops": 6 * 2 * s["batch"] * s["heads"] * s["seq"] ** 2 * s["head_size"],
    }


# --------------------------------------------------------------------------------------
# A decoder part


def build_decoder(variant: str, s: dict[str, int], seed: int):
    import haliax.quantization as haxq
    import optax

    import fp8ax

    Batch, Pos = hax.Axis("batch", s["batch"]), hax.Axis("position", s["seq"])
    Embed, Mlp = hax.Axis("embed", s["hidden"]), hax.Axis("mlp", s["mlp"])
    Heads, HeadSize = hax.Axis("heads", s["heads"]), hax.Axis("head_size", s["head_size"])

    @eqx.filter_jit  # one compile instead of one per eager op
    def make(key):
        k_model, k_x, k_y = jax.random.split(key, 3)
        model = fp8ax.cast_floating(DecoderLayer.init(Embed, Heads, HeadSize, Mlp, key=k_model), jnp.bfloat16)
        shape = (s["batch"], s["seq"], s["hidden"])
        return model, jax.random.normal(k_x, shape, jnp.bfloat16), jax.random.normal(k_y, shape, jnp.bfloat16)

    model, x, y = make(jax.random.key(seed, impl="rbg"))  # cheaper to compile than threefry
    x, y = hax.named(x, (Batch, Pos, Embed)), hax.named(y, (Batch, Pos, Embed))
    opt = optax.adam(1e-4)
    opt_init = eqx.filter_jit(opt.init)
    traces: list[float] = []

    if variant == "bf16":

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())  # runs once per trace
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return eqx.apply_updates(model, updates), opt_state

        opt_state = opt_init(eqx.filter(model, eqx.is_array))
    elif variant == "haliax_fp8":
        # Cast before quantizing, so that Haliax's FP8 state stays float32. Haliax's
        # partition puts None where the FP8 state is, so its optimizer state is built from
        # the model without the state.
        model = haxq.quantize_linear_layers(model, haxq.QuantizationConfig(fp8=True))

        def trained(model):
            return eqx.filter(haxq.partition_for_grad_overwrite(model)[1], eqx.is_array)

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            overwrite, grads = haxq.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=trained(model))
            return haxq.apply_updates(model, updates, overwrite), opt_state

        opt_state = opt_init(trained(model))
    else:
        config = {
            "fp8ax": lambda: fp8ax.Fp8Config(),
            "fp8ax_skip": lambda: fp8ax.Fp8Config(),
            "fp8ax_current": lambda: fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling()),
            "fp8ax_mx": lambda: fp8ax.Fp8Config(recipe=fp8ax.MXScaling()),
            "fp8ax_nofirst": lambda: fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=False)),
        }[variant]()
        model = fp8ax.fp8_linear_layers(model, config)
        if variant == "fp8ax_skip":  # no optimizer moments for the FP8 state
            opt = fp8ax.skip_fp8_state(opt)
            opt_init = eqx.filter_jit(opt.init)

        @eqx.filter_jit
        def step(model, opt_state, x, y):
            traces.append(time.perf_counter())
            grads = eqx.filter_grad(decoder_loss)(model, x, y)
            overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
            updates, opt_state = opt.update(grads, opt_state, params=model)
            return fp8ax.apply_updates(model, updates, overwrite), opt_state

        opt_state = opt_init(eqx.filter(model, eqx.is_array))
    kinds = (fp8ax.Fp8DotGeneral, haxq.Fp8DotGeneralOp)
    fp8_layers = sum(
        isinstance(n, kinds) for n in jax.tree_util.tree_leaves(model, is_leaf=lambda n: isinstance(n, kinds))
    )
    return model, opt_state, x, y, step, traces, fp8_layers


def run_decoder(args, rec: Recorder, events: Events, variant: str, backend: str) -> None:
    s = DECODER_DRY if args.dry else DECODER_FULL
    flops = decoder_flops(s)
    rec(config={**s, "variant": variant, "recipe": FP8AX_RECIPES.get(variant), "steps": args.steps, **flops})
    t0 = time.perf_counter()
    model, opt_state, x, y, step, traces, fp8_layers = build_decoder(variant, s, args.seed)
    _block((model, opt_state, x, y))
    rec(build_s=time.perf_counter() - t0, fp8_layers=fp8_layers)

    # (a) The first call: trace, lower, compile (XLA:GPU autotunes here) and run.
    m0 = events.mark()
    t_first = time.perf_counter()
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    first_call_s = time.perf_counter() - t_first
    w = events.since(m0)
    rec(
        first_call_s=first_call_s,
        first_call_breakdown_s={  # from jax.monitoring durations inside the first call
            "trace": Events.seconds(w, EV_TRACE),
            "lower_to_mlir": Events.seconds(w, "jaxpr_to_mlir_module"),
            "backend_compile": Events.seconds(w, EV_BACKEND_COMPILE),
        },
    )

    # (c) Steps 2 and 3; first_settled_s ends with step 2.
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    first_settled_s = time.perf_counter() - t_first
    model, opt_state = step(model, opt_state, x, y)
    _block((model, opt_state))
    w = events.since(m0)
    rec(
        first_settled_s=first_settled_s,
        traces_first_3_steps=len(traces),
        backend_compiles_first_3_steps=Events.count(w, EV_BACKEND_COMPILE),
        cache_first_3_steps=cache_counts(w) if args.cache_dir else None,
        events_first_3_steps=w["counts"],
    )

    # (d) Timed steps (steps 1-3 were the warm-up).
    times: list[float] = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model, opt_state = step(model, opt_state, x, y)
        _block((model, opt_state))
        times.append(time.perf_counter() - t0)
        rec(step_times_partial_s=times)
    st = _stats(times)
    # (e) The linear layers' FLOPs over the whole step's time.
    rec(step=st, linear_tflops=flops["linear_flops"] / st["median_s"] / 1e12, traces_after_timed=len(traces))

    # (b) Optional: trace+lower and XLA compile timed apart, on a cleared in-process cache.
    compiled = None
    if args.split_compile:
        if _time_left(args) > first_call_s * 1.2 + MARGIN_S:
            try:
                compiled, split = split_compile(step, (model, opt_state, x, y), cache=bool(args.cache_dir))
                rec(split_compile=split)
            except Exception as e:
                rec(split_compile={"error": error_info(e)})
        else:
            rec(split_compile={"skipped": "time"})

    # (f) The FP8 GEMM check of the step as it runs now. `step.lower(...).compile()` after
    # the calls was served from JAX's in-process cache on jax 0.10 (no backend compile:
    # `backend_compiles` says); the guard assumes it may have to compile again.
    if args.no_fp8_check:
        rec(fp8_check={"skipped": "--no-fp8-check"})
    elif compiled is not None or _time_left(args) > first_call_s * 1.2 + MARGIN_S:
        try:
            t0 = time.perf_counter()
            m1 = events.mark()
            if compiled is None:
                compiled = step.lower(model, opt_state, x, y).compile()
            text = _compiled_text(compiled)
            expected = DECODER_GEMMS if variant != "bf16" else 0
            check = fp8_check(text, expected, variant, backend, flops["linear_flops"])
            check["compile_s"] = time.perf_counter() - t0
            check["backend_compiles"] = Events.count(events.since(m1), EV_BACKEND_COMPILE)
            rec(fp8_check=check)
        except Exception as e:
            rec(fp8_check={"error": error_info(e)})
    else:
        rec(fp8_check={"skipped": "time"})

    # (g) The loss after the steps (a forward-only program: one more, smaller compile).
    if _time_left(args) > MARGIN_S:
        try:
            rec(loss=float(eqx.filter_jit(decoder_loss)(model, x, y)))
        except Exception as e:
            rec(loss_error=error_info(e))


def split_compile(step, call_args, cache: bool):
    """Times `step.lower(...)` and `.compile()` apart after `jax.clear_caches()` (and with the
    persistent cache switched off), so that neither is served from a cache of JAX's. XLA's
    own in-process autotuning results are not cleared: GEMM fusions the first call tuned may
    not be tuned again, so `xla_compile_s` can be shorter than the first call's compile."""
    jax.clear_caches()
    if cache:
        from jax.experimental.compilation_cache import compilation_cache as cc

        jax.config.update("jax_enable_compilation_cache", False)
        cc.reset_cache()
    t0 = time.perf_counter()
    lowered = step.lower(*call_args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    split = {
        "trace_lower_s": t1 - t0,
        "xla_compile_s": t2 - t1,
        "method": "jax.clear_caches() then eqx.filter_jit(step).lower(...) and .compile() after the timed steps"
        + ("; persistent cache disabled for it" if cache else "")
        + "; XLA's in-process autotuning results may be reused",
    }
    return compiled, split
