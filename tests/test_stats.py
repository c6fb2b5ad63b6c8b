"""scaling_stats and plot_amax_history.

The saturation and underflow fractions are checked against NumPy: the scale is replayed
from the documented formula (`scale = max(history) * float32(1 / fp8_max)`, in float32),
the values are divided by it in float64 and cast to FP8 with ml_dtypes. Fractions of
counts are compared exactly.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from helpers import Batch, Deep, In, Layers, Out, mse, sgd_step

E4M3_MAX = 448.0


def _dg_with_history(lhs_amax: float, rhs_amax: float) -> fp8ax.Fp8DotGeneral:
    dg = fp8ax.Fp8DotGeneral.init(fp8ax.DelayedScaling(history_length=4))
    hist = lambda a: fp8ax.ScalingState(jnp.float32(1.0), jnp.array([a, 0.5 * a, 0.0, 0.0], jnp.float32))  # noqa: E731
    return dg.with_states(lhs=hist(lhs_amax), rhs=hist(rhs_amax))


def _reference(x, history_max):
    """(saturation, underflow) of `x` quantized to E4M3 with delayed scaling, in NumPy."""
    scale = np.float32(history_max) * np.float32(1.0 / E4M3_MAX)  # the scale the call uses (float32)
    y = np.asarray(x, np.float64) / np.float64(scale)
    q = np.clip(y, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    nonzero = y != 0
    return np.mean(np.abs(y) > E4M3_MAX), np.sum(nonzero & (q == 0)) / np.sum(nonzero)


def test_fractions_on_a_hand_built_tensor():
    amax = 3.0
    scale = float(np.float32(amax) * np.float32(1 / E4M3_MAX))
    # In units of the scale: 3 values beyond 448 (saturate), 3 nonzero values below half the
    # smallest E4M3 subnormal (2**-10 ~ 9.8e-4: they round to 0), 2 zeros, 8 ordinary values.
    units = [1000.0, -600.0, 460.0, 4e-4, -1e-4, 9e-4, 0.0, 0.0, 440.0, -447.0, 2e-3, 1.5e-3, 1.0, -3.5, 100.0, 0.25]
    x = jnp.asarray(np.array(units) * scale, jnp.float32).reshape(2, 8)
    w = jnp.asarray(np.linspace(-1.0, 1.0, 8 * 3), jnp.float32).reshape(8, 3)  # within the rhs amax of 2
    dg = _dg_with_history(amax, 2.0)
    dims = (((1,), (0,)), ((), ()))
    stats = fp8ax.scaling_stats(dg, lambda d, a, b: d(a, b, dims), x, w)
    assert stats["dot_general/lhs/saturation"] == 3 / 16
    assert stats["dot_general/lhs/underflow"] == 3 / 14
    sat, under = _reference(x, amax)
    assert (stats["dot_general/lhs/saturation"], stats["dot_general/lhs/underflow"]) == (sat, under)
    sat, under = _reference(w, 2.0)
    assert (stats["dot_general/rhs/saturation"], stats["dot_general/rhs/underflow"]) == (sat, under) == (0.0, 0.0)
    # The state entries: the stored scale, the newest amax and the largest one.
    assert stats["dot_general/lhs/scale"] == 1.0
    assert stats["dot_general/lhs/amax"] == 3.0 and stats["dot_general/lhs/amax_history_max"] == 3.0
    assert all(type(v) is float for v in stats.values())


E5M2_MAX = 57344.0


def _grad_reference(g, history_max):
    """(saturation, underflow) of an output gradient `g` quantized to E5M2 with delayed scaling."""
    scale = np.float32(history_max) * np.float32(1.0 / E5M2_MAX)
    y = np.asarray(g, np.float64) / np.float64(scale)
    q = np.clip(y, -E5M2_MAX, E5M2_MAX).astype(np.float32).astype(ml_dtypes.float8_e5m2).astype(np.float64)
    nonzero = y != 0
    return np.mean(np.abs(y) > E5M2_MAX), np.sum(nonzero & (q == 0)) / max(1, np.sum(nonzero))


@pytest.mark.parametrize("microbatches", [1, 4])
def test_output_gradient_fractions_against_numpy(getkey, microbatches):
    # The issue this reports: the history calibrated with the full batch's mean loss, the
    # step differentiates each microbatch's mean loss (`average=True`): the output
    # gradients are `microbatches` times larger than the history saw, and saturate E5M2.
    n, k = 32, microbatches
    calibrating = fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(calibrate_first_call=True))
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()), calibrating)
    x, y = jax.random.normal(getkey(), (n, 8)), jax.random.normal(getkey(), (n, 4))

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    model = fp8ax.calibrate(model, loss, [(x, y)])
    grad_fn = fp8ax.microbatched(eqx.filter_grad(loss), k, average=True) if k > 1 else eqx.filter_grad(loss)
    stats = fp8ax.scaling_stats(model, grad_fn, x, y)
    # Reference for the last layer, whose output gradient is d loss / d prediction: each
    # microbatch's mean over its n/k x 4 elements gives 2 (pred - y) / (n/k * 4).
    pred = np.asarray(jax.vmap(model)(x), np.float32)
    g = np.float32(2.0) * (pred - np.asarray(y)) / np.float32(n // k * 4)
    history_max = float(jnp.max(model.layers[1].dot_general.grad.amax_history))
    sat, under = _grad_reference(g, history_max)
    # Tolerance: one element of n x 4 (float32 rounding of g and of the scale at the boundary).
    assert abs(stats["layers.1/grad/saturation"] - sat) <= 1 / g.size
    assert abs(stats["layers.1/grad/underflow"] - under) <= 1 / g.size
    if k == 1:
        assert stats["layers.1/grad/saturation"] == 0.0  # the history saw these very gradients
    else:
        assert stats["layers.1/grad/saturation"] > 0.25  # k = 4 times the calibrated amax
    assert "layers.0/grad/saturation" in stats and "layers.0/grad/underflow" in stats
    # Without a derivative in `fn`, no gradient numbers (and the forward ones as before).
    forward = fp8ax.scaling_stats(model, loss, x, y)
    assert "layers.1/grad/saturation" not in forward and "layers.1/lhs/saturation" in forward


def test_state_only_and_the_keys(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(4, 3, 16, 1, key=getkey()))
    stats = fp8ax.scaling_stats(model)
    assert sorted(stats) == sorted(
        f"layers.{i}/{t}/{s}"
        for i in (0, 1)
        for t in ("lhs", "rhs", "grad")
        for s in ("scale", "amax", "amax_history_max")
    )
    assert all(v == (1.0 if k.endswith("scale") else 0.0) for k, v in stats.items())  # fresh state


def test_vmap_per_example_equals_one_batched_call(getkey):
    # A fresh model (empty history): the first call calibrates on the amax of the whole
    # batch, under vmap as well, and the fractions count every example.
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 32, 1, key=getkey()))
    x = jax.random.normal(getkey(), (16, 8)) * jnp.logspace(-7, 0, 16)[:, None]  # examples 1e-7 to 1 in size
    per_example = fp8ax.scaling_stats(model, lambda m, x: jax.vmap(m)(x), x)
    batched = fp8ax.scaling_stats(model, lambda m, x: m(x), x)  # Fp8Linear takes leading batch dimensions
    assert per_example == batched
    # The small examples lose entries to the scale of the large ones (scaled one by one, they would not).
    assert per_example["layers.0/lhs/underflow"] > 0.1


@pytest.mark.needs_hax_dot
def test_stacked_layers_get_one_entry_each(getkey):
    import haliax as hax

    model = fp8ax.fp8_linear_layers(Deep.init(key=getkey()))
    x, y = hax.random.normal(getkey(), (Batch, In)), hax.random.normal(getkey(), (Batch, Out))
    model = sgd_step(mse)(model, x, y)
    state = model.blocks.stacked.mlp.up_proj.dot_general.rhs
    # Layer 1's weight grows 100-fold after its history was recorded: only it saturates.
    w = model.blocks.stacked.mlp.up_proj.weight
    w = hax.named(w.array.at[1].multiply(100.0), w.axes)
    model = eqx.tree_at(lambda m: m.blocks.stacked.mlp.up_proj.weight, model, w)
    stats = fp8ax.scaling_stats(model, eqx.filter_jit(mse), x, y)
    for i in range(Layers.size):
        key = f"blocks.stacked.mlp.up_proj[{i}]/rhs"
        assert stats[f"{key}/scale"] == float(state.scale[i])
        assert stats[f"{key}/amax"] == float(state.amax_history[i, 0])
        assert stats[f"{key}/amax_history_max"] == float(jnp.max(state.amax_history[i]))
        sat, under = _reference(np.asarray(w.array[i]), float(jnp.max(state.amax_history[i])))
        assert (stats[f"{key}/saturation"], stats[f"{key}/underflow"]) == (sat, under), i
    assert stats["blocks.stacked.mlp.up_proj[1]/rhs/saturation"] > 0.5
    assert "head/lhs/saturation" in stats and "blocks.stacked.mlp.up_proj/rhs/scale" not in stats


def test_stateless_recipe_has_fractions_only(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.Linear(16, 4, key=getkey()), fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling()))
    x = jnp.concatenate([jnp.full((1, 16), 1e-5), jnp.ones((1, 16)) * 300.0])
    stats = fp8ax.scaling_stats(model, lambda m, x: m(x), x)
    assert set(stats) == {f"(root)/{t}/{s}" for t in ("lhs", "rhs") for s in ("saturation", "underflow")}
    # Scaled by its own amax (300): nothing saturates, and 1e-5 * 448 / 300 < 2**-10 flushes to zero.
    assert stats["(root)/lhs/saturation"] == 0.0 and stats["(root)/lhs/underflow"] == 0.5


def test_errors(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(4, 3, 16, 1, key=getkey()))
    with pytest.raises(TypeError, match="must be called outside `jax.jit`"):
        eqx.filter_jit(lambda m: fp8ax.scaling_stats(m)["layers.0/lhs/scale"])(model)
    with pytest.raises(TypeError, match="got arguments for `fn`, but no `fn`"):
        fp8ax.scaling_stats(model, None, jnp.ones(4))
    with pytest.raises(TypeError, match="`fn` must be a callable taking the model first"):
        fp8ax.scaling_stats(model, jnp.ones(4))


def test_plot_amax_history(getkey, tmp_path):
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(4, 3, 16, 1, key=getkey()))
    model = fp8ax.calibrate(model, lambda m, x: jnp.sum(jax.vmap(m)(x)), [(jax.random.normal(getkey(), (8, 4)),)] * 3)
    out = fp8ax.plot_amax_history(model, tmp_path / "sub" / "amax.png", title="MLP")
    assert out == tmp_path / "sub" / "amax.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="`tensors` must name some of"):
        fp8ax.plot_amax_history(model, tmp_path / "x.png", tensors=("weights",))
    stateless = fp8ax.fp8_linear_layers(
        eqx.nn.Linear(4, 4, key=getkey()), fp8ax.Fp8Config(recipe=fp8ax.CurrentScaling())
    )
    with pytest.raises(ValueError, match="`model` has no FP8 state to plot"):
        fp8ax.plot_amax_history(stateless, tmp_path / "x.png")


class _QKV(eqx.Module):
    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear

    def __call__(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(q * jax.nn.sigmoid(k) + v)


def test_plot_merges_layers_that_share_an_input(getkey, tmp_path):
    # q, k and v read the same input: their lhs histories are equal, and three lines drawn
    # on top of one another would show only the last. One line, named after all three.
    model = fp8ax.fp8_linear_layers(_QKV(*(eqx.nn.Linear(16, 16, key=getkey()) for _ in range(4))))
    batches = [(jax.random.normal(getkey(), (8, 16)) * (1 + i),) for i in range(5)]
    model = fp8ax.calibrate(model, lambda m, x: jnp.sum(jax.vmap(m)(x) ** 2), batches)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    merge = fp8ax._inspect.plot.merge_identical
    lhs = merge([(n, np.asarray(getattr(model, n).dot_general.lhs.amax_history)) for n in names])
    assert [(label, first) for label, _, first in lhs] == [("q_proj, k_proj, v_proj", "q_proj"), ("o_proj", "o_proj")]
    rhs = merge([(n, np.asarray(getattr(model, n).dot_general.rhs.amax_history)) for n in names])
    assert [label for label, _, _ in rhs] == list(names)  # four weights, four lines
    out = fp8ax.plot_amax_history(model, tmp_path / "qkv.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(getkey, tmp_path, monkeypatch):
    model = fp8ax.fp8_linear_layers(eqx.nn.Linear(4, 4, key=getkey()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ImportError, match=r"needs matplotlib: `pip install fp8ax\[plot\]`"):
        fp8ax.plot_amax_history(model, tmp_path / "amax.png")
    assert not (tmp_path / "amax.png").exists()
