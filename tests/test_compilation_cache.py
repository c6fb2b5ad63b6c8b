"""JAX's persistent compilation cache stores every program of the default training loop.

A job that restarts (or a second run of the same script) must not pay the step's compile
again: on a GPU that compile includes XLA's autotuning of every FP8 GEMM, minutes for a
real model (docs/gpu.md). JAX refuses to write a program that calls back to the host
("Not writing persistent cache entry ... because it uses host callbacks"), which is why
no fp8ax step program may contain one. Each case runs the same training script twice,
in two fresh processes sharing one cache directory, and counts XLA compiles
(`jax._src.compiler.backend_compile_and_load`, wrapped in the script) and persistent-cache
hits (JAX's monitoring events): the first process compiles, the second compiles nothing.

The scripts: README.md's TL;DR program as written (its first runnable block: the Haliax
MLP, the README's step, 20 steps and the named-axis `hax.dot`), and the same loop on an
Equinox model (so that the check also runs where Haliax's `hax.dot` is broken).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

PRELUDE = """
import json, sys
import jax
from jax._src import compiler, monitoring

jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
counts = {"xla_compiles": 0, "cache_hits": 0}
_compile = compiler.backend_compile_and_load


def _counting(*args, **kwargs):
    counts["xla_compiles"] += 1
    return _compile(*args, **kwargs)


compiler.backend_compile_and_load = _counting


def _event(name, **kwargs):
    if name == "/jax/compilation_cache/cache_hits":
        counts["cache_hits"] += 1


monitoring.register_event_listener(_event)
"""

EPILOGUE = """
jax.effects_barrier()
print("COUNTS " + json.dumps(counts))
"""

EQUINOX_LOOP = """
import equinox as eqx, jax.numpy as jnp, optax
import fp8ax


class MLP(eqx.Module):
    up_proj: eqx.nn.Linear
    down_proj: eqx.nn.Linear

    def __call__(self, x):
        return jax.vmap(lambda r: self.down_proj(jax.nn.relu(self.up_proj(r))))(x)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


k_up, k_down, k_x, k_y = jax.random.split(jax.random.key(0), 4)
model = fp8ax.fp8_linear_layers(MLP(eqx.nn.Linear(32, 128, key=k_up), eqx.nn.Linear(128, 8, key=k_down)))
x, y = jax.random.normal(k_x, (64, 32)), jax.random.normal(k_y, (64, 8))
opt = optax.adam(1e-3)
opt_state = opt.init(eqx.filter(model, eqx.is_array))


@eqx.filter_jit
def step(model, opt_state, x, y):
    grads = eqx.filter_grad(loss_fn)(model, x, y)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    return fp8ax.apply_updates(model, updates, overwrite), opt_state


for _ in range(20):
    model, opt_state = step(model, opt_state, x, y)
print("loss after 20 FP8 steps:", float(loss_fn(model, x, y)))
"""


def _readme_loop() -> str:
    from test_examples_and_docs import runnable_blocks

    return runnable_blocks((ROOT / "README.md").read_text())[0][1]


def _run_twice(body: str, tmp_path: pathlib.Path) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(PRELUDE + body + EPILOGUE)
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    out = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, str(script), str(cache)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "host callbacks" not in proc.stderr, proc.stderr[-4000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("COUNTS "))
        out.append(json.loads(line[len("COUNTS ") :]))
    return out


@pytest.mark.parametrize(
    "loop", [pytest.param("readme", marks=pytest.mark.needs_hax_dot), "equinox"], ids=["readme", "equinox"]
)
def test_the_second_run_compiles_nothing(loop, tmp_path):
    body = _readme_loop() if loop == "readme" else EQUINOX_LOOP
    first, second = _run_twice(body, tmp_path)
    # (The first run may already hit the cache: a program traced twice to the same HLO.)
    assert first["xla_compiles"] > 0, first
    assert second["xla_compiles"] == 0, (first, second)  # every program came from the cache
    assert second["cache_hits"] == first["xla_compiles"] + first["cache_hits"], (first, second)
