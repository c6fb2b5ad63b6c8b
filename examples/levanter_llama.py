"""A tiny Llama trained in Levanter's own Trainer with fp8ax, beside runs without FP8 and with Haliax's FP8.

Needs Levanter (`pip install "marin-levanter==0.2.20.dev202606180959"`, which brings its Haliax)
beside fp8ax; without it the script says so and exits. It sets up the run as a Levanter user
does: `levanter.trainer.TrainerConfig` and `Trainer`, `levanter.models.llama.LlamaConfig`,
Levanter's Adam, data loader, checkpointer, evaluator and inference engine. The one change
for FP8 is in the model init function handed to `trainer.initial_state(...)`: it converts the
freshly built model with `fp8ax.fp8_linear_layers`. The trainer itself is left as it is.

Three variants: plain (no FP8), fp8ax, and haliax: Haliax's own FP8, switched on as a Levanter
user does it, with `TrainerConfig.quantization = haliax.quantization.QuantizationConfig(fp8=True)`
(the same 7 projections per block as fp8ax), no fp8ax. Haliax's FP8 state is unnamed arrays:
Levanter's gradient accumulation reshapes them as batch data and its generation indexes them by
axis name, and both fail. So haliax runs only without accumulation (`--microbatch 8`), and its
decode stage only with `--keep-going`; `--only haliax` or `--keep-going` runs it anyway and
shows the failure. Each model goes through four stages, and each stage prints one line:

- train:      `--steps` steps of `Trainer.training_steps` on synthetic token sequences, with
              `mp = p=f32,c=bfloat16`, gradient accumulation (micro-batches of 4 in a batch
              of 8) and the LlamaConfig's `gradient_checkpointing`; the final state is
              checkpointed as `Trainer.train` does it, by the trainer's own checkpointer;
- eval:       Levanter's LM evaluator (`levanter.eval.cb_tagged_lm_evaluate`, the callback
              `levanter.main.train_lm` installs) on held-out sequences;
- decode:     Levanter's `InferenceEngine` (paged KV cache, `LlamaLMHeadModel.decode`)
              generates a few tokens greedily after two prompts;
- checkpoint: a second Trainer, configured for one more step, resumes from that checkpoint
              (`trainer.initial_state` with `load_checkpoint_path`) and takes the step; its
              loaded state must equal the first run's final state, and its next state the one
              the first trainer computes from its in-memory state, bit for bit.

By default an error stops the script, as a test wants. `--keep-going` instead reports a
failing stage on one line (the exception's type and first line, the innermost fp8ax frame,
and the Levanter frame that led there) and goes on; eval and decode then use the untrained
initial state, and the exit status is still 1.

    python examples/levanter_llama.py                 # 8 steps
    python examples/levanter_llama.py --quick         # 3 steps, for CI
    python examples/levanter_llama.py --keep-going    # every stage, whatever fails
    python examples/levanter_llama.py --mp f32 --microbatch 8   # where Haliax's FP8 trains too
"""

import argparse
import gc
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from importlib.metadata import version
from pathlib import Path

warnings.filterwarnings("ignore", message=".*shard_map is deprecated.*")
warnings.filterwarnings("ignore", message=".*[Dd]onat.*")  # the CPU cannot reuse donated buffers
warnings.filterwarnings("ignore", message="Global tracker is already set.*")  # one Trainer per run
warnings.filterwarnings("ignore", message=".*scatter inputs have incompatible types.*")  # Levanter's KV cache

try:
    import levanter
except ImportError as exc:  # an optional dependency of this example, not of fp8ax
    print(f"skipped: this example needs Levanter ({exc}); pip install 'marin-levanter==0.2.20.dev202606180959'")
    sys.exit(0)

import equinox as eqx  # noqa: E402
import haliax as hax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jmp  # noqa: E402
import levanter.eval  # noqa: E402
import numpy as np  # noqa: E402
from haliax.quantization import QuantizationConfig  # noqa: E402
from levanter.callbacks import StepInfo  # noqa: E402
from levanter.callbacks.watch import WatchConfig  # noqa: E402
from levanter.checkpoint import CheckpointerConfig, save_checkpoint  # noqa: E402
from levanter.data import ListAsyncDataset  # noqa: E402
from levanter.distributed import DistributedConfig  # noqa: E402
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request  # noqa: E402
from levanter.inference.jit_scheduler import SeqDecodingParams  # noqa: E402
from levanter.models.llama import LlamaConfig  # noqa: E402
from levanter.models.lm_model import LmExample  # noqa: E402
from levanter.optim import AdamConfig  # noqa: E402
from levanter.tracker import NoopConfig  # noqa: E402
from levanter.tracker.tracker import DictTracker  # noqa: E402
from levanter.trainer import Trainer, TrainerConfig  # noqa: E402

import fp8ax  # noqa: E402

VOCAB = 128
SEQ_LEN = 32
BATCH = 8  # examples per optimizer step
EVAL_EXAMPLES = 16
PROMPT_LEN = 8
NEW_TOKENS = 6

# Levanter's loss (LmHeadModel.compute_next_token_loss) multiplies the activations by the
# lm_head *weight* in its own (fused) cross entropy and never calls the lm_head layer, so an
# FP8 lm_head would not compute in FP8 in training; `targets` leaves it out.
FP8_CONFIG = fp8ax.Fp8Config(targets=lambda path, layer: path != "lm_head")
# Haliax's FP8 for the "haliax" variant, through TrainerConfig.quantization (TrainerState.init
# applies it after model_init); a list of targets matches the last name of a Linear's path
HALIAX_FP8 = QuantizationConfig(fp8=True, targets=[f"{n}_proj" for n in ("q", "k", "v", "o", "gate", "up", "down")])
VARIANTS = ("plain", "fp8ax", "haliax")

ARGS: argparse.Namespace
FAILURES: list[str] = []
STAGE_START = [time.perf_counter()]


# ----------------------------------------------------------------------------------------------
# reporting


def say(stage: str, variant: str, text: str):
    took = time.perf_counter() - STAGE_START[0]
    print(f"[{stage:<10}] {variant:<6} {text}  [{took:.1f} s]", flush=True)


def _short(filename: str) -> str:
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}src{os.sep}", f"{os.sep}examples{os.sep}"):
        if marker in filename:
            return filename.split(marker)[-1]
    return filename


def run_stage(stage: str, variant: str, fn):
    """Runs `fn()`. Without --keep-going an error propagates. With it, the error is reported on
    one line, followed by the innermost fp8ax frame and the innermost Levanter frame, and the
    stage returns None."""
    STAGE_START[0] = time.perf_counter()
    if not ARGS.keep_going:
        return fn()
    try:
        return fn()
    except Exception as exc:  # only with --keep-going
        FAILURES.append(f"{stage}/{variant}")
        first = (str(exc).strip().splitlines() or [""])[0]
        say(stage, variant, f"FAILED {type(exc).__name__}: {first[:300]}")
        frames = traceback.extract_tb(exc.__traceback__)
        for package in ("fp8ax", "levanter"):
            inside = [f for f in frames if f"{os.sep}{package}{os.sep}" in f.filename]
            if inside:
                f = inside[-1]
                print(f"{'':19}{package} frame: {_short(f.filename)}:{f.lineno} in {f.name}", flush=True)
        if frames:
            f = frames[-1]
            print(f"{'':19}raised at: {_short(f.filename)}:{f.lineno} in {f.name}", flush=True)
        return None


def quiet_logs():
    """levanter.initialize logs at INFO to stderr; keep its file log (under the run's log_dir) only."""
    if ARGS.verbose:
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.ERROR)


# ----------------------------------------------------------------------------------------------
# data


def synthetic_sequences(n: int, seed: int) -> np.ndarray:
    """Arithmetic progressions modulo VOCAB, each with its own start and stride (1 to 4): the next
    token follows from the two before it, so a small model learns it in a few dozen steps."""
    # one draw per sequence, so the first sequences are the same whatever n is
    draw = np.random.default_rng(seed).integers(0, 4 * VOCAB, size=(n, 1))
    start, stride = draw % VOCAB, 1 + draw // VOCAB
    return ((start + stride * np.arange(SEQ_LEN)[None, :]) % VOCAB).astype(np.int32)


def lm_dataset(tokens: np.ndarray, Pos: hax.Axis) -> ListAsyncDataset:
    return ListAsyncDataset([LmExample.causal(hax.named(jnp.asarray(t), Pos)) for t in tokens])


# ----------------------------------------------------------------------------------------------
# configuration


def model_config() -> LlamaConfig:
    remat = {"true": True, "false": False}.get(ARGS.gradient_checkpointing.lower(), ARGS.gradient_checkpointing)
    return LlamaConfig(
        max_seq_len=SEQ_LEN,
        hidden_dim=64,
        intermediate_dim=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        gradient_checkpointing=remat,
    )


def trainer_config(variant: str, workdir: str, steps: int, load_from: str | None = None) -> TrainerConfig:
    return TrainerConfig(
        id=f"{variant}-resumed" if load_from else variant,
        seed=0,
        mp=jmp.get_policy(ARGS.mp),
        quantization=HALIAX_FP8 if variant == "haliax" else None,
        tracker=NoopConfig(),
        # Levanter's default WatchConfig adds a norm-logging hook to the step every 10 steps (and
        # so a second train-step program to compile); off unless --watch
        watch=WatchConfig() if ARGS.watch else WatchConfig(watch_targets=[]),
        log_dir=Path(workdir) / "logs",
        log_jaxprs=False,
        log_xla_hlo=False,
        train_batch_size=BATCH,
        per_device_parallelism=ARGS.microbatch,  # below BATCH: Levanter accumulates gradients
        per_device_eval_parallelism=BATCH,
        num_train_steps=steps,
        steps_per_eval=10**9,
        # only forced checkpoints (the one at the end of the run)
        checkpointer=CheckpointerConfig(base_path=os.path.join(workdir, "checkpoints"), save_interval=None, keep=None),
        load_checkpoint=True if load_from else False,
        load_checkpoint_path=load_from,
        require_accelerator=False,
        # the resumed Trainer compiles the same train step again; a compilation cache (in the
        # script's temporary directory, so every run of the script starts cold) reuses the first
        jax_compilation_cache_dir=os.path.join(os.path.dirname(workdir), "jax_cache"),
        distributed=DistributedConfig(initialize_jax_distributed=False),
    )


def loss_function(model, example: LmExample, *, key=None):  # as levanter.main.train_lm has it
    return model.compute_next_token_loss(example, key=key)


# ----------------------------------------------------------------------------------------------
# helpers


def host_copy(tree):
    return jax.tree_util.tree_map(np.asarray, eqx.filter(tree, eqx.is_array))


def first_difference(a, b) -> str | None:
    """None if the arrays of `a` and `b` are equal bit for bit, else the path of the first that differs."""
    la, ta = jax.tree_util.tree_flatten_with_path(host_copy(a))
    lb, tb = jax.tree_util.tree_flatten_with_path(host_copy(b))
    if ta != tb:
        return "(the tree structures differ)"
    for (path, x), (_, y) in zip(la, lb):
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return jax.tree_util.keystr(path)
    return None


def wait_for_checkpoint(directory: str, timeout: float = 120.0) -> str:
    """Levanter's checkpointer writes asynchronously; metadata.json appears when a save is committed."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = [d for d in os.listdir(directory) if os.path.exists(os.path.join(directory, d, "metadata.json"))]
        if done:
            return os.path.join(directory, max(done, key=lambda d: int(d.split("-")[-1])))
        time.sleep(0.1)
    raise TimeoutError(f"no committed checkpoint under {directory} after {timeout:.0f} s")


def check_fp8_state(model, before_last, mp: jmp.Policy) -> str:
    """Two checks of the FP8 state that Levanter's step wrote back (its gradient accumulation and
    `TrainerState.take_step` handle it, not fp8ax's own step). `fp8ax.check_state(written=True)`:
    every converted layer ran and its state holds values fp8ax writes. And the newest weight amax
    of each layer (`fp8ax.scaling_stats`) must be max|W| of the weight the last step multiplied,
    `W` cast to the compute dtype as Levanter's mixed precision does; an accumulation that averaged
    the state over the micro-batches, or an update that zeroed it, shows here."""
    fp8ax.check_state(model, written=True)
    stats = fp8ax.scaling_stats(model)
    wrong = []
    keys = [k for k in stats if k.endswith("/rhs/amax")]
    for key in keys:
        path, index = key[: -len("/rhs/amax")], None
        if path.endswith("]"):
            path, index = path[:-1].split("[")
        layer = before_last
        for name in path.split("."):
            layer = getattr(layer, name)
        weight = np.asarray(layer.weight.array if hasattr(layer.weight, "array") else layer.weight)
        if index is not None:
            weight = weight[int(index)]
        expected = float(jnp.max(jnp.abs(mp.cast_to_compute(jnp.asarray(weight)))))
        if not np.isclose(stats[key], expected, rtol=1e-6, atol=0.0):
            wrong.append(f"{key} {stats[key]:.6g} (max|W| {expected:.6g}, ratio {stats[key] / expected:.3g})")
    if wrong:
        raise AssertionError(f"{len(wrong)} of {len(keys)} weight amaxes are not max|W|: " + "; ".join(wrong[:3]))
    return f"check_state(written=True) ok, weight amax = max|W| in {len(keys)}/{len(keys)} GEMMs"


class IdTokenizer:
    """The inference engine only calls `decode`, to log finished sequences."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(int(i)) for i in ids)


# ----------------------------------------------------------------------------------------------
# one model through the four stages


def run_variant(variant: str, workdir: str, train_tokens, eval_tokens) -> dict:
    steps = ARGS.steps
    cfg = model_config()
    Vocab = hax.Axis("vocab", VOCAB)
    model_key, training_key = jax.random.split(jax.random.PRNGKey(0))

    def model_init():  # the one FP8 change: convert the model as the trainer builds it
        model = cfg.build(Vocab, key=model_key)
        if variant == "fp8ax":
            model = fp8ax.fp8_linear_layers(model, FP8_CONFIG)
        return model

    train_ds = lm_dataset(train_tokens, cfg.max_Pos)  # steps + 1 batches: the resumed run takes one more
    eval_ds = lm_dataset(eval_tokens, cfg.max_Pos)
    optimizer = AdamConfig(learning_rate=3e-3, weight_decay=0.0, warmup=0.0, lr_schedule="constant").build(steps)
    out: dict = {}
    run_dir = os.path.join(workdir, variant)
    config = trainer_config(variant, run_dir, steps)
    levanter.initialize(config)
    quiet_logs()

    with Trainer(config, optimizer, loss_function) as trainer:
        if variant == "fp8ax":
            shapes = eqx.filter_eval_shape(cfg.build, Vocab, key=model_key)
            report = str(fp8ax.conversion_report(shapes, FP8_CONFIG)).splitlines()
            print(f"[{'convert':<10}] {variant:<6} {report[0].split(': ', 1)[-1]}; lm_head left out", flush=True)
        if variant == "haliax":
            targets = ", ".join(HALIAX_FP8.targets)
            print(f"[{'convert':<10}] {variant:<6} TrainerConfig.quantization: fp8=True, targets {targets}", flush=True)
        initial = {}

        def train():
            state = trainer.initial_state(training_key, model_init=model_init)
            initial["state"] = state
            losses, times, info = [], [], None
            before_last = host_copy(state.model)  # the weights the last step's GEMMs saw
            for info in trainer.training_steps(state, trainer.data_loader(train_ds)):
                losses.append(info.loss)
                times.append(info.step_duration)
                if variant == "fp8ax" and int(info.state.step) < steps:
                    before_last = host_copy(info.state.model)
            trainer.run_hooks(info, force=True)  # as Trainer.train ends: the final checkpoint, among others
            # the save is asynchronous: wait for it (the checkpoint stage loads it; the temporary directory goes)
            out["saved"] = wait_for_checkpoint(os.path.join(run_dir, "checkpoints", variant))
            out.update(losses=losses, times=times, final=host_copy(info.state))
            steady = f"{np.median(times[1:]) * 1e3:.0f} ms" if len(times) > 1 else "n/a"
            fp8_note = ""
            if variant == "fp8ax":
                fp8_note = "; FP8 state: " + check_fp8_state(info.state.model, before_last, trainer.mp)
            say(
                "train",
                variant,
                "losses "
                + " ".join(f"{x:.3f}" for x in losses)
                + f"  (first step {times[0]:.1f} s, then {steady}){fp8_note}",
            )
            return info.state

        state = run_stage("train", variant, train)
        trained = state is not None
        if not trained and "state" not in initial:
            initial["state"] = run_stage(
                "init", variant, lambda: trainer.initial_state(training_key, model_init=model_init)
            )
        if not trained:
            state = initial["state"]
        note = "" if trained else " (initial state: training failed)"
        if state is None:
            return out

        def evaluate():
            evaluator = levanter.eval.cb_tagged_lm_evaluate(
                trainer.EvalBatch,
                [(eval_ds, ["synthetic"])],
                None,  # no tokenizer, so no bits-per-byte
                trainer.device_mesh,
                trainer.compute_axis_mapping,
                mp=trainer.mp,
            )
            tracker = DictTracker()  # the callback logs its result; this tracker keeps it
            with levanter.tracker.current_tracker(tracker):
                evaluator(StepInfo(state, 0.0, 0.0))
            logged = next(v for k, v in tracker.metrics.items() if k.startswith("step_"))
            out["eval"] = float(logged["eval/loss"])
            out["eval_trained"] = trained
            say("eval", variant, f"eval/loss {out['eval']:.4f} on {EVAL_EXAMPLES} held-out sequences{note}")

        def checkpoint():
            if trained:
                # the reference: one more step from the in-memory state, by the first trainer
                batch = next(iter(trainer.data_loader(train_ds).iter_from_step(steps)))
                reference = host_copy(trainer.train_step(state, batch).state)
                saved = out["saved"]
            else:
                # nothing trained: save the initial state as the trainer's checkpointer would
                path = os.path.join(run_dir, "checkpoints", variant, "step-0")
                saved = save_checkpoint(state.saveable_state, step=0, checkpoint_path=path)
            expected = out["final"] if trained else host_copy(state)
            resume_config = trainer_config(variant, os.path.join(workdir, f"{variant}-resumed"), steps + 1, saved)
            levanter.initialize(resume_config)
            quiet_logs()
            with Trainer(resume_config, optimizer, loss_function) as resumed:
                loaded = resumed.initial_state(training_key, model_init=model_init)
                start = int(loaded.step)
                load_diff = first_difference(loaded, expected)
                if not trained:
                    say(
                        "checkpoint",
                        variant,
                        f"FAILED (no training to resume); round trip of the initial state through {os.path.basename(saved)}: "
                        + ("bit for bit" if load_diff is None else f"differs at {load_diff}"),
                    )
                    FAILURES.append(f"checkpoint/{variant}")
                    return
                loader = resumed.data_loader(train_ds).iter_from_step(start)
                info = next(iter(resumed.training_steps(loaded, loader)))
                step_diff = first_difference(info.state, reference)
            ok = load_diff is None and step_diff is None
            say(
                "checkpoint",
                variant,
                f"resumed from {os.path.basename(saved)} (state.step {start}): loaded state "
                + ("= saved" if load_diff is None else f"!= saved at {load_diff}")
                + "; next step "
                + ("= next step of the first run" if step_diff is None else f"!= first run's at {step_diff}")
                + (" -> bit for bit" if ok else " -> DIFFERENT"),
            )
            if not ok:
                raise AssertionError(f"{variant}: the resumed run does not reproduce the first one bit for bit")

        def decode():
            model = trainer.mp.cast_to_compute(state.eval_model)  # as levanter.main.sample_lm prepares it
            engine = InferenceEngine.from_model_with_config(
                model=model,
                tokenizer=IdTokenizer(),
                config=InferenceEngineConfig(
                    max_seq_len=SEQ_LEN,
                    page_size=8,
                    max_pages=16,
                    max_seqs=2,
                    max_seqs_in_prefill=2,
                    max_queued_tokens=8,
                    max_rounds=4,
                    max_stop_seqs=0,
                ),
                axis_resources=trainer.compute_axis_mapping,
            )
            prompts = [[int(t) for t in eval_tokens[i, :PROMPT_LEN]] for i in range(2)]
            requests = [
                Request(
                    prompt_tokens=prompt,
                    request_id=i,
                    decode_params=SeqDecodingParams(
                        max_num_tokens=jnp.array(PROMPT_LEN + NEW_TOKENS, dtype=jnp.int32),
                        stop_tokens=None,
                        temperature=jnp.array(0.0, dtype=jnp.float32),  # greedy
                        top_p=jnp.array(1.0, dtype=jnp.float32),
                        key=jax.random.PRNGKey(i),
                    ),
                    n_generations=1,
                )
                for i, prompt in enumerate(prompts)
            ]
            result = engine.generate(requests)
            generated = [[int(t) for t in seq[-NEW_TOKENS:]] for seq in result.tokens]
            want = [[int(t) for t in eval_tokens[i, PROMPT_LEN : PROMPT_LEN + NEW_TOKENS]] for i in range(2)]
            right = sum(g == w for gs, ws in zip(generated, want) for g, w in zip(gs, ws))
            out["decode"] = generated
            say(
                "decode",
                variant,
                " | ".join(f"..{p[-3:]} -> {g}" for p, g in zip(prompts, generated))
                + f"  ({right}/{2 * NEW_TOKENS} continue the progression){note}",
            )

        for name, stage in (("eval", evaluate), ("decode", decode), ("checkpoint", checkpoint)):
            if (variant, name) == ("haliax", "decode") and name in ARGS.stages and not ARGS.keep_going:
                print(f"[{name:<10}] haliax skipped: Llama's decode indexes the unnamed FP8 state by 'layer'")
            elif name in ARGS.stages:  # checkpoint last: its reference step donates `state`
                run_stage(name, variant, stage)
    return out


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per model (default 8)")
    parser.add_argument("--quick", action="store_true", help="3 steps, for a CI test")
    parser.add_argument(
        "--keep-going", action="store_true", help="report a failing stage on one line and go on (exit status 1)"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        default="true",
        help="LlamaConfig.gradient_checkpointing: true (Levanter's default), false, recompute (= full), "
        "save_all, nested, offload",
    )
    parser.add_argument("--mp", default="p=f32,c=bfloat16", help="TrainerConfig.mp (default p=f32,c=bfloat16)")
    parser.add_argument(
        "--microbatch",
        type=int,
        default=4,
        help=f"TrainerConfig.per_device_parallelism (default 4: two micro-batches; {BATCH}: none, which haliax needs)",
    )
    parser.add_argument("--only", choices=VARIANTS, help="run one of the three models")
    parser.add_argument(
        "--stages", default="eval,decode,checkpoint", help="comma-separated stages after train (default %(default)s)"
    )
    parser.add_argument("--watch", action="store_true", help="Levanter's default WatchConfig (norm logging hooks)")
    parser.add_argument("--verbose", action="store_true", help="keep Levanter's INFO logs on stderr")
    ARGS = parser.parse_args()
    if ARGS.quick:
        ARGS.steps = min(ARGS.steps, 3)
    ARGS.stages = {name.strip() for name in ARGS.stages.split(",")}
    unknown = ARGS.stages - {"train", "eval", "decode", "checkpoint"}
    if unknown:
        parser.error(f"unknown stages: {', '.join(sorted(unknown))}")
    if ARGS.steps < 1:
        parser.error("--steps must be at least 1")
    if jax.device_count() != 1:
        print(f"note: {jax.device_count()} devices; Levanter's default mesh puts them all on its data axis")

    train_tokens = synthetic_sequences((ARGS.steps + 1) * BATCH, seed=1)
    eval_tokens = synthetic_sequences(EVAL_EXAMPLES, seed=2)
    print(
        f"marin-levanter {version('marin-levanter')}, jax {jax.__version__} on {jax.devices()[0].platform} | "
        f"Llama: 2 layers, hidden 64, vocab {VOCAB}, seq {SEQ_LEN} | batch {BATCH}, micro-batch {ARGS.microbatch} | "
        f"mp {ARGS.mp} | gradient_checkpointing={model_config().gradient_checkpointing!r} | {ARGS.steps} steps",
        flush=True,
    )
    variants = [v for v in VARIANTS if ARGS.only in (None, v)]
    if "haliax" in variants and ARGS.microbatch < BATCH and not (ARGS.keep_going or ARGS.only):
        variants.remove("haliax")
        print(f"note: haliax skipped: Haliax's FP8 fails in gradient accumulation; it trains with --microbatch {BATCH}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="levanter_llama_") as workdir:
        for variant in variants:
            results[variant] = run_variant(variant, workdir, train_tokens, eval_tokens)
            gc.collect()  # the trainers' progress bars close now, not at interpreter exit

    plain = results.get("plain", {})
    for name, other in results.items():
        if name == "plain" or not (plain.get("losses") and other.get("losses")):
            continue
        pairs = list(zip(plain["losses"], other["losses"]))
        print(
            f"[{'compare':<10}] train loss by step, plain / {name}: "
            + "  ".join(f"{a:.3f}/{b:.3f}" for a, b in pairs)
            + f"; max difference {max(abs(a - b) for a, b in pairs):.4f}",
            flush=True,
        )
        if plain.get("eval_trained") and other.get("eval_trained"):
            print(f"[{'compare':<10}] eval/loss plain {plain['eval']:.4f}, {name} {other['eval']:.4f}", flush=True)
    if FAILURES:
        print(f"FAILED stages: {', '.join(FAILURES)}", flush=True)
        sys.exit(1)
    print("all stages passed", flush=True)


if __name__ == "__main__":
    main()
