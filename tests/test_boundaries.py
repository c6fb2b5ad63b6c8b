"""The JAX rules that would sum a layer's FP8 state refuse with fp8ax's error (`_boundaries.py`),
and only when the state would really be summed.

The reuse matrix (test_reuse_matrix.py) runs every boundary on a fresh trace. These tests
add what its order of cases cannot pin down: the refusal does not depend on what JAX has
cached from earlier traces, and the same boundaries stay open for what is right there
(inference, per-example gradients, one predicate for the whole batch).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8ax
from _reuse import _model, _step, data_for, run_all
from fp8ax import _boundaries

DIMS = (((1,), (0,)), ((), ()))
pytestmark = pytest.mark.filterwarnings("ignore:fp8ax. the same FP8 layer has found its amax history empty")


def _weights_and_inputs():
    k = jax.random.split(jax.random.key(0), 2)
    return jax.random.normal(k[0], (16, 16)), jax.random.normal(k[1], (4, 16))


def _per_example_switch(dg, w, xi):
    # The layer closed over; the branch index comes from the example.
    branches = [lambda v: dg(v[None], w, DIMS)[0], lambda v: dg(100 * v[None], w, DIMS)[0]]
    return lax.switch((xi[0] > 0).astype(jnp.int32), branches, xi)


def test_checks_are_false_outside_the_rules():
    assert not _boundaries.in_per_example_cond()
    assert not _boundaries.in_unchecked_shard_map_transpose()
    _boundaries.check_eager_shard_map()  # no shard_map: nothing to refuse


@pytest.mark.parametrize(
    "entry",
    [
        "dot_general",
        pytest.param("hax_dot", marks=pytest.mark.needs_hax_dot),
        pytest.param("hax_linear", marks=pytest.mark.needs_hax_dot),
    ],
)
def test_per_example_cond_refuses_after_the_layer_was_traced_under_vmap(entry):
    # Regression: the check used to run in the custom VJP's forward pass, which JAX
    # does not trace again when `hax.dot`'s jitted contraction is cached from an earlier
    # `vmap`: the per-example copies of the state were then silently summed.
    run_all(entry, "jax.vmap", "twice")  # traces and caches the layer under vmap
    step = _step(entry, "jax.vmap/lax.cond", "twice")
    with pytest.raises(ValueError, match="predicate differs per example"):
        step(_model(entry, False), data_for(0))


@pytest.mark.parametrize("jit", [False, True])
def test_per_example_switch_refuses_when_differentiated(jit):
    w, x = _weights_and_inputs()
    grad = eqx.filter_grad(lambda d: jnp.sum(jax.vmap(lambda xi: _per_example_switch(d, w, xi))(x)))
    with pytest.raises(ValueError, match=r"^fp8ax: .*`lax.cond` or `lax.switch` under `jax.vmap`"):
        (eqx.filter_jit(grad) if jit else grad)(fp8ax.Fp8DotGeneral.init())


def test_per_example_switch_is_fine_for_inference():
    # No gradient, no state update: nothing to sum. Each example's output is the one the
    # branch it takes gives alone (fresh state: current scaling of that example's input).
    w, x = _weights_and_inputs()
    dg = fp8ax.Fp8DotGeneral.init()
    got = eqx.filter_jit(lambda d: jax.vmap(lambda xi: _per_example_switch(d, w, xi))(x))(dg)
    want = jnp.stack([_per_example_switch(dg, w, xi) for xi in x])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_per_example_gradients_through_a_per_example_switch():
    # vmap of grad: each example's gradient is its own, with its own new state; nothing
    # is summed inside, so nothing is refused. Each equals the gradient of that example
    # alone, bit for bit.
    w, x = _weights_and_inputs()
    dg = fp8ax.Fp8DotGeneral.init()
    grad = eqx.filter_grad(lambda d, xi: jnp.sum(_per_example_switch(d, w, xi)))
    got = jax.vmap(grad, in_axes=(None, 0))(dg, x)
    for i, xi in enumerate(x):
        one = grad(dg, xi)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
            np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b))
