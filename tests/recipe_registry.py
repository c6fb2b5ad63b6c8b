"""The one list of recipes that every recipe-generic test runs over.

A new recipe is tested by adding an entry here: `tests/test_recipe_conformance.py`
checks its quantization and its three GEMMs against the entry's independent NumPy
reference, its behavior under jit/scan/vmap, in a stacked Haliax model, through a
checkpoint and per example; `tests/test_serving.py` serves it bit for bit;
`tests/test_training.py` trains it against bf16; `tests/test_sharding.py` trains it on 8
CPU devices against one.

A reference takes `(x, contracting_axes, role)` (`x` a float32 NumPy array, role
`"lhs"`, `"rhs"` or `"grad"`) and returns `x` quantized and dequantized, in float64,
computed without fp8ax: ml_dtypes rounds, NumPy does the arithmetic.
"""

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np

import fp8ax
from running_max import RunningMaxScaling
from test_blockwise import reference_quantize as _blockwise_tiles
from test_mx import _reference as _mx_reference
from test_nvfp4 import dequantized as _nvfp4_dequantized

_F32_TINY = np.float32(2.0**-126)


def _pow2_up(s):
    m, e = np.frexp(s)
    return np.where(m == 0.5, s, np.ldexp(np.float32(1), e).astype(np.float32)).astype(np.float32)


def _fp8_cast(x, scale, mldtype):
    """x * (1 / scale) in float32, clipped to the format's range, rounded by ml_dtypes;
    dequantized in float64."""
    bound = float(ml_dtypes.finfo(mldtype).max)
    inv = (np.float32(1) / scale.astype(np.float32)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip((x.astype(np.float32) * inv).astype(np.float32), -bound, bound)
    return y.astype(mldtype).astype(np.float64) * scale.astype(np.float64)


def _amax(x, axes):
    with np.errstate(invalid="ignore"):
        a = np.max(np.abs(x), axis=axes, keepdims=True).astype(np.float32)
    return np.where(np.isnan(x).any(axis=axes, keepdims=True), np.float32(np.nan), a)


def current_reference(granularity="tensor", power_of_two=False, fwd=ml_dtypes.float8_e4m3fn, grad=None):
    grad = ml_dtypes.float8_e5m2 if grad is None else grad

    def ref(x, axes, role):
        mldtype = grad if role == "grad" else fwd
        bound = np.float32(float(ml_dtypes.finfo(mldtype).max))
        red = tuple(range(x.ndim)) if granularity == "tensor" else tuple(axes)
        amax = _amax(x, red)
        with np.errstate(invalid="ignore", over="ignore"):
            scale = np.maximum((amax * (np.float32(1) / bound)).astype(np.float32), _F32_TINY)
        if power_of_two:
            scale = _pow2_up(scale)
        scale = np.where(np.isfinite(amax) & (amax > 0), scale, np.float32(1))
        return _fp8_cast(x, scale, mldtype)

    return ref


def delayed_first_call_reference(margin=0):
    """A fresh layer's first call: calibrated on the tensor's amax, scale
    `amax * float32(2**margin / max)` (one float32 multiply), at least 2**-126."""

    def ref(x, axes, role):
        del axes
        mldtype = ml_dtypes.float8_e5m2 if role == "grad" else ml_dtypes.float8_e4m3fn
        factor = np.float32(2.0**margin / float(ml_dtypes.finfo(mldtype).max))
        amax = _amax(x, tuple(range(x.ndim)))
        with np.errstate(invalid="ignore", over="ignore"):
            scale = np.maximum((amax * factor).astype(np.float32), _F32_TINY)
        scale = np.where(np.isfinite(amax) & (amax > 0) & np.isfinite(scale), scale, np.float32(1))
        return _fp8_cast(x, scale, mldtype)

    return ref


def int8_reference(x, axes, role):
    del role
    amax = np.max(np.abs(x.astype(np.float32)), axis=tuple(axes), keepdims=True)
    nonzero = amax >= np.float32(127 * np.finfo(np.float32).tiny)
    inv = np.float32(127) / np.where(nonzero, amax, np.float32(127))
    scale = np.where(nonzero, np.maximum((amax * np.float32(1 / 127)).astype(np.float32), _F32_TINY), np.float32(1))
    k = np.clip(np.round((x.astype(np.float32) * inv).astype(np.float32)), -127, 127)
    return k.astype(np.float64) * scale.astype(np.float64)


def mx_reference(block_size=32, fwd="e4m3", grad="e5m2", rule="floor"):
    def ref(x, axes, role):
        if x.ndim == 0:
            return ref(x[None], (0,), role)[0]
        axis = max(axes) if axes else x.ndim - 1
        return _mx_reference(x, axis, grad if role == "grad" else fwd, block_size, rule)[2]

    return ref


def blockwise_reference(tile=128, power_of_two=False):
    recipe = fp8ax.BlockwiseScaling(tile)

    def ref(x, axes, role):
        t = recipe.tile_for(x.shape, axes, role)  # which tile; the numbers are the reference's
        values, scales = _blockwise_tiles(x, t, power_of_two)
        for d, k in enumerate(t):
            scales = np.repeat(scales, k, axis=d)
        return values.astype(np.float64) * scales[tuple(slice(0, n) for n in x.shape)]

    return ref


def nvfp4_reference(recipe):
    def ref(x, axes, role):
        if x.ndim == 0:
            return ref(x[None], (0,), role)[0]
        return _nvfp4_dequantized(x, recipe.tile_for(x.shape, axes, role))  # the tile is the recipe's

    return ref


_NVFP4_RN = fp8ax.NVFP4Scaling(two_d_weights=False, hadamard=False, stochastic_gradients=False)


@dataclasses.dataclass(frozen=True)
class Entry:
    recipe: fp8ax.AbstractScalingRecipe
    reference: Callable  # of the roles it rounds to nearest (`recipe.stochastic(role)` is False)
    train_tolerance: float  # held-out loss gap to bf16 allowed after 300 steps (tests/test_training.py)
    fwd_db: float  # SQNR (dB) the forward GEMM clears on normal data
    grad_db: float  # ... and the two backward GEMMs


# SQNR bounds: a few dB under the measured values (64x256 @ 256x64, normal data; forward /
# input gradient / weight gradient). Rounding to m mantissa bits gives roughly 6m + 10 dB:
# 3 bits (E4M3) ~28 dB, 2 bits (E5M2) ~24 dB, 1 bit (E2M1) ~16 dB, int8 per row ~40 dB.
# Measured: tensor 28.5/24.6/24.5, row 28.7/25.1/25.1, E4M3 everywhere 28.7/28.4/28.4,
# MXFP8 27.5/24.1/24.2, MXFP6 27.9/24.2/24.4, MXFP4 15.6/15.9/16.0, int8 40.1/41.7/41.5
# (block size 32 for MX), NVFP4 16.7/15.2/15.4 (stochastic gradients: noisier per draw,
# unbiased), NVFP4 1x16 blocks rounded to nearest 17.6/17.5/17.4; the test prints every
# entry's. Training tolerances: 10% of the bf16 loss for 8-bit formats; MXFP4
# rounds every operand by up to 1/6 relative (measured +24%): 35%.
REGISTRY: dict[str, Entry] = {
    "delayed": Entry(fp8ax.DelayedScaling(calibrate_first_call=True), delayed_first_call_reference(), 0.1, 25, 22),
    "delayed-margin-recent": Entry(
        fp8ax.DelayedScaling(history_length=4, margin=1, amax_compute_algo="most_recent", calibrate_first_call=True),
        delayed_first_call_reference(margin=1),
        0.1,
        25,
        22,
    ),
    "current": Entry(fp8ax.CurrentScaling(), current_reference(), 0.1, 25, 22),
    "current-row-pow2": Entry(
        fp8ax.CurrentScaling("row", power_of_two=True), current_reference("row", True), 0.1, 25, 22
    ),
    "current-stochastic": Entry(fp8ax.CurrentScaling(grad_rounding="stochastic"), current_reference(), 0.1, 25, 20),
    "current-e4m3": Entry(
        fp8ax.CurrentScaling(formats="e4m3"),
        current_reference(grad=ml_dtypes.float8_e4m3fn),
        0.1,
        25,
        25,
    ),
    "int8": Entry(fp8ax.Int8Scaling(), int8_reference, 0.1, 35, 35),
    # MXFP8 as trained now (the default: scales rounded up, E4M3 everywhere); FP6 and FP4
    # with the OCP spec's floor rule, which the default no longer covers.
    "mx": Entry(fp8ax.MXScaling(8), mx_reference(8, "e4m3", "e4m3", "ceil"), 0.1, 25, 25),
    "mx-fp6": Entry(fp8ax.MXScaling(8, "e2m3", "e3m2", "floor"), mx_reference(8, "e2m3", "e3m2"), 0.1, 25, 22),
    "mx-fp4": Entry(fp8ax.MXScaling(8, "e2m1", "e2m1", "floor"), mx_reference(8, "e2m1", "e2m1"), 0.35, 13, 13),
    "blockwise": Entry(fp8ax.BlockwiseScaling(8), blockwise_reference(8), 0.1, 25, 25),
    "blockwise-pow2": Entry(fp8ax.BlockwiseScaling(8, power_of_two=True), blockwise_reference(8, True), 0.1, 24, 24),
    # NVFP4 as NVIDIA trains it (2D weight blocks, Hadamard-rotated weight gradient,
    # stochastic gradients), and with every trick off.
    "nvfp4": Entry(fp8ax.NVFP4Scaling(), nvfp4_reference(fp8ax.NVFP4Scaling()), 0.35, 15, 13),
    "nvfp4-1d-rn": Entry(_NVFP4_RN, nvfp4_reference(_NVFP4_RN), 0.35, 15, 15),
    # A stateful recipe defined outside fp8ax (tests/running_max.py); a fresh layer's
    # first call calibrates on its own amax, as delayed scaling's does.
    "running-max": Entry(RunningMaxScaling(), delayed_first_call_reference(), 0.1, 25, 22),
}

STATELESS = {name: e for name, e in REGISTRY.items() if not e.recipe.stateful}
