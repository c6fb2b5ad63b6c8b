"""DelayedScaling: validation, and a float64 NumPy replay of the scaling maths."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8ax

DIMS = (((1,), (0,)), ((), ()))


def test_float_margin_equal_to_an_integer_is_accepted():
    # TransformerEngine's DelayedScaling(margin=0.0) ports as it is.
    r = fp8ax.DelayedScaling(margin=2.0)
    assert r.margin == 2 and isinstance(r.margin, int)
    assert r == fp8ax.DelayedScaling(margin=2)
    assert fp8ax.DelayedScaling(margin=np.float32(0.0)).margin == 0


def test_defaults():
    r = fp8ax.DelayedScaling()
    assert (r.history_length, r.margin, r.amax_compute_algo, r.calibrate_first_call) == (1024, 0, "max", False)
    assert r.fwd_dtype == np.dtype(jnp.float8_e4m3fn) and r.grad_dtype == np.dtype(jnp.float8_e5m2)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(history_length=0), ValueError, "`history_length` must be >= 1, got 0"),
        (dict(history_length=2.5), TypeError, "`history_length` must be an int"),
        (dict(margin=-1), ValueError, "`margin` must be >= 0, got -1"),
        (dict(margin=0.5), TypeError, "`margin` must be an int"),
        (dict(margin=float("nan")), TypeError, "`margin` must be an int"),
        (dict(margin=-1.0), ValueError, "`margin` must be >= 0, got -1"),
        (dict(amax_compute_algo="mean"), ValueError, "`amax_compute_algo` must be 'max' or 'most_recent'"),
        (dict(calibrate_first_call=1), TypeError, "`calibrate_first_call` must be a bool"),
        (dict(fwd_dtype=jnp.bfloat16), TypeError, "`fwd_dtype` must be an 8-bit floating-point dtype"),
        (dict(grad_dtype=jnp.int8), TypeError, "`grad_dtype` must be an 8-bit floating-point dtype"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fp8ax.DelayedScaling(**kwargs)


def test_recipe_is_immutable():
    r = fp8ax.DelayedScaling()
    with pytest.raises(AttributeError):
        r.margin = 3  # type: ignore[misc]


class _Replay:
    """Delayed scaling of one tensor, written from the docs in float64 NumPy."""

    def __init__(self, recipe: fp8ax.DelayedScaling, fp8_max: float):
        self.r, self.max = recipe, fp8_max
        self.scale = 1.0
        self.hist = np.zeros(recipe.history_length)

    def call(self, x) -> float:
        amax = float(np.max(np.abs(np.asarray(x, np.float64))))
        past = self.hist.max() if self.r.amax_compute_algo == "max" else self.hist[0]
        if self.r.calibrate_first_call and not self.hist.any():
            past = amax
        used = past / self.max * 2.0**self.r.margin if np.isfinite(past) and past > 0 else self.scale
        if np.isfinite(amax) and amax > 0:  # an observation: record it
            self.scale = used
            self.hist = np.concatenate([[amax], self.hist[:-1]])
        return used


def _q(x, scale, ml_dtype, bound):
    scaled = np.asarray(x, np.float32) * (np.float32(1.0) / np.float32(scale))
    return np.clip(scaled, -bound, bound).astype(ml_dtype).astype(np.float64)


@eqx.filter_jit
def _step(dg, x, w, gy):
    """One training step of a lone dot general: its output and its new state."""

    def f(dg):
        y = dg(x, w, DIMS)
        return jnp.sum(y * gy), y

    grads, y = eqx.filter_grad(f, has_aux=True)(dg)
    overwrite, _ = fp8ax.partition_for_grad_overwrite(grads)
    return fp8ax.apply_updates(dg, None, overwrite), y


@pytest.mark.parametrize(
    "recipe",
    [
        fp8ax.DelayedScaling(),
        fp8ax.DelayedScaling(history_length=3, margin=1),
        fp8ax.DelayedScaling(history_length=4, amax_compute_algo="most_recent"),
        fp8ax.DelayedScaling(history_length=2, calibrate_first_call=False),
    ],
)
def test_hand_replay_five_steps(recipe, getkey):
    dg = fp8ax.Fp8DotGeneral.init(recipe)

    rl, rr = _Replay(recipe, 448.0), _Replay(recipe, 448.0)
    rg = _Replay(recipe, 57344.0)
    # Magnitudes change from step to step, including a first step far above E4M3's 448,
    # gradients far below E5M2's smallest normal, and a step whose gradient is all zero.
    mags = [(1000.0, 3.0, 1e-7), (2.0, 0.5, 10.0), (50.0, 4.0, 0.0), (0.1, 1.0, 3e-3), (7.0, 8.0, 1.0)]
    for t, (mx, mw, mg) in enumerate(mags):
        x = jax.random.normal(getkey(), (8, 16), jnp.float32) * mx
        w = jax.random.normal(getkey(), (16, 4), jnp.float32) * mw
        gy = jax.random.normal(getkey(), (8, 4), jnp.float32) * mg
        sl, sr = rl.call(x), rr.call(w)
        rg.call(gy)
        dg, y = _step(dg, x, w, gy)
        # Scales and histories match the replay to float32 rounding.
        for rep, st in ((rl, dg.lhs), (rr, dg.rhs), (rg, dg.grad)):
            np.testing.assert_allclose(np.asarray(st.scale), rep.scale, rtol=1e-6, err_msg=f"step {t}")
            np.testing.assert_allclose(np.asarray(st.amax_history), rep.hist, rtol=1e-6, err_msg=f"step {t}")
        # The forward used the replayed scales: the output is the exact product of the
        # quantized operands (float64 here, float32 accumulation there: rtol 1e-5).
        ref = (_q(x, sl, ml_dtypes.float8_e4m3fn, 448.0) @ _q(w, sr, ml_dtypes.float8_e4m3fn, 448.0)) * (sl * sr)
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("empty", ["lhs", "rhs", "grad"])
def test_hand_replay_when_some_histories_are_empty(empty, getkey):
    # A call decides once whether it calibrates (any of its three histories empty), but
    # each tensor still gets the scale its own history gives: a filled history its delayed
    # scale, the empty one its own amax. (Fresh layers and filled ones are covered above.)
    recipe = fp8ax.DelayedScaling(history_length=4)
    reps = {"lhs": _Replay(recipe, 448.0), "rhs": _Replay(recipe, 448.0), "grad": _Replay(recipe, 57344.0)}
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    for role, past in (("lhs", [5.0, 2.0, 0.0, 0.0]), ("rhs", [0.5, 0.0, 0.0, 0.0]), ("grad", [3e-3, 1.0, 0.0, 0.0])):
        if role == empty:
            continue
        reps[role].hist, reps[role].scale = np.asarray(past), 0.125
        st = fp8ax.ScalingState(jnp.float32(0.125), jnp.asarray(past, jnp.float32))
        dg = dg.with_states(**{role: st})

    for t, (mx, mw, mg) in enumerate([(1000.0, 3.0, 1e-7), (2.0, 0.5, 10.0)]):
        x = jax.random.normal(getkey(), (8, 16), jnp.float32) * mx
        w = jax.random.normal(getkey(), (16, 4), jnp.float32) * mw
        gy = jax.random.normal(getkey(), (8, 4), jnp.float32) * mg
        sl, sr = reps["lhs"].call(x), reps["rhs"].call(w)
        reps["grad"].call(gy)
        dg, y = _step(dg, x, w, gy)
        for role, rep in reps.items():
            st = getattr(dg, role)
            np.testing.assert_allclose(np.asarray(st.scale), rep.scale, rtol=1e-6, err_msg=f"{role}, step {t}")
            np.testing.assert_allclose(np.asarray(st.amax_history), rep.hist, rtol=1e-6, err_msg=f"{role}, step {t}")
        # rtol 1e-5: float64 here, float32 accumulation there.
        ref = (_q(x, sl, ml_dtypes.float8_e4m3fn, 448.0) @ _q(w, sr, ml_dtypes.float8_e4m3fn, 448.0)) * (sl * sr)
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_operands_quantized_together_match_one_by_one(getkey):
    # `quantize_operands` (one decision for the call) against `quantize_operand` of each
    # operand alone, with one filled history and one empty.
    recipe = fp8ax.DelayedScaling(history_length=4, calibrate_first_call=True)
    xs = [jax.random.normal(getkey(), (3, 4)) * 900.0, jax.random.normal(getkey(), (4, 5))]
    states = [
        (jnp.float32(0.5), jnp.asarray([3.0, 1.0, 0.0, 0.0], jnp.float32)),
        (jnp.float32(1.0), jnp.zeros(4, jnp.float32)),
    ]
    together = jax.jit(
        lambda xs, states: recipe.quantize_operands(
            [fp8ax.Operand(x, (1,), recipe.fwd_dtype, st) for x, st in zip(xs, states)]
        )
    )(xs, states)
    alone = [
        jax.jit(lambda x, st: recipe.quantize_operand(x, (1,), recipe.fwd_dtype, state=st))(x, st)
        for x, st in zip(xs, states)
    ]
    # The filled history's delayed scale, and the empty one's own amax (one float32 multiply).
    want = [
        np.float32(3.0) * np.float32(1 / 448.0),
        np.float32(np.max(np.abs(np.asarray(xs[1])))) * np.float32(1 / 448.0),
    ]
    for (q, new), (q1, new1), x, w in zip(together, alone, xs, want):
        assert np.asarray(q.scale) == w == np.asarray(q1.scale)
        np.testing.assert_array_equal(
            np.asarray(q.values, np.float32), np.asarray(_q(x, w, ml_dtypes.float8_e4m3fn, 448.0), np.float32)
        )
        np.testing.assert_array_equal(np.asarray(q.values, np.float32), np.asarray(q1.values, np.float32))
        for a, b in zip(new, new1):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "history, expected",
    [
        ([3.0, 1.0, 0.5, 0.0], 3.0),  # a filled history: its max
        ([0.0, 0.0, 0.0, 0.0], None),  # empty: no delayed amax, the scale stays
        ([3.0, -1.0, 0.5, 0.0], None),  # entries no fp8ax update writes: the same
        ([3.0, np.inf, 0.5, 0.0], None),
        ([3.0, np.nan, 0.5, 0.0], None),
    ],
)
def test_without_calibration_a_corrupt_history_keeps_the_scale(history, expected):
    # `calibrate_first_call=False` compiles no conditional and so raises nothing; a
    # history that went through an optimizer must not give a scale either.
    recipe = fp8ax.DelayedScaling(history_length=4, calibrate_first_call=False)
    old_scale = np.float32(0.25)
    x = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
    q, (new_scale, new_hist) = jax.jit(
        lambda x, s, h: recipe.quantize_operand(x, (1,), recipe.fwd_dtype, state=(s, h))
    )(x, jnp.float32(old_scale), jnp.asarray(history, jnp.float32))
    want = old_scale if expected is None else np.float32(expected * np.float32(1 / 448.0))
    assert np.asarray(q.scale) == want
    np.testing.assert_array_equal(
        np.asarray(q.values, np.float32), np.asarray(_q(x, want, ml_dtypes.float8_e4m3fn, 448.0), np.float32)
    )
    # The call's own observation is recorded as usual.
    assert float(new_hist[0]) == 2.0 and float(new_scale) == want
    # `scale_for_call`, the formula written out, agrees (with `calibrate_first_call` an
    # empty or corrupt history takes the call's own amax).
    for calibrate in (False, True):
        r = fp8ax.DelayedScaling(history_length=4, calibrate_first_call=calibrate)
        got = jax.jit(r.scale_for_call, static_argnums=3)(
            jnp.float32(old_scale), jnp.asarray(history, jnp.float32), jnp.float32(2.0), 448.0
        )
        if calibrate and expected is None:
            # An empty or corrupt history calibrates on the call's amax (as the step does).
            want = np.float32(2.0 * np.float32(1 / 448.0))
        assert np.asarray(got) == want, calibrate


def test_every_state_form_gives_the_same_call():
    # A delayed-scaling state reaches the recipe as a `ScalingState`'s `(data,)`, a
    # `(scale, amax_history, unit)` triple or a `(scale, amax_history)` pair (unit 1); the
    # plan reads each form into the same stack of units and scales (`stored_columns`).
    # Stored with unit 0.5, the values stand for twice the stored ones.
    recipe = fp8ax.DelayedScaling(history_length=4)
    x = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
    scale, hist, unit = np.float32(0.125), np.asarray([1.5, 0.5, 0.0, 0.25], np.float32), np.float32(0.5)
    forms = {
        "data": (jnp.asarray(np.concatenate([[unit, scale], hist]).astype(np.float32)),),
        "triple": (jnp.float32(scale), jnp.asarray(hist), jnp.float32(unit)),
        "pair": (jnp.float32(scale / unit), jnp.asarray(hist / unit)),
    }
    got = {
        name: jax.jit(lambda x, state: recipe.quantize_operand(x, (1,), recipe.fwd_dtype, state=state))(x, state)
        for name, state in forms.items()
    }
    want = np.float32(np.float32(3.0) * np.float32(1 / 448.0))  # the history's max, read through the unit
    for name, (q, _) in got.items():
        assert np.asarray(q.scale) == want, name
        np.testing.assert_array_equal(np.asarray(q.values, np.float32), np.asarray(got["data"][0].values, np.float32))


def test_scaling_state_init():
    st = fp8ax.ScalingState.init(4, (2,))
    assert st.scale.shape == (2,) and st.amax_history.shape == (2, 4)
    np.testing.assert_array_equal(np.asarray(st.scale), 1.0)
    np.testing.assert_array_equal(np.asarray(st.amax_history), 0.0)
    with pytest.raises(ValueError, match="`history_length` must be an int >= 1, got 0"):
        fp8ax.ScalingState.init(0)


def test_bad_operands_are_errors():
    recipe = fp8ax.DelayedScaling(history_length=4)
    x = jnp.ones((2, 3))
    state = (jnp.float32(1.0), jnp.zeros(4, jnp.float32))
    with pytest.raises(
        TypeError, match=r"`operands` must be a sequence of `fp8ax.Operand`, got an element of type tuple"
    ):
        recipe.quantize_operands([(x, (1,), recipe.fwd_dtype, state)])
    with pytest.raises(TypeError, match=r"`operands` must be a sequence of `fp8ax.Operand`"):
        fp8ax.CurrentScaling().quantize_operands([x])
    with pytest.raises(ValueError, match=r"`state` is required"):
        recipe.quantize_operands([fp8ax.Operand(x, (1,), recipe.fwd_dtype)])
    with pytest.raises(ValueError, match=r"`state` is required"):
        recipe.plan([state, None])
    with pytest.raises(
        TypeError,
        match=r"`state` must be a `ScalingState`'s `\(data,\)`, a `\(scale, amax_history, unit\)` triple or a `\(scale, amax_history\)` pair, got ScalingState",
    ):
        recipe.plan([fp8ax.ScalingState.init(4)])


@pytest.mark.parametrize("form", ["pair", "packed", "packed, read as on GPUs"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
def test_scales_planned_together_are_each_states_own(form, algo, margin, getkey, monkeypatch):
    # `plan` computes the scales of a call's states on a stack of them; each must be the
    # formula for that state alone (float32: amax * float32(2**margin / fp8_max), at
    # least 2**-126, the old scale where the history gives no usable amax), and what
    # `quantize_operand` of that state alone uses. Two formats, an empty and a corrupt
    # history, one that underflows, and one of another length (planned apart: it cannot
    # be stacked). The states as `(scale, history)` pairs (read one by one) and as
    # `ScalingState` arrays, one of them stored with a unit of 1/2 (as after Levanter's
    # averaging of two microbatches): read one by one on CPU, stacked first where the
    # program is lowered for a GPU (here on CPU too).
    recipe = fp8ax.DelayedScaling(history_length=4, margin=margin, amax_compute_algo=algo, calibrate_first_call=False)
    e4, e5 = recipe.fwd_dtype, recipe.grad_dtype
    cases = [  # (scale, history, format)
        (0.5, [3.0, 7.0, 0.0, 0.0], e4),
        (0.25, [0.0, 0.0, 0.0, 0.0], e4),
        (2.0, [5.0, -1.0, 0.0, 0.0], e5),
        (1.0, [1e-3, 7.0, 0.0, 0.0], e5),
        (0.125, [1e-37, 2e-38, 0.0, 0.0], e4),  # a normal amax whose scale would be subnormal
        (3.0, [600.0, 2.0, 1.0, 0.0, 0.0, 0.0], e5),
    ]
    if form == "packed, read as on GPUs":
        from fp8ax._recipes import delayed

        on_gpus = delayed._read_branches(algo != "max")[1]
        monkeypatch.setattr(delayed, "_read_branches", lambda newest: (on_gpus, on_gpus))
    if form == "pair":
        states = [(jnp.float32(s), jnp.asarray(h, jnp.float32)) for s, h, _ in cases]
    else:
        units = [0.5] + [1.0] * (len(cases) - 1)
        states = [(jnp.asarray([u, s * u, *(v * u for v in h)], jnp.float32),) for u, (s, h, _) in zip(units, cases)]
    dtypes = [d for _, _, d in cases]
    plans = jax.jit(lambda sts: recipe.plan(sts, dtypes))(states)
    for (s, h, d), st, p in zip(cases, states, plans):
        h = np.asarray(h, np.float32)
        amax = (h.max() if algo == "max" else h[0]) if h.min() >= 0 else np.float32(0)
        new = np.float32(amax) * np.float32(2.0**margin / float(ml_dtypes.finfo(d).max))
        # At least the smallest normal float32 (an amax of 1e-44 gives 2**-126, not 0).
        new = max(new, np.float32(2.0**-126))
        want = new if (np.isfinite(new) and amax > 0) else np.float32(s)
        got = recipe.planned_scale(p)
        assert np.asarray(got) == want, (s, h.tolist())
        assert np.asarray(p.inv) == np.float32(1) / want
        x = jax.random.normal(getkey(), (3, 4))
        q, _ = jax.jit(lambda x, st: recipe.quantize_operand(x, (1,), d, state=st))(x, st)
        assert np.asarray(q.scale) == want
    # With the first-call calibration, or without the formats, nothing is planned.
    assert recipe.planned_scale(recipe.plan(states[:1])[0]) is None
    first_call = fp8ax.DelayedScaling(history_length=4, calibrate_first_call=True)
    assert first_call.planned_scale(first_call.plan(states[:1], dtypes[:1])[0]) is None
    with pytest.raises(ValueError, match=r"`dtypes` must give one format per state \(2\), got 1"):
        recipe.plan(states[:2], dtypes[:1])


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_the_gpus_stacked_read_of_the_states_trains_as_the_cpus(algo, getkey, monkeypatch):
    # Where the program is lowered for a GPU, `DelayedScaling.plan` stacks a call's states
    # before it reads them (`_read_stacked`); on CPU it reads them apart. Here both run on
    # CPU: three SGD steps of a `haliax.nn.Stacked` model (its states read inside the
    # scan, stacked over the layers outside it) and of an `eqx.filter_vmap` ensemble of
    # `eqx.nn.Linear` layers give the same model bit for bit.
    import haliax as hax

    from fp8ax._recipes import delayed
    from helpers import Deep, In, Out, mse, sgd_step

    config = fp8ax.Fp8Config(recipe=fp8ax.DelayedScaling(amax_compute_algo=algo))
    deep = fp8ax.fp8_linear_layers(Deep.init(key=getkey()), config)
    Batch = hax.Axis("batch", 8)
    xs = [hax.random.normal(getkey(), (Batch, In)) for _ in range(3)]
    ys = [hax.random.normal(getkey(), (Batch, Out)) for _ in range(3)]
    keys = jax.random.split(getkey(), 2)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.Linear(16, 16, key=k))(keys)
    ensemble = fp8ax.fp8_linear_layers(ensemble, config)
    x = jax.random.normal(getkey(), (4, 16))

    def ensemble_loss(m, x):
        return jnp.sum(eqx.filter_vmap(lambda layer: jax.vmap(layer)(x) ** 2)(m))

    def trained():
        jax.clear_caches()  # (the passes are traced once per signature)
        step, model = sgd_step(mse), deep
        for x_, y_ in zip(xs, ys):
            model = step(model, x_, y_)
        step, ens = sgd_step(ensemble_loss), ensemble
        for _ in range(3):
            ens = step(ens, x)
        return model, ens

    apart = trained()
    stacked = delayed._read_branches(algo != "max")[1]
    monkeypatch.setattr(delayed, "_read_branches", lambda newest: (stacked, stacked))
    together = trained()
    for got, want in zip(jax.tree.leaves(together), jax.tree.leaves(apart)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    written = [fp8ax.check_state(m, written=True) for m in together]
    assert written == [None, None]


class _SeededTensorwise(fp8ax.AbstractStatelessRecipe):
    """A recipe written outside fp8ax that rounds the output gradient stochastically: it
    declares `rounding_seed` and has no `seed` attribute (the interface asks for none)."""

    fwd_dtype: np.dtype = eqx.field(static=True)
    grad_dtype: np.dtype = eqx.field(static=True)
    stochastic_grads: bool = eqx.field(static=True)

    def __init__(self, stochastic_grads: bool):
        self.fwd_dtype = np.dtype(jnp.float8_e4m3fn)
        self.grad_dtype = np.dtype(jnp.float8_e5m2)
        self.stochastic_grads = stochastic_grads

    @property
    def scale_layout(self):
        return "tensor"

    def rounding_seed(self, role):
        return 7 if role == "grad" and self.stochastic_grads else None

    def quantize_role(self, x, contracting_axes, role, key=None):
        rounding = "nearest" if key is None else "stochastic"
        return fp8ax.CurrentScaling(grad_rounding=rounding).quantize_role(x, contracting_axes, role, key)


def test_a_recipe_declares_its_rounding_seed_and_the_pipeline_derives_the_keys(getkey):
    # The seam issue 37 found: the backward pass read an undeclared `recipe.seed`
    # (AttributeError). Now the pipeline asks `rounding_seed` and derives the keys.
    x = jax.random.normal(getkey(), (16, 32))
    w = jax.random.normal(getkey(), (32, 8))
    g = jax.random.normal(getkey(), (16, 8)) * 1e-3
    dims = (((1,), (0,)), ((), ()))

    @functools.partial(jax.jit, static_argnums=2)
    def grads(x, w, recipe_is_stochastic):
        dg = fp8ax.Fp8DotGeneral.init(_SeededTensorwise(recipe_is_stochastic))
        return jax.vjp(lambda x, w: dg(x, w, dims), x, w)[1](g)

    stochastic, nearest = grads(x, w, True), grads(x, w, False)
    assert _SeededTensorwise(True).stochastic("grad") and not _SeededTensorwise(False).stochastic("grad")
    # Stochastic rounding of the gradient changes the input and weight gradients
    # (reproducibly: the key comes from the seed and the gradient's contents).
    assert not np.array_equal(np.asarray(stochastic[0]), np.asarray(nearest[0]))
    np.testing.assert_array_equal(np.asarray(stochastic[0]), np.asarray(grads(x, w, True)[0]))


def test_overriding_stochastic_instead_of_rounding_seed_is_an_error():
    class _Old(_SeededTensorwise):
        def stochastic(self, role):
            return role == "grad"

    with pytest.raises(TypeError, match="overrides `stochastic`; define `rounding_seed"):
        _Old(True)


def test_a_stateless_recipe_quantizes_by_role():
    # Its one method is `quantize_role`; it has no stateful entry point (the state's
    # members are `AbstractStatefulRecipe`'s), and a role-less operand is refused with
    # the call to make instead (no format is read back into a role).
    x = jnp.ones((4, 8))
    recipe = fp8ax.MXScaling(4, "e4m3", "e5m2")
    for member in ("quantize_operand", "plan", "planned_scale", "state_observed", "serving_scale", "state_stats"):
        assert not hasattr(recipe, member), member
    assert recipe.init_state() is None and not recipe.stateful
    with pytest.raises(ValueError, match="`Operand.role` must be 'lhs', 'rhs' or 'grad'"):
        recipe.quantize_operands([fp8ax.Operand(x, (1,), recipe.grad_dtype)])
    # Told the role, MX picks the gradient's element type from it.
    ((q, _),) = recipe.quantize_operands([fp8ax.Operand(x, (1,), recipe.grad_dtype, role="grad")])
    assert q.values.dtype == jnp.float8_e5m2
    assert recipe.quantize_role(x, (1,), "lhs").values.dtype == jnp.float8_e4m3fn
