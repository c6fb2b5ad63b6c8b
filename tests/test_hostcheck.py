"""The host check (`fp8ax._hostcheck`): a `jax.debug.callback` that a program compiled for
a platform this process cannot run leaves out, instead of failing to compile.

The checks fp8ax makes with it (the error for a state that went through an optimiser, the
warning for a state never written) are tested in test_update.py; here, the primitive under
the transformations a step puts around it, and the ahead-of-time case.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8ax
from fp8ax._hostcheck import host_check

DIMS = (((1,), (0,)), ((), ()))


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, x, tree):
        self.calls.append((np.asarray(x).tolist(), np.asarray(tree["twice"]).tolist()))


def _f(rec):
    def f(x):
        host_check(rec, x, {"twice": 2 * x})
        return jnp.sin(x)

    return f


def test_calls_back_with_the_values_eagerly_and_under_jit():
    rec = Recorder()
    f = _f(rec)
    f(jnp.float32(1))
    jax.jit(f)(jnp.float32(2))
    assert rec.calls == [(1.0, 2.0), (2.0, 4.0)]


def test_once_per_run_under_grad_and_checkpoint():
    # In the forward pass only: the backward pass and remat's recomputation do not call back.
    rec = Recorder()
    g = jax.jit(jax.grad(jax.checkpoint(_f(rec))))
    np.testing.assert_allclose(g(jnp.float32(0.5)), np.cos(0.5), rtol=1e-6)
    assert rec.calls == [(0.5, 1.0)]


def test_vmap_calls_back_once_with_the_batch():
    rec = Recorder()
    jax.jit(jax.vmap(_f(rec)))(jnp.arange(3, dtype=jnp.float32))
    assert rec.calls == [([0.0, 1.0, 2.0], [0.0, 2.0, 4.0])]


def test_scan_and_cond_call_back_where_they_run():
    rec = Recorder()
    f = _f(rec)

    def step(c, x):
        return c, lax.cond(x > 0, f, jnp.cos, x)

    jax.jit(lambda xs: lax.scan(step, None, xs))(jnp.array([1.0, -1.0, 3.0], jnp.float32))
    assert rec.calls == [(1.0, 2.0), (3.0, 6.0)]


def test_left_out_with_a_warning_when_lowered_for_another_platform():
    # What a deviceless compile for a GPU meets: no runtime here for the platform of the
    # program. `lowering_platforms` gives the same situation on any machine.
    rec = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered = jax.jit(_f(rec)).trace(jnp.float32(1)).lower(lowering_platforms=("cuda",))
    assert "callback" not in lowered.as_text()
    assert any("fp8ax: this program is compiled for cuda" in str(w.message) for w in caught)
    assert "callback" in jax.jit(_f(rec)).trace(jnp.float32(1)).lower().as_text()  # kept for this machine


def test_a_default_fp8_step_lowers_for_a_gpu_without_one():
    # Regression: the first-call branch's `jax.debug.callback` made the default step
    # impossible to compile ahead of time ("Unknown backend: 'gpu'").
    dg = fp8ax.Fp8DotGeneral.init()
    w, x = jnp.ones((16, 16)), jnp.ones((4, 16))
    step = jax.jit(jax.grad(lambda d: jnp.sum(d(x, w, DIMS))))
    with pytest.warns(UserWarning, match="host checks"):
        lowered = step.trace(dg).lower(lowering_platforms=("cuda",))
    assert "callback" not in lowered.as_text()
    assert "callback" in step.trace(dg).lower().as_text()
