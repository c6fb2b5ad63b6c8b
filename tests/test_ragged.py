"""Grouped GEMMs (`fp8ax.Fp8RaggedDot`, converted `haliax.nn.MoELinear`): the three ragged
dots against float64 NumPy GEMMs of the registry's reference quantization, group by
group (empty, size-1 and uneven groups, rows past the last group), per-tensor and
per-expert weight scales, the per-expert state, conversion, and errors.

The reuse matrix (tests/_reuse.py, entry points `ragged_dot` and `hax_moe`) takes both
through jit, checkpoint, scan, vmap, cond, shard_map, microbatching and the other
boundaries; tests/_multidevice.py trains an MoE model sharded over an expert axis."""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8ax
from recipe_registry import REGISTRY

M, K, N, G = 24, 40, 16, 4
GROUPS = {
    "uneven": (5, 0, 1, 18),  # an empty group, a group of one, uneven sizes
    "short": (3, 0, 2, 4),  # rows 9..23 belong to no group: their outputs are zero
}
# Per-tensor scales in a per-expert reference: the recipes whose scale is one per tensor.
PER_EXPERT = [n for n, e in REGISTRY.items() if n.startswith(("delayed", "current", "running")) and "row" not in n]


def _wide(key, shape):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp(2.0 * jax.random.normal(k2, shape))


def _grouped(a, b, sizes, kind):
    """float64 NumPy reference of ragged dot `kind`, one group at a time."""
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    if kind == "fwd":  # a (M, K), b (G, K, N)
        out = np.zeros((a.shape[0], b.shape[2]))
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        return out
    if kind == "dlhs":  # a (M, N), b (G, K, N)
        out = np.zeros((a.shape[0], b.shape[1]))
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g].T
        return out
    out = np.zeros((len(sizes), a.shape[1], b.shape[1]))  # drhs: a (M, K), b (M, N)
    for g, (s, e) in enumerate(zip(starts, ends)):
        out[g] = a[s:e].T @ b[s:e]
    return out


def _close(got, want, what):
    # float32 accumulation of exact products, scales applied after: within 1e-5 of the
    # largest entry (the dequantize-then-GEMM path rounds each product once more).
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(np.max(np.abs(want)), 1e-30)
    err = np.max(np.abs(got - want)) / scale
    assert err < 1e-5, (what, err)


def _gemms(op, x, w, sizes, g):
    @jax.jit
    def run(x, w, g):
        out, vjp = jax.vjp(lambda x, w: op(x, w, sizes), x, w)
        return (out, *vjp(g))

    return run(x, w, g)


# Every recipe with uneven groups; rows past the last group with one recipe per kind of
# scale (tensor, row, block, int8).
GEMM_CASES = [(n, "uneven") for n in REGISTRY] + [
    (n, "short") for n in ("delayed", "current-row-pow2", "mx", "blockwise", "int8")
]


@pytest.mark.parametrize("name,groups", GEMM_CASES, ids=[f"{n}-{g}" for n, g in GEMM_CASES])
def test_gemms_match_reference(name, groups, getkey):
    """Forward, input and weight gradient of one tensor of expert weights against float64
    grouped GEMMs of the reference's quantized operands (each GEMM's own contraction)."""
    entry = REGISTRY[name]
    recipe, ref = entry.recipe, entry.reference
    sizes = jnp.array(GROUPS[groups], jnp.int32)
    x, w, g = _wide(getkey(), (M, K)), _wide(getkey(), (G, K, N)), _wide(getkey(), (M, N))
    op = fp8ax.Fp8RaggedDot.init(recipe)
    out, dx, dw = _gemms(op, x, w, sizes, g)
    xn, wn, gn = (np.asarray(a, np.float32) for a in (x, w, g))
    s = GROUPS[groups]
    _close(out, _grouped(ref(xn, (1,), "lhs"), ref(wn, (1,), "rhs"), s, "fwd"), (name, "fwd"))
    assert np.all(np.asarray(out)[sum(s) :] == 0)
    if not recipe.stochastic("grad"):
        _close(dx, _grouped(ref(gn, (1,), "grad"), ref(wn, (2,), "rhs"), s, "dlhs"), (name, "dlhs"))
        _close(dw, _grouped(ref(xn, (0,), "lhs"), ref(gn, (0,), "grad"), s, "drhs"), (name, "drhs"))
        assert np.all(np.asarray(dw)[1] == 0)  # the empty group's weight gets no gradient


@pytest.mark.parametrize("name", PER_EXPERT)
def test_per_expert_weights_match_reference(name, getkey):
    """Per-expert weight scales: each expert's weight quantized as a tensor of its own."""
    entry = REGISTRY[name]
    recipe, ref = entry.recipe, entry.reference
    s = GROUPS["uneven"]
    x, w, g = _wide(getkey(), (M, K)), _wide(getkey(), (G, K, N)), _wide(getkey(), (M, N))
    w = w * jnp.array([1.0, 10.0, 0.01, 100.0])[:, None, None]  # experts of very different ranges
    op = fp8ax.Fp8RaggedDot.init(recipe, num_experts=G)
    assert op.per_expert_weights
    out, dx, dw = _gemms(op, x, w, jnp.array(s, jnp.int32), g)
    xn, wn, gn = (np.asarray(a, np.float32) for a in (x, w, g))
    per_expert = lambda axes: np.stack([ref(wn[e], axes, "rhs") for e in range(G)])  # noqa: E731
    _close(out, _grouped(ref(xn, (1,), "lhs"), per_expert((0,)), s, "fwd"), (name, "fwd"))
    if not recipe.stochastic("grad"):
        _close(dx, _grouped(ref(gn, (1,), "grad"), per_expert((1,)), s, "dlhs"), (name, "dlhs"))
        _close(dw, _grouped(ref(xn, (0,), "lhs"), ref(gn, (0,), "grad"), s, "drhs"), (name, "drhs"))
    # One tensor scale for all experts loses the small expert: per-expert scales keep it.
    one = fp8ax.Fp8RaggedDot.init(recipe)
    small = lambda y: np.asarray(y)[5:6]  # noqa: E731  (the row of expert 2, 100x below expert 3's weights)
    exact = np.asarray(lax.ragged_dot(x, w, jnp.array(s, jnp.int32), precision="highest"))[5:6]
    err_one = np.abs(small(one(x, w, jnp.array(s, jnp.int32))) - exact).max()
    err_per = np.abs(small(out) - exact).max()
    assert err_per < err_one, (err_per, err_one)


def _step(model, loss):
    grads = eqx.filter_grad(loss)(model)
    overwrite, rest = fp8ax.partition_for_grad_overwrite(grads)
    return fp8ax.apply_updates(model, jax.tree.map(jnp.zeros_like, rest), overwrite)


def test_empty_group_keeps_its_state(getkey):
    """An expert no token reaches records nothing: its weight state is kept bit for bit,
    while the others' advance."""
    x, w = jax.random.normal(getkey(), (M, K)), jax.random.normal(getkey(), (G, K, N))
    op = fp8ax.Fp8RaggedDot.init(num_experts=G)
    first = _step(op, lambda op: jnp.sum(op(x, w, jnp.array([6, 6, 6, 6], jnp.int32))))
    assert np.all(np.asarray(first.rhs.amax_history[:, 0]) > 0)
    second = _step(first, lambda op: jnp.sum(op(2 * x, 3 * w, jnp.array([12, 0, 0, 12], jnp.int32))))
    for e in (1, 2):  # unused: kept
        np.testing.assert_array_equal(np.asarray(second.rhs.amax_history[e]), np.asarray(first.rhs.amax_history[e]))
        assert second.rhs.scale[e] == first.rhs.scale[e]
    for e in (0, 3):  # used: the new amax (3x), the history shifted
        np.testing.assert_array_equal(
            np.asarray(second.rhs.amax_history[e, :2]),
            np.array([3 * first.rhs.amax_history[e, 0], first.rhs.amax_history[e, 0]], np.float32),
        )


def test_used_twice_merges_by_max_and_nan_never_enters(getkey):
    """Two uses in one step: the state of the larger use alone (a max, not a sum); a NaN
    input records nothing and the state stays finite."""
    x, w = jax.random.normal(getkey(), (M, K)), jax.random.normal(getkey(), (G, K, N))
    sizes = jnp.array(GROUPS["uneven"], jnp.int32)
    for per_expert in (False, True):
        op = fp8ax.Fp8RaggedDot.init(num_experts=G, per_expert_weights=per_expert)
        twice = _step(op, lambda op: jnp.sum(op(x, w, sizes)) + jnp.sum(op(3 * x, 3 * w, sizes)))
        once = _step(op, lambda op: jnp.sum(op(3 * x, 3 * w, sizes)))
        for a, b in zip(jax.tree.leaves(twice), jax.tree.leaves(once), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        poisoned = _step(twice, lambda op: jnp.sum(op(x.at[0, 0].set(jnp.nan), w, sizes)))
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(poisoned))


def test_steps_and_stacks(getkey):
    """One jitted step writes the state (the next step shifts the history along), and a
    stacked layer has one state per layer (per expert for the weights)."""
    op = fp8ax.Fp8RaggedDot.init(num_experts=G, batch_shape=(3,))
    assert op.lhs.scale.shape == (3,) and op.rhs.scale.shape == (3, G) and op.rhs.amax_history.shape[:2] == (3, G)
    x, w = jax.random.normal(getkey(), (M, K)), jax.random.normal(getkey(), (G, K, N))
    single = fp8ax.Fp8RaggedDot.init(num_experts=G)
    step = eqx.filter_jit(lambda m: _step(m, lambda m: jnp.sum(m(x, w, jnp.array([6, 6, 6, 6], jnp.int32)))))
    written = step(single)
    assert jax.tree.structure(written) == jax.tree.structure(single)
    assert all(eqx.is_array(leaf) for leaf in jax.tree.leaves(written))
    again = step(written)
    assert bool(jnp.all(again.rhs.amax_history[:, 1] == written.rhs.amax_history[:, 0]))


# ---------------------------------------------------------------------------------------
# Haliax `MoELinear`: conversion, report, strip, and the op it calls.

Experts, Embed, Mlp, Tok = hax.Axis("experts", G), hax.Axis("embed", K), hax.Axis("mlp", N), hax.Axis("tok", M)


class _Moe(eqx.Module):
    up: hax.nn.MoELinear
    down: hax.nn.MoELinear

    def __call__(self, x, sizes):
        return self.down(hax.nn.relu(self.up(x, sizes)), sizes)


def _moe(key, use_gmm=False, **kw):
    k1, k2 = jax.random.split(key)
    return _Moe(
        hax.nn.MoELinear.init(Experts, Embed, Mlp, key=k1, use_gmm=use_gmm, **kw),
        hax.nn.MoELinear.init(Experts, Mlp, Embed, key=k2, use_gmm=use_gmm, out_first=True),
    )


@pytest.mark.parametrize("use_gmm", [False, True])
def test_moe_linear_converted(use_gmm, getkey):
    """Both `use_gmm` settings convert; the converted layer computes what its
    `Fp8RaggedDot` computes on the layer's weights, close to the plain layer, with the
    same output axes; `strip_fp8` gives the plain layer back."""
    model = _moe(getkey(), use_gmm)
    fp8 = fp8ax.fp8_linear_layers(model)
    assert isinstance(fp8.up, fp8ax.Fp8MoELinear) and isinstance(fp8.up.ragged, fp8ax.Fp8RaggedDot)
    assert fp8.up.ragged.per_expert_weights and fp8.up.ragged.rhs.scale.shape == (G,)
    x = hax.random.normal(getkey(), (Tok, Embed))
    sizes = hax.named(jnp.array(GROUPS["uneven"], jnp.int32), Experts)
    y = fp8.up(x, sizes)
    assert y.axes == (Tok, Mlp)
    want = fp8.up.ragged(x.array, fp8.up.weight.rearrange((Experts, Embed, Mlp)).array, sizes.array)
    np.testing.assert_array_equal(np.asarray(y.array), np.asarray(want + fp8.up.bias.array[None]))
    plain = _moe_ragged_reference(model.up, x, sizes)
    assert np.linalg.norm(np.asarray(y.array) - plain) / np.linalg.norm(plain) < 0.1
    out = fp8(x, sizes)
    assert out.axes == (Tok, Embed)
    stripped = fp8ax.strip_fp8(fp8)
    assert jax.tree.structure(stripped) == jax.tree.structure(model)


def _moe_ragged_reference(layer, x, sizes):
    w = layer.weight.rearrange((layer.Experts, layer.In, layer.Out)).array
    out = lax.ragged_dot(x.array, w, sizes.array, precision="highest")
    return np.asarray(out + layer.bias.array[None])


def test_moe_report_targets_and_min_features(getkey):
    """The conversion report lists MoE layers; `targets` and `min_features` apply to
    them; `per_expert_weights=False` gives one weight state."""
    model = _moe(getkey())
    report = fp8ax.conversion_report(model)
    assert report.converted == ["up", "down"] and not report.unsupported
    assert "hax.nn.MoELinear" in str(report)
    only_up = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(targets=["up"]))
    assert isinstance(only_up.up, fp8ax.Fp8MoELinear) and isinstance(only_up.down, hax.nn.MoELinear)
    report = fp8ax.conversion_report(model, fp8ax.Fp8Config(min_features=N + 1))
    assert report.skipped == ["up", "down"]
    shared = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(per_expert_weights=False))
    assert not shared.up.ragged.per_expert_weights and shared.up.ragged.rhs.scale.shape == ()
    again = fp8ax.fp8_linear_layers(fp8ax.fp8_linear_layers(model))
    assert fp8ax.conversion_report(again).paths("keep") == ["up", "down"]


def test_moe_in_stacked_blocks(getkey):
    """Inside `haliax.nn.Stacked`: one state per layer, per expert for the weights; a
    step trains and writes them."""
    Layers = hax.Axis("layers", 2)

    class Block(eqx.Module):
        moe: hax.nn.MoELinear

        @staticmethod
        def init(*, key):
            return Block(hax.nn.MoELinear.init(Experts, Embed, Embed.alias("embed2"), key=key))

        def __call__(self, x, sizes):
            return x + self.moe(x, sizes).rename({"embed2": "embed"})

    stacked = hax.nn.Stacked.init(Layers, Block)(key=jax.random.split(getkey(), 2))
    fp8 = fp8ax.fp8_linear_layers(stacked)
    assert fp8.stacked.moe.ragged.rhs.scale.shape == (2, G)
    assert fp8ax.conversion_report(stacked).layers[0].stacked == (2,)
    x = hax.random.normal(getkey(), (Tok, Embed))
    sizes = hax.named(jnp.array([6, 6, 0, 12], jnp.int32), Experts)
    loss = lambda m: hax.sum(m.fold(x, sizes) ** 2).scalar()  # noqa: E731
    new = eqx.filter_jit(lambda m: _step(m, loss))(fp8)
    hist = np.asarray(new.stacked.moe.ragged.rhs.amax_history[:, :, 0])
    assert np.all(hist[:, [0, 1, 3]] > 0) and np.all(hist[:, 2] == 0)


def test_errors():
    op = fp8ax.Fp8RaggedDot.init(num_experts=G)
    x, w = jnp.ones((M, K)), jnp.ones((G, K, N))
    with pytest.raises(ValueError, match=r"\(M, K\).*\(G, K, N\)"):
        op(x, w[0], jnp.ones((G,), jnp.int32))
    with pytest.raises(ValueError, match="`group_sizes` must be an integer array of shape \\(4,\\)"):
        op(x, w, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="for 4 experts, but `rhs` has 2"):
        op(x, w[:2], jnp.ones((2,), jnp.int32))
    with pytest.raises(TypeError, match="`lhs` must be a float16"):
        op(x.astype(jnp.int32), w, jnp.ones((G,), jnp.int32))
    with pytest.raises(ValueError, match="needs `num_experts`"):
        fp8ax.Fp8RaggedDot.init(per_expert_weights=True)
    with pytest.raises(ValueError, match="`num_experts` must be >= 1"):
        fp8ax.Fp8RaggedDot.init(num_experts=0)
    with pytest.raises(ValueError, match="not supported for grouped GEMMs"):
        fp8ax.Fp8RaggedDot.init(accumulation=fp8ax.EmulatedAccumulation())
    with pytest.raises(ValueError, match="outer scale \\(NVFP4\\)"):
        fp8ax.Fp8RaggedDot.init(fp8ax.NVFP4Scaling(), num_experts=G)(x, w, jnp.full((G,), 6, jnp.int32))
    with pytest.raises(NotImplementedError, match="group_offset"):
        op(x, w, jnp.ones((G,), jnp.int32), group_offset=jnp.zeros((1,), jnp.int32))
    with pytest.raises(TypeError, match="`per_expert_weights` must be a bool"):
        fp8ax.Fp8Config(per_expert_weights=1)
    assert dataclasses.replace(op, mode="qdq").per_expert_weights


SERVED = [n for n in REGISTRY if not n.startswith("nvfp4")]


SERVED_CASES = [(n, False) for n in SERVED] + [(n, True) for n in ("delayed", "current", "running-max")]


@pytest.mark.parametrize("name,per_group", SERVED_CASES, ids=[f"{n}{'-per-group' * g}" for n, g in SERVED_CASES])
def test_serving_is_bit_exact(name, per_group, getkey):
    """`to_serving` of a trained MoE model: the expert weights stored quantized (1 byte per
    value, or 2 FP4 values per byte), the output equal to the training model's bit for
    bit; `serving_template` has its structure; it cannot be differentiated."""
    recipe = REGISTRY[name].recipe
    config = fp8ax.Fp8Config(recipe=recipe, per_group_tokens=per_group)
    model = _moe(getkey())
    fp8 = fp8ax.fp8_linear_layers(model, config)
    x = hax.random.normal(getkey(), (Tok, Embed))
    all_experts = hax.named(jnp.array([6, 6, 6, 6], jnp.int32), Experts)
    loss = lambda m: hax.sum(m(x, all_experts) ** 2).scalar()  # noqa: E731
    step = eqx.filter_jit(lambda m: _step(m, loss))
    trained = step(step(fp8))
    serving = fp8ax.to_serving(trained)
    assert isinstance(serving.up, fp8ax.ServingMoELinear)
    assert np.dtype(serving.up.weight.dtype).itemsize == 1
    sizes = hax.named(jnp.array(GROUPS["uneven"], jnp.int32), Experts)
    want = eqx.filter_jit(lambda m: m(x, sizes))(trained)
    got = eqx.filter_jit(lambda m: m(x, sizes))(serving)
    np.testing.assert_array_equal(np.asarray(got.array), np.asarray(want.array))
    template = fp8ax.serving_template(fp8ax.fp8_linear_layers(model, config))
    # The same arrays (and settings) as a serving model of a fresh conversion.
    shapes = lambda t: [(a.shape, a.dtype) for a in jax.tree.leaves(t)]  # noqa: E731
    assert shapes(template) == shapes(serving)
    with pytest.raises(TypeError, match="serving layer"):
        jax.grad(lambda x: hax.sum(serving(hax.named(x, (Tok, Embed)), sizes)).scalar())(x.array)


def test_cast_floating_leaves_moe_serving_scales_alone(getkey):
    """`cast_floating` of a served MoE model keeps the grouped GEMM's scales float32 and
    its stored values (the scales were cast to bfloat16 before); the layer then computes
    in bfloat16, as the cast training layer does, under strict dtype promotion. On a
    bfloat16 input a layer's output is the float32 serving layer's within bfloat16's
    rounding of the bias and the output (2**-7 of the value, or of the largest one)."""
    model = fp8ax.fp8_linear_layers(_moe(getkey()))
    x = hax.random.normal(getkey(), (Tok, Embed))
    all_experts = hax.named(jnp.array([6, 6, 6, 6], jnp.int32), Experts)
    trained = eqx.filter_jit(lambda m: _step(m, lambda m: hax.sum(m(x, all_experts) ** 2).scalar()))(model)
    serving = fp8ax.to_serving(trained)
    cast = fp8ax.cast_floating(serving, jnp.bfloat16)
    for layer, was in ((cast.up, serving.up), (cast.down, serving.down)):
        assert layer.ragged.weight_scale.dtype == layer.ragged.input_scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(layer.ragged.weight_scale), np.asarray(was.ragged.weight_scale))
        np.testing.assert_array_equal(np.asarray(layer.weight.array), np.asarray(was.weight.array))
        assert layer.bias.array.dtype == jnp.bfloat16
    # One layer on a bfloat16 input: both quantize the same values with the same scale
    # and run the same GEMM; the cast layer rounds its bias and output to bfloat16.
    xb = x.astype(jnp.bfloat16)
    got = eqx.filter_jit(lambda m: m(xb, all_experts))(cast.up)
    assert got.array.dtype == jnp.bfloat16
    want = np.asarray(eqx.filter_jit(lambda m: m(xb.astype(jnp.float32), all_experts))(serving.up).array)
    np.testing.assert_allclose(np.asarray(got.array, np.float64), want, rtol=2.0**-7, atol=2.0**-7 * np.abs(want).max())
    assert eqx.filter_jit(lambda m: m(xb, all_experts))(cast).array.dtype == jnp.bfloat16


def test_serving_needs_every_expert_observed(getkey):
    """A delayed-scaling expert that no token ever reached has no scale to freeze:
    `to_serving` names the layer and the expert."""
    fp8 = fp8ax.fp8_linear_layers(_moe(getkey()))
    x = hax.random.normal(getkey(), (Tok, Embed))
    sizes = hax.named(jnp.array([12, 0, 6, 6], jnp.int32), Experts)
    trained = eqx.filter_jit(lambda m: _step(m, lambda m: hax.sum(m(x, sizes)).scalar()))(fp8)
    with pytest.raises(ValueError, match=r"Layer `up` \(stacked entries \[\(1,\)\].*empty weight amax history"):
        fp8ax.to_serving(trained)


@pytest.mark.parametrize("name", PER_EXPERT)
def test_per_group_tokens_match_reference(name, getkey):
    """Per-group token scales: the tokens (and output gradients) of each group quantized
    as a tensor of their own, the weights per expert."""
    entry = REGISTRY[name]
    recipe, ref = entry.recipe, entry.reference
    s = GROUPS["uneven"]
    x, w, g = _wide(getkey(), (M, K)), _wide(getkey(), (G, K, N)), _wide(getkey(), (M, N))
    x = x * jnp.repeat(jnp.array([1.0, 1.0, 1e-3, 30.0]), jnp.array(s), total_repeat_length=M)[:, None]
    op = fp8ax.Fp8RaggedDot.init(recipe, num_experts=G, per_group_tokens=True)
    out, dx, dw = _gemms(op, x, w, jnp.array(s, jnp.int32), g)
    xn, wn, gn = (np.asarray(a, np.float32) for a in (x, w, g))
    ends = np.cumsum(s)

    def per_group(a, role):
        out = np.zeros(a.shape)
        for start, end in zip(ends - np.array(s), ends):
            if end > start:
                out[start:end] = ref(a[start:end], (1,), role)
        return out

    per_expert = np.stack([ref(wn[e], (0,), "rhs") for e in range(G)])
    per_expert_t = np.stack([ref(wn[e], (1,), "rhs") for e in range(G)])
    _close(out, _grouped(per_group(xn, "lhs"), per_expert, s, "fwd"), (name, "fwd"))
    if not recipe.stochastic("grad"):
        _close(dx, _grouped(per_group(gn, "grad"), per_expert_t, s, "dlhs"), (name, "dlhs"))
        _close(dw, _grouped(per_group(xn, "lhs"), per_group(gn, "grad"), s, "drhs"), (name, "drhs"))
    if recipe.stateful:
        assert op.lhs.batch_shape == op.grad.batch_shape == op.rhs.batch_shape == (G,)
    if isinstance(recipe, fp8ax.DelayedScaling):  # the empty group observed nothing
        new = _step(op, lambda op: jnp.sum(op(x, w, jnp.array(s, jnp.int32))))
        hist = np.asarray(new.lhs.amax_history[:, 0])
        assert hist[1] == 0 and np.all(hist[[0, 2, 3]] > 0)
        np.testing.assert_allclose(hist[3], np.abs(xn[6:]).max(), rtol=0)


def test_per_group_tokens_needs_tensor_scales():
    with pytest.raises(ValueError, match="per_group_tokens=True.*MXScaling"):
        fp8ax.Fp8RaggedDot.init(fp8ax.MXScaling(), num_experts=G, per_group_tokens=True)
    with pytest.raises(ValueError, match="needs `num_experts`"):
        fp8ax.Fp8RaggedDot.init(per_group_tokens=True)
