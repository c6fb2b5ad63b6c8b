"""Stochastic rounding against neighbours enumerated with ml_dtypes (an independent
implementation of the formats), and unbiasedness checked statistically."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8ax._rounding import stochastic_round

# (jax dtype, NumPy/ml_dtypes dtype, largest magnitude)
FORMATS = [
    (jnp.float8_e4m3fn, ml_dtypes.float8_e4m3fn, 448.0),
    (jnp.float8_e5m2, ml_dtypes.float8_e5m2, 57344.0),
    (jnp.float8_e4m3fnuz, ml_dtypes.float8_e4m3fnuz, 240.0),
    (jnp.float8_e5m2fnuz, ml_dtypes.float8_e5m2fnuz, 57344.0),
    (jnp.int8, np.int8, 127.0),
]
IDS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "int8"]

# Number of independent roundings averaged in the unbiasedness tests, and how many
# binomial standard errors the sample mean may be from x (5 sigma: a false alarm has
# probability ~6e-7 per value, so ~1e-3 over all values below; the data are seeded, so
# the outcome is deterministic anyway).
N_SAMPLES = 4096
N_SIGMA = 5.0

_round = jax.jit(stochastic_round, static_argnums=1)


def _representable(np_dtype) -> np.ndarray:
    """All finite representable values, sorted and unique, as float64."""
    if np_dtype == np.int8:
        return np.arange(-127, 128, dtype=np.float64)
    vals = np.arange(256, dtype=np.uint8).view(np_dtype).astype(np.float64)
    return np.unique(vals[np.isfinite(vals)])  # unique also merges -0 and 0


def _neighbours(x: np.ndarray, np_dtype, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """(below, above): the largest representable value <= x and the smallest >= x, after
    saturating x to [-bound, bound]; equal when x is representable."""
    grid = _representable(np_dtype)
    xs = np.clip(x.astype(np.float64), -bound, bound)
    below = grid[np.searchsorted(grid, xs, side="right") - 1]
    above = grid[np.searchsorted(grid, xs, side="left")]
    return below, above


def _test_values(np_dtype, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Values strictly between two representable neighbours, with fractions p in
    [0.05, 0.95], over the whole range: subnormals, below the smallest subnormal, the
    top binade near max, and both signs. Built in float64 and rounded to float32 (which
    keeps them strictly inside their interval)."""
    grid = _representable(np_dtype)
    pos = grid[grid >= 0]
    # Every interval [pos[i], pos[i + 1]] of positive neighbours: includes [0, tiny],
    # the subnormals, each binade boundary and [prev(max), max].
    lo = pos[:-1]
    hi = pos[1:]
    p = rng.uniform(0.05, 0.95, size=lo.shape)
    vals = lo + p * (hi - lo)
    signs = np.where(rng.uniform(size=lo.shape) < 0.5, -1.0, 1.0)
    return (signs * vals).astype(np.float32)


def _as_f64(q) -> np.ndarray:
    return np.asarray(q).astype(np.float64)


@pytest.mark.parametrize("jdtype,npdtype,bound", FORMATS, ids=IDS)
def test_outputs_are_neighbours(jdtype, npdtype, bound, getkey):
    rng = np.random.default_rng(0)
    # Random values spanning every binade, both signs, plus values beyond max, plus
    # values of the grid itself and midpoints between grid values.
    grid = _representable(npdtype)
    logs = rng.uniform(np.log2(bound) - 40, np.log2(bound) + 2, size=4096)
    rand = np.where(rng.uniform(size=4096) < 0.5, -1.0, 1.0) * 2.0**logs
    mids = (grid[:-1] + grid[1:]) / 2
    x = np.concatenate([rand, grid, mids, _test_values(npdtype, bound, rng)]).astype(np.float32)
    below, above = _neighbours(x, npdtype, bound)
    q = _round(jnp.asarray(x), np.dtype(jdtype), getkey())
    assert q.dtype == np.dtype(jdtype) and q.shape == x.shape
    got = _as_f64(q)
    assert np.all((got == below) | (got == above))
    # Representable values (and saturated ones) come back exactly.
    np.testing.assert_array_equal(got[below == above], below[below == above])
    # The sign is kept (away from zero results).
    nonzero = got != 0
    assert np.all(np.sign(got[nonzero]) == np.sign(x[nonzero]))


@pytest.mark.parametrize("jdtype,npdtype,bound", FORMATS, ids=IDS)
def test_unbiased(jdtype, npdtype, bound, getkey):
    rng = np.random.default_rng(1)
    x = _test_values(npdtype, bound, rng)
    x = np.concatenate([x, _representable(npdtype).astype(np.float32)])
    keys = jax.random.split(getkey(), N_SAMPLES)
    q = jax.jit(jax.vmap(stochastic_round, in_axes=(None, None, 0)), static_argnums=1)(
        jnp.asarray(x), np.dtype(jdtype), keys
    )
    samples = _as_f64(q)  # (N_SAMPLES, n)
    below, above = _neighbours(x, npdtype, bound)
    x64 = x.astype(np.float64)
    width = above - below
    p = np.divide(x64 - below, width, out=np.zeros_like(x64), where=width > 0)
    # Each sample is below + width * Bernoulli(p): the mean has standard error
    # width * sqrt(p (1 - p) / N). With p in [0.05, 0.95], N p (1 - p) >= 194, so the
    # normal approximation behind the 5 sigma bound is accurate.
    stderr = width * np.sqrt(p * (1 - p) / N_SAMPLES)
    mean = samples.mean(axis=0)
    assert np.all(np.abs(mean - x64) <= N_SIGMA * stderr), np.max(np.abs(mean - x64) / np.maximum(stderr, 1e-300))
    # Representable values: zero variance, the mean is exact.
    np.testing.assert_array_equal(mean[width == 0], x64[width == 0])
    # Aggregate checks, sensitive to a small systematic bias in the probabilities: the
    # total count of "events" over all values, with per-value probability q, has mean
    # sum(N q) and variance sum(N q (1 - q)); its z-score must be within 5. Events are
    # rounding up (towards +inf; q = p) and rounding away from zero (q = p for x > 0,
    # 1 - p for x < 0): a bias in the magnitude cancels in the first, a bias towards
    # one direction in the second.
    inexact = width > 0
    toward_zero = np.where(x64 >= 0, below, above)
    p_away = np.where(x64 >= 0, p, 1 - p)
    for events, q in (
        (samples == above, p),
        (samples != toward_zero, p_away),
    ):
        count = events.sum(axis=0)[inexact].sum()
        q = q[inexact]
        z = (count - N_SAMPLES * q.sum()) / np.sqrt(N_SAMPLES * (q * (1 - q)).sum())
        assert abs(z) <= N_SIGMA, z


@pytest.mark.parametrize("jdtype,npdtype,bound", FORMATS, ids=IDS)
def test_small_probabilities(jdtype, npdtype, bound, getkey):
    # Fractions p = 2**-k just above lo: the round-up probability must still be p (not
    # quantized to 2**-23 or to 0). Over N * n draws the count of round-ups is
    # Binomial(N n, p) ~ Poisson; check it within 5 sigma of N n p.
    grid = _representable(npdtype)
    pos = grid[grid >= 0]
    lo, hi = pos[:-1], pos[1:]
    for k in (6, 10):
        x = (lo + 2.0**-k * (hi - lo)).astype(np.float32)
        assert np.all(x > lo)  # exactly representable in float32
        q = _as_f64(_round(jnp.broadcast_to(jnp.asarray(x), (512, x.size)), np.dtype(jdtype), getkey()))
        n = q.size
        ups = int((q != lo).sum())
        mean, sd = n * 2.0**-k, np.sqrt(n * 2.0**-k * (1 - 2.0**-k))
        assert abs(ups - mean) <= N_SIGMA * sd, (k, ups, mean, sd)


@pytest.mark.parametrize("jdtype,npdtype,bound", FORMATS, ids=IDS)
def test_saturation_and_non_finite(jdtype, npdtype, bound, getkey):
    x = jnp.array([bound * 1.0001, -bound * 1.5, 1e30, -1e30, bound, -bound, jnp.nan, jnp.inf, -jnp.inf], jnp.float32)
    q = _as_f64(_round(x, np.dtype(jdtype), getkey()))
    np.testing.assert_array_equal(q[:6], [bound, -bound, bound, -bound, bound, -bound])
    if np.dtype(jdtype) == np.dtype(jnp.int8):
        # int8 has no NaN or inf: inf saturates, NaN becomes 0 (documented).
        np.testing.assert_array_equal(q[6:], [0, bound, -bound])
    else:
        assert np.isnan(q[6])
        assert not np.isfinite(q[7]) and not np.isfinite(q[8])
        if np.dtype(jdtype) == np.dtype(jnp.float8_e5m2):
            assert q[7] == np.inf and q[8] == -np.inf


@pytest.mark.parametrize("jdtype,npdtype,bound", FORMATS, ids=IDS)
def test_keys(jdtype, npdtype, bound, getkey):
    x = jnp.asarray(_test_values(npdtype, bound, np.random.default_rng(2)))
    dtype = np.dtype(jdtype)
    key1, key2 = getkey(), getkey()
    a = _as_f64(_round(x, dtype, key1))
    b = _as_f64(_round(x, dtype, key1))
    c = _as_f64(_round(x, dtype, key2))
    np.testing.assert_array_equal(a, b)
    # With p in [0.05, 0.95] for each of >= 100 values, two keys agreeing everywhere has
    # probability < 0.905**100 ~ 5e-5.
    assert x.size >= 100 and np.any(a != c)
    # Eager (no jit) gives the same as jit; a legacy uint32 key works too.
    np.testing.assert_array_equal(_as_f64(stochastic_round(x, dtype, key1)), a)
    assert stochastic_round(x, dtype, jax.random.PRNGKey(0)).dtype == dtype


def test_vmap_matches_loop(getkey):
    dtype = np.dtype(jnp.float8_e4m3fn)
    x = jax.random.normal(getkey(), (3, 64), jnp.float32) * 10
    keys = jax.random.split(getkey(), 3)
    batched = jax.vmap(functools.partial(stochastic_round, dtype=dtype))(x, key=keys)
    looped = jnp.stack([stochastic_round(x[i], dtype, keys[i]) for i in range(3)])
    np.testing.assert_array_equal(_as_f64(batched), _as_f64(looped))


def test_bf16_input(getkey):
    x = jax.random.normal(getkey(), (256,), jnp.float32).astype(jnp.bfloat16)
    key = getkey()
    dtype = np.dtype(jnp.float8_e5m2)
    np.testing.assert_array_equal(
        _as_f64(stochastic_round(x, dtype, key)), _as_f64(stochastic_round(x.astype(jnp.float32), dtype, key))
    )


def test_rejects_bad_arguments(getkey):
    x = jnp.ones((4,), jnp.float32)
    for bad in (jnp.bfloat16, jnp.float32, jnp.uint8, "nonsense", None):
        with pytest.raises(TypeError, match="`dtype` must be one of"):
            stochastic_round(x, bad, getkey())
    with pytest.raises(TypeError, match="`x` must be a floating-point array"):
        stochastic_round(jnp.ones((4,), jnp.int32), jnp.int8, getkey())
