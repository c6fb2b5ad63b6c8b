"""bench/gpu_train.py's parts: what runs (names, sizes, time limits) and the --parts list."""

from __future__ import annotations

# --------------------------------------------------------------------------------------
# What runs

DECODER_VARIANTS = ("bf16", "haliax_fp8", "fp8ax", "fp8ax_skip", "fp8ax_current", "fp8ax_mx", "fp8ax_nofirst")
FP8AX_RECIPES = {  # variant -> how its Fp8Config is built (for the JSON)
    "fp8ax": "fp8ax.Fp8Config()",
    "fp8ax_skip": "fp8ax.Fp8Config(), optimizer fp8ax.skip_fp8_state(optax.adam(1e-4))",
    "fp8ax_current": "fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling())",
    "fp8ax_mx": "fp8ax.Fp8Config(recipe=fp8ax.MXScaling())",
    "fp8ax_nofirst": "fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=False))",
}
DECODER_FULL = dict(batch=4, seq=2048, hidden=4096, heads=32, head_size=128, mlp=14336)
DECODER_DRY = dict(batch=2, seq=64, hidden=128, heads=4, head_size=32, mlp=448)
DECODER_GEMMS = 21  # 7 projections x (forward, input gradient, weight gradient); see `decoder_flops`

GEMM_SHAPES = {"square_8192": (8192, 8192, 8192), "llama_up": (8192, 4096, 14336)}  # (m, k, n)
GEMM_NOTES = {"square_8192": "M = K = N = 8192", "llama_up": "8192 tokens, 4096 -> 14336 (Llama-3 8B up/gate)"}
GEMM_PASSES = {"fwd": 1, "fwd_bwd": 3}
GEMM_VARIANTS = ("bf16", "fp8ax", "haliax_fp8")

MOE_FULL = dict(tokens=8192, k=4096, n=14336, group_sizes=(1536, 512, 1024, 256, 768, 2048, 1024, 1024))
DRY_DIVISOR = 64  # GEMM and MoE sizes in the dry pass

DEFAULT_PARTS = (
    *(f"decoder:{v}" for v in DECODER_VARIANTS[:3]),
    "decoder-warm:fp8ax",  # right after the part that fills its cache
    *(f"decoder:{v}" for v in DECODER_VARIANTS[3:]),
    "gemm:square_8192:fwd_bwd",  # the target: fp8ax >= 1.7x bf16 here
    "gemm:llama_up:fwd_bwd",
    "gemm:square_8192:fwd",
    "gemm:llama_up:fwd",
    "moe",
)
# Wall-clock limits (s) and the least time a part is started with (s).
LIMITS = {"decoder:bf16": 60, "decoder:haliax_fp8": 60, "decoder:fp8ax": 150, "decoder": 90, "gemm": 60, "moe": 60}
MIN_START = {"decoder": 40, "decoder-warm": 25, "gemm": 25, "moe": 25}
MARGIN_S = 5.0  # a part starts an optional compile only with this much to spare
EXIT_GRACE_S = 15.0  # a part that recorded "done" but has not exited by then is killed

# jax.monitoring event names (jax/_src/dispatch.py, compiler.py, compilation_cache.py in
# jax 0.10); matched by substring, so a renamed event is counted as zero, not an error.
EV_BACKEND_COMPILE = "backend_compile"
EV_TRACE = "jaxpr_trace"
EV_CACHE_MISS = "/jax/compilation_cache/cache_misses"
EV_CACHE_HIT = "/jax/compilation_cache/cache_hits"
EV_CACHE_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"


def part_kind(part: str) -> str:
    return part.split("@")[0].split(":")[0]


def part_base(part: str) -> str:
    return part.split("@")[0]


def uses_cache(part: str, parts: list[str]) -> bool:
    """The persistent cache goes to a warm part and to the part that fills it for it."""
    kind, _, rest = part.partition(":")
    return kind == "decoder-warm" or (kind == "decoder" and f"decoder-warm:{rest}" in parts)


def part_limit(part: str, overrides: dict[str, float]) -> float:
    for key in (part, part_base(part), part_kind(part)):
        if key in overrides:
            return overrides[key]
    base = part_base(part)
    return LIMITS.get(base, LIMITS.get(part_kind(part).replace("decoder-warm", "decoder"), 60))


def parse_parts(text: str | None, flag_variants: dict[str, str], cache: bool) -> list[str]:
    parts = list(DEFAULT_PARTS if cache else [p for p in DEFAULT_PARTS if not p.startswith("decoder-warm")])
    if text is None or text.strip() == "all":
        return parts
    groups = {
        "decoder": [p for p in parts if part_kind(p) == "decoder"],
        "gemm": [p for p in parts if part_kind(p) == "gemm"],
    }
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, variant = item.partition("@")
        if variant and variant not in flag_variants:
            raise SystemExit(
                f"--parts: {item!r} names the XLA flags variant {variant!r}, not given with --xla-flags-variant"
            )
        names = groups.get(name, [name])
        for base in names:
            kind, _, rest = base.partition(":")
            ok = (
                (kind in ("decoder", "decoder-warm") and rest in DECODER_VARIANTS)
                or (
                    kind == "gemm"
                    and rest.count(":") == 1
                    and rest.split(":")[0] in GEMM_SHAPES
                    and rest.split(":")[1] in GEMM_PASSES
                )
                or base == "moe"
            )
            if not ok:
                raise SystemExit(f"--parts: unknown part {base!r}; known: {', '.join(DEFAULT_PARTS)}, decoder, gemm")
            out.append(f"{base}@{variant}" if variant else base)
    return out
