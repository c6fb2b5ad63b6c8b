"""Invariants of FP8 training checked on the platform that runs them, for XLA:GPU.

Every test here is marked `gpu` and is an ordinary test: it runs on the CPU in CI, in a
few seconds. On a machine with a GPU, run the selection there (README.md's paragraph on
the tests):

    python -m pytest -q -m gpu -n 0

One process (`-n 0`): a single GPU, and each program is compiled (and its GEMMs
autotuned) once, in the process that runs every test. Several xdist workers would each
compile their own copies and share the one device; tests/conftest.py keeps JAX from
preallocating 75% of GPU memory per process, so that a plain `pytest -q` on a GPU
machine works too. The file compiles about 10 programs at 16 to 128 features (2 casts,
2 initializations, 1 train step, which `gemm_report` may compile once more, 4 for the
reuse checks) and a few one-op ones, so that GEMM autotuning keeps the selection to a few
minutes.

Each check has an independent reference: `ml_dtypes` casting, a float64 NumPy replay of
the delayed-scaling maths, or a NumPy amax of the data. On XLA:GPU they check what the
CPU emulation promises: the convert, the FP8 GEMMs, the max-merge of a reused layer and
the state updates as XLA:GPU compiles them.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
import pytest

import fp8ax
from _reuse import BOUNDARIES, ENTRIES, D, N, concatenated_reference
from fp8ax import _formats

E4M3 = (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0)
E5M2 = (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0)
ROLES = ("lhs", "rhs", "grad")


# ----------------------------------------------------------------------------------------
# The reference: fp8ax's documented scaling maths, in NumPy.


def _ref_factor(bound: float) -> np.float32:
    # `2**margin / fp8_max` (margin 0), computed in float64 and rounded to float32 once.
    return np.float32(np.float64(1.0) / bound)


def _ref_delayed_scale(history: np.ndarray, bound: float) -> np.float32:
    """The scale a call uses from a valid, non-empty history (`amax_compute_algo="max"`):
    `max(history) / fp8_max` as one float32 multiply, at least the smallest normal float32."""
    return np.maximum(np.float32(np.max(history)) * _ref_factor(bound), np.float32(2.0**-126))


def _ref_cast(x, scale, ml_dtype, bound: float) -> np.ndarray:
    """`clip(x / scale, -max, max)` rounded to nearest even in `ml_dtype`; the division is
    `x * (1 / scale)` in float32, as fp8ax documents it (`_formats.quantize`)."""
    inv = np.float32(1.0) / np.float32(scale)
    return np.clip(np.asarray(x, np.float32) * inv, -bound, bound).astype(ml_dtype)


def _ref_dequantized(x, scale, ml_dtype, bound: float) -> np.ndarray:
    return _ref_cast(x, scale, ml_dtype, bound).astype(np.float64) * np.float64(scale)


def _amax(x) -> np.float32:
    return np.float32(np.max(np.abs(np.asarray(x, np.float32))))


def _history(*front: float, length: int = 1024) -> np.ndarray:
    h = np.zeros(length, np.float32)
    h[: len(front)] = front
    return h


def _set_state(layer, states: dict):
    """`layer` (an `fp8ax.Fp8Linear`) with its FP8 state replaced: `states` maps each of
    "lhs", "rhs", "grad" to `(scale, amax history)`."""
    dg = layer.dot_general
    new = [
        fp8ax.ScalingState(jnp.asarray(s, jnp.float32), jnp.asarray(h, jnp.float32))
        for s, h in (states[r] for r in ROLES)
    ]
    return eqx.tree_at(lambda m: m.dot_general, layer, fp8ax.Fp8DotGeneral(tuple(new), dg.settings))


def _state(layer) -> dict:
    """`{role: (scale, history)}` of an `fp8ax.Fp8Linear`, as NumPy arrays."""
    dg = layer.dot_general
    return {r: (np.asarray(getattr(dg, r).scale), np.asarray(getattr(dg, r).amax_history)) for r in ROLES}


def _fp8_leaves(tree) -> dict:
    """`{path: array}` of every FP8 state leaf of a model or of its gradient."""
    overwrite, _ = fp8ax.partition_for_grad_overwrite(tree)
    return {jtu.keystr(p): np.asarray(v) for p, v in jtu.tree_leaves_with_path(eqx.filter(overwrite, eqx.is_array))}


def _bits_equal(got, want, what: str):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_array_equal(np.atleast_1d(got).view(np.uint8), np.atleast_1d(want).view(np.uint8), err_msg=what)


# ----------------------------------------------------------------------------------------
# Casts: XLA's convert against ml_dtypes, bit for bit.


def _cast_values(ml_dtype) -> np.ndarray:
    """Values in the scaled domain (`x / scale`) that probe a format's rounding: every
    finite positive value of the format (subnormals included), every midpoint between
    neighbours (a tie: rounds to the even one), values just beside them, the
    smallest subnormal halved (a tie with 0) and below, the largest value and the ties
    beyond it (which saturate), 0 and -0.0, and the negatives of all of them. Every one
    is exact in float32 and bfloat16 except the neighbours of the midpoints, which
    `_neighbours` adds per input dtype."""
    info = ml_dtypes.finfo(ml_dtype)
    grid = np.arange(256, dtype=np.uint8).view(ml_dtype).astype(np.float64)
    grid = np.unique(grid[np.isfinite(grid) & (grid > 0)])
    top = float(info.max)
    step_at_top = top - grid[-2]
    tiny = float(info.smallest_subnormal)
    pos = np.concatenate(
        [
            grid,
            (grid[:-1] + grid[1:]) / 2,  # ties
            [tiny / 2, tiny / 4, tiny * 1.5, tiny * 2.5],  # subnormal ties and below
            [top + step_at_top / 2, top + step_at_top, top * 4],  # beyond the max: saturate
        ]
    )
    return np.concatenate([pos, -pos, [0.0, -0.0]]).astype(np.float32)


def _neighbours(x: np.ndarray, dtype) -> np.ndarray:
    """`x` in `dtype`, with the next value above and below each (by one unit in the last
    place of `dtype`, so just beside every tie)."""
    x = x.astype(dtype)
    bits = x.view(np.uint32 if dtype == np.float32 else np.uint16)
    nonzero = x != 0
    up, down = bits[nonzero] + 1, bits[nonzero] - 1
    return np.concatenate([x, up.view(dtype), down.view(dtype)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_casts_equal_ml_dtypes_bit_for_bit(dtype):
    # `fp8ax.quantize` with a tensor-wise scale (`CurrentScaling(power_of_two=True)`: a
    # power of two from the amax, so `x / scale` is exact and the ties land where
    # `_cast_values` put them) to E4M3 (forward) and E5M2 (`grad=True`); and the cast of
    # the GEMM pipeline with a fixed scale, where values beyond the format's maximum
    # saturate. All in one program per input dtype. Tolerance: none; every element bit
    # for bit (so -0.0 is told from 0), NaN where the input is not finite.
    recipe = fp8ax.CurrentScaling(power_of_two=True)
    x4 = _neighbours(_cast_values(ml_dtypes.float8_e4m3fn) * np.float32(2.0**-5), dtype)
    x5 = _neighbours(_cast_values(ml_dtypes.float8_e5m2) * np.float32(2.0**3), dtype)
    # For the tensor scale: values within the format's range, times 2**k (amax = max * 2**k).
    x4_in = x4[np.abs(x4.astype(np.float32)) <= 448.0 * 2.0**-5]
    x5_in = x5[np.abs(x5.astype(np.float32)) <= 57344.0 * 2.0**3]
    special = np.array([np.nan, np.inf, -np.inf], np.float32).astype(dtype)
    x4_all, x5_all = np.concatenate([x4, special]), np.concatenate([x5, special])

    @jax.jit
    def casts(x4_in, x5_in, x4_all, x5_all, fixed):
        q4 = fp8ax.quantize(x4_in, recipe)
        q5 = fp8ax.quantize(x5_in, recipe, grad=True)
        return (
            (q4.values, q4.scale),
            (q5.values, q5.scale),
            _formats.quantize(x4_all, fixed, np.dtype(E4M3[0])),
            _formats.quantize(x5_all, fixed, np.dtype(E5M2[0])),
        )

    for fixed in (np.float32(2.0**-5), np.float32(3.7e-3)):  # exact, and a scale with a rounded reciprocal
        (v4, s4), (v5, s5), f4, f5 = casts(x4_in, x5_in, x4_all, x5_all, jnp.float32(fixed))
        for (values, scale), x, (jdtype, mldtype, bound), k in ((v4, s4), x4_in, E4M3, -5), ((v5, s5), x5_in, E5M2, 3):
            assert values.dtype == jdtype
            # The scale the recipe documents: amax / max rounded up to a power of two, here 2**k.
            assert float(scale) == 2.0**k, (mldtype, float(scale))
            want = _ref_cast(x.astype(np.float32), np.float32(scale), mldtype, bound)
            _bits_equal(values, want, f"quantize to {mldtype}")
        for got, x, (jdtype, mldtype, bound) in ((f4, x4_all, E4M3), (f5, x5_all, E5M2)):
            finite = np.isfinite(x.astype(np.float32))
            got = np.asarray(got)
            assert np.isnan(got[~finite].astype(np.float32)).all(), (mldtype, got[~finite])
            want = _ref_cast(x[finite].astype(np.float32), fixed, mldtype, bound)
            _bits_equal(got[finite], want, f"cast to {mldtype} with scale {fixed}")
            if fixed == np.float32(2.0**-5) and mldtype is ml_dtypes.float8_e4m3fn:
                # The probes are there: ties, saturation, -0.0 (the checks above are not vacuous).
                assert np.sum(np.abs(want.astype(np.float32)) == bound) > 4
                assert np.any(np.signbit(want.astype(np.float32)) & (want.astype(np.float32) == 0))


# ----------------------------------------------------------------------------------------
# A layer used twice in one loss, behind jax.jit, jax.checkpoint and lax.scan.

REUSE_ENTRY = "eqx_linear"  # an `eqx.nn.Linear` converted with `fp8ax.fp8_linear_layers`, vmapped (tests/_reuse.py)
REUSE_OLD = {  # a state that delayed scaling uses as it is: non-empty, its max not at the front
    "lhs": (1.0, _history(2.0, 9.0, 4.0)),
    "rhs": (1.0, _history(0.5, 1.5)),
    "grad": (1.0, _history(3.0, 11.0)),
}


@pytest.fixture(scope="module")
def reuse_model():
    # Built in one jitted program (eagerly, each random op would compile one of its own).
    make = ENTRIES[REUSE_ENTRY].make
    used, spare = eqx.filter_jit(lambda key: [make(k) for k in jax.random.split(key)])(jax.random.key(11))
    return {"used": _set_state(used, REUSE_OLD), "spare": _set_state(spare, REUSE_OLD)}


def _reuse_data(nan: bool) -> dict:
    # As `_reuse.data_for`, from NumPy (no program to compile): the second input sets the
    # input's amax, the first output gradient the gradient's. With `nan`, one NaN in each
    # half of the first input (under `lax.scan`, in each of its two uses).
    rng = np.random.default_rng(0)
    d = {
        k: (c * rng.standard_normal((N, D))).astype(np.float32) for k, c in (("x1", 1), ("x2", 5), ("g1", 3), ("g2", 1))
    }
    if nan:
        d["x1"][0, 0] = d["x1"][N // 2 + 1, 3] = np.nan
    return d


def _twice_step(boundary: str):
    f = BOUNDARIES[boundary].wrap(ENTRIES[REUSE_ENTRY].use)

    @eqx.filter_jit
    def step(model, x1, x2, g1, g2):
        def loss(m):
            return jnp.sum(f(m["used"], x1) * g1) + jnp.sum(f(m["used"], x2) * g2)

        return eqx.filter_grad(loss)(model)

    return step


@pytest.mark.gpu
@pytest.mark.parametrize("boundary", ["jax.jit", "jax.checkpoint", "lax.scan"])
def test_reuse_merges_by_max(boundary, reuse_model):
    # Under `lax.scan` the layer is used on the two halves of each input (four uses).
    step = _twice_step(boundary)
    weight = np.asarray(reuse_model["used"].weight)
    for nan in (False, True):
        d = _reuse_data(nan)
        grads = step(reuse_model, d["x1"], d["x2"], d["g1"], d["g2"])
        new = _state(grads["used"])
        # Independent reference: the amaxes of the data, in NumPy. The use that sees a NaN
        # (x1 holds one, in each half) observes nothing for its input.
        x1 = np.asarray(d["x1"])
        want_front = {
            "lhs": _amax(d["x2"]) if nan else max(_amax(x1), _amax(d["x2"])),
            "rhs": _amax(weight),  # both uses see the same weight: a sum would double it
            "grad": max(_amax(d["g1"]), _amax(d["g2"])),  # d(loss)/d(output) of each use is its g
        }
        for r in ROLES:
            scale, history = new[r]
            what = f"{boundary}, {r}{', NaN input' if nan else ''}"
            bound = E5M2[2] if r == "grad" else E4M3[2]
            # Exact: a max of float32 amaxes, and one float32 multiply (no tolerance).
            assert history[0] == want_front[r], (what, history[0], want_front[r])
            _bits_equal(history[1:], REUSE_OLD[r][1][:-1], f"{what}: history shifted once per step")
            _bits_equal(scale, _ref_delayed_scale(REUSE_OLD[r][1], bound), f"{what}: scale from the old history")
        if not nan:
            # The whole state, bit for bit: one use of the layer on both inputs at once.
            uses = [(d["x1"], d["g1"]), (d["x2"], d["g2"])]
            want = concatenated_reference(REUSE_ENTRY, reuse_model, uses)
            got = _fp8_leaves(grads)
            assert got.keys() == want.keys()
            for k in want:
                _bits_equal(got[k], want[k], f"{boundary}: {k} vs one use on the concatenated inputs")
        # The unused layer's state "gradient" is zero (`apply_updates` then keeps its state).
        assert not any(np.any(v) for v in _fp8_leaves(grads["spare"]).values())


# ----------------------------------------------------------------------------------------
# One jitted train step of a converted `eqx.nn.MLP` (64 -> 128 -> 64) and an unused layer.

BATCH, IN, WIDTH, OUT = 32, 64, 128, 64
LR = 1e-2


@eqx.filter_jit
def _train_step(model, x, g):
    def loss(m):
        y = jax.vmap(m["mlp"])(x)
        return jnp.sum(y * g), y  # d(loss)/dy = g, exactly

    grads, y = eqx.filter_grad(loss, has_aux=True)(model)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates = jax.tree.map(lambda u: -LR * u, grads)
    return fp8ax.apply_updates(model, updates, overwrite), overwrite, y


def _plain_amaxes(mlp, x, g) -> list[dict]:
    """Rough amaxes of each layer's tensors, from a float64 step without FP8 (to choose
    the starting histories)."""
    (w1, b1), (w2, _) = ((np.asarray(lay.weight, np.float64), np.asarray(lay.bias, np.float64)) for lay in mlp.layers)
    pre = x @ w1.T + b1
    dh = (g @ w2) * (pre > 0)
    return [
        {"lhs": np.abs(x).max(), "rhs": np.abs(w1).max(), "grad": np.abs(dh).max()},
        {"lhs": np.maximum(pre, 0).max(), "rhs": np.abs(w2).max(), "grad": np.abs(g).max()},
    ]


@pytest.fixture(scope="module")
def mlp_run():
    """A converted MLP and a spare converted layer, with hand-set delayed-scaling state;
    the step on clean data, and on data holding NaNs (the same compiled program)."""

    @eqx.filter_jit  # one program for the initialization (eagerly, one per random op)
    def init(key):
        k1, k2 = jax.random.split(key)
        return {"mlp": eqx.nn.MLP(IN, OUT, WIDTH, 1, key=k1), "spare": eqx.nn.Linear(IN, OUT, key=k2)}

    plain = init(jax.random.key(5))
    rng = np.random.default_rng(5)
    x = (2 * rng.standard_normal((BATCH, IN))).astype(np.float32)
    g = (0.5 * rng.standard_normal((BATCH, OUT))).astype(np.float32)
    model = fp8ax.fp8_linear_layers(plain)
    rough = _plain_amaxes(plain["mlp"], x, g)
    layers = []
    for i, lay in enumerate(model["mlp"].layers):
        # Max not at the front (`amax_compute_algo="max"` reads all of it); the stored
        # scale 1 is ignored by delayed scaling (it is the scale the last call used).
        states = {r: (1.0, _history(0.6 * a, 1.25 * a, 0.2 * a)) for r, a in rough[i].items()}
        if i == 0:
            # The first input's history is half its amax: the cast saturates the top values.
            states["lhs"] = (1.0, _history(0.3 * rough[0]["lhs"], 0.5 * rough[0]["lhs"]))
        layers.append(_set_state(lay, states))
    model = eqx.tree_at(lambda m: m["mlp"].layers, model, tuple(layers))
    spare_state = {"lhs": (0.02, _history(3.0, 7.0, 1.0)), "rhs": (0.5, _history(0.1)), "grad": (4.0, _history(9.0))}
    model["spare"] = _set_state(model["spare"], spare_state)

    x_nan, g_nan = x.copy(), g.copy()
    x_nan[0, 0] = np.nan  # layer 0's input, and (through it) layer 1's input, in row 0
    g_nan[1, 0] = np.nan  # layer 1's output gradient, and (through it) layer 0's, in row 1
    return {
        "model": model,
        "x": x,
        "g": g,
        "clean": _train_step(model, jnp.asarray(x), jnp.asarray(g)),
        "nan": _train_step(model, jnp.asarray(x_nan), jnp.asarray(g_nan)),
    }


@pytest.mark.gpu
def test_train_step_state_equals_hand_replay(mlp_run):
    model, x, g = mlp_run["model"], mlp_run["x"], mlp_run["g"]
    new_model, _, _ = mlp_run["clean"]
    old = [_state(lay) for lay in model["mlp"].layers]
    new = [_state(lay) for lay in new_model["mlp"].layers]
    (w1, b1), (w2, _) = ((np.asarray(lay.weight), np.asarray(lay.bias, np.float64)) for lay in model["mlp"].layers)

    # The replay: each tensor is cast with the scale its old history gives; the GEMMs are
    # exact float64 products of the cast values, times both scales.
    s = [{r: _ref_delayed_scale(old[i][r][1], E5M2[2] if r == "grad" else E4M3[2]) for r in ROLES} for i in (0, 1)]
    fwd, bwd = E4M3[1:], E5M2[1:]  # (ml_dtypes format, its max)
    pre1 = _ref_dequantized(x, s[0]["lhs"], *fwd) @ _ref_dequantized(w1, s[0]["rhs"], *fwd).T + b1
    h1 = np.maximum(pre1, 0)
    w2q = _ref_dequantized(w2, s[1]["rhs"], *fwd)
    gq = _ref_dequantized(g, s[1]["grad"], *bwd)
    dpre1 = (gq @ w2q) * (pre1 > 0)  # input gradient of layer 1 (FP8 GEMM), through the relu
    observed = [
        {"lhs": _amax(x), "rhs": _amax(w1), "grad": np.abs(dpre1).max()},
        {"lhs": h1.max(), "rhs": _amax(w2), "grad": _amax(g)},
    ]
    assert np.abs(x).max() > 1.9 * np.float32(old[0]["lhs"][1].max())  # the first cast did saturate

    # Tolerance. Exact (bit for bit): every scale (one float32 multiply of an old history's
    # max), the shifted history, and the amaxes of the step's own arguments (x, g, the
    # weights). The two amaxes that come out of an FP8 GEMM (layer 1's input, layer 0's
    # output gradient) differ from the float64 replay by the GEMM's float32 accumulation:
    # XLA:CPU sums K <= 128 exact products in float32 (a relative error of at most about
    # K * 2**-24, 1e-5; 4e-8 measured); XLA:GPU may run the forward GEMM with Hopper's
    # fast FP8 accumulation, which precision DEFAULT allows (partial sums keep about 13
    # bits, about 1e-4 of the result here). Skipping the saturation instead changes the
    # first of them by 2%.
    rtol = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    for i in (0, 1):
        for r in ROLES:
            what = f"layer {i} {r}"
            scale, history = new[i][r]
            _bits_equal(scale, s[i][r], f"{what}: the scale of the step is max(old history) / fp8_max")
            _bits_equal(history[1:], old[i][r][1][:-1], f"{what}: the history shifts by one")
            want = observed[i][r]
            if (i, r) in ((0, "grad"), (1, "lhs")):
                np.testing.assert_allclose(history[0], want, rtol=rtol, err_msg=f"{what}: new amax at index 0")
            else:
                assert history[0] == want, (what, history[0], want)
    # The spare was left as it was (its own test checks how).
    for r in ROLES:
        for got, want in zip(_state(new_model["spare"])[r], _state(model["spare"])[r]):
            _bits_equal(got, want, f"spare {r}")


@pytest.mark.gpu
def test_nan_never_enters_the_state(mlp_run):
    model = mlp_run["model"]
    clean, _, _ = mlp_run["clean"]
    new_model, _, y = mlp_run["nan"]
    y = np.asarray(y)
    # The NaN shows in the output, as it would without FP8 (row 0: the NaN input).
    assert np.isnan(y[0]).all() and np.isfinite(y[1:]).all()
    for i, (old, nan_step, clean_step) in enumerate(
        zip(model["mlp"].layers, new_model["mlp"].layers, clean["mlp"].layers)
    ):
        old, nan_step, clean_step = _state(old), _state(nan_step), _state(clean_step)
        for r in ROLES:
            # Every input and output gradient held a NaN (layer 0's output gradient in
            # row 1, where the relu passes layer 1's NaN input gradient on): its state
            # stays exactly as it was. The weights are finite: their state is what the
            # clean step wrote.
            want = clean_step[r] if r == "rhs" else old[r]
            for got, w, field in zip(nan_step[r], want, ("scale", "amax_history")):
                assert np.isfinite(got).all(), (i, r, field, got)
                _bits_equal(got, w, f"layer {i} {r}.{field} after a step on NaN data")


@pytest.mark.gpu
def test_unused_layer_keeps_its_state(mlp_run):
    # Nothing calls "spare": its state "gradient" is zero, which
    # `partition_for_grad_overwrite` puts in the overwrite and `apply_updates` must not write.
    model = mlp_run["model"]
    for step in ("clean", "nan"):
        new_model, overwrite, _ = mlp_run[step]
        zeros = _fp8_leaves(overwrite["spare"])
        assert zeros and not any(np.any(v) for v in zeros.values()), zeros
        before, after = _fp8_leaves(model["spare"]), _fp8_leaves(new_model["spare"])
        assert before.keys() == after.keys() == zeros.keys()
        assert all(np.any(v) for v in before.values())  # a state that zeros would change
        for k in before:
            _bits_equal(after[k], before[k], f"spare {k} after a {step} step")


@pytest.mark.gpu
def test_train_step_gemms_are_fp8(mlp_run):
    report = fp8ax.gemm_report(_train_step, mlp_run["model"], jnp.asarray(mlp_run["x"]), jnp.asarray(mlp_run["g"]))
    ours = [gemm for gemm in report.lowered if gemm.fp8ax]
    # 2 layers x (forward + 2 gradient GEMMs), less the first layer's input gradient.
    assert len(ours) == 5 and report.lowered_converted_all_fp8, report
    if jax.default_backend() != "gpu":
        return  # XLA:CPU has no FP8 GEMM: it upcasts (`report.compiled_fp8` is 0)
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None or tuple(int(p) for p in str(cc).split(".")[:2]) < (8, 9):
        pytest.skip(f"this GPU (compute capability {cc}) has no FP8 GEMM; an H100 (9.0) or later has")
    assert report.converted_all_fp8, report
