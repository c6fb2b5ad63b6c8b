"""The error of a tensor core's limited-precision FP8 accumulation, emulated on the CPU
with `fp8ax.EmulatedAccumulation`: a (64, K) x (K, 64) GEMM of E4M3 values against the
exact (float64) product of the same values, for three input distributions and several
accumulators. Prints a Markdown table (docs/recipes.md quotes it) and writes JSON.

    python bench/accumulation_error.py [--k 4096] [--json bench/results/accumulation_error.json]
"""

import argparse
import time

import jax
import ml_dtypes
import numpy as np

import _harness
import fp8ax
from fp8ax._tensor_core import emulated_dot_general

MATMUL = (((1,), (0,)), ((), ()))
DISTRIBUTIONS = {
    "abs(N(0,1))": lambda rng, s: np.abs(rng.standard_normal(s)),  # same-signed products: the sum grows
    "N(0.5,1)": lambda rng, s: rng.standard_normal(s) + 0.5,
    "N(0,1)": lambda rng, s: rng.standard_normal(s),  # products cancel: the sum stays small
}
SETTINGS = {
    "float32 (XLA)": None,
    "13 bits, no promotion": fp8ax.EmulatedAccumulation(13, 32, None),
    "13 bits, 1 product per step": fp8ax.EmulatedAccumulation(13, 1, None),
    "13 bits, 4 products per step": fp8ax.EmulatedAccumulation(13, 4, None),
    "14 bits, no promotion": fp8ax.EmulatedAccumulation(14, 32, None),
    "13 bits, promoted every 128": fp8ax.EmulatedAccumulation(13, 32, 128),
}


def e4m3(x):
    return (x * (448 / np.abs(x).max())).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def pct(x: float) -> str:
    return f"{100 * x:.2g}%"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = {}
    start = time.perf_counter()
    for dist, draw in DISTRIBUTIONS.items():
        a, b = e4m3(draw(rng, (64, args.k))), e4m3(draw(rng, (args.k, 64)))
        exact = a.astype(np.float64) @ b.astype(np.float64)
        for name, setting in SETTINGS.items():
            if setting is None:
                out = np.asarray(jax.jit(lambda x, y: jax.lax.dot_general(x, y, MATMUL))(a, b), np.float64)
            else:
                f = jax.jit(lambda x, y, s=setting: emulated_dot_general(x, y, MATMUL, s))
                out = np.asarray(f(a, b), np.float64)
            err = np.abs(out - exact)
            rows.setdefault(name, {})[dist] = {
                "max_relative": float(np.max(err / np.abs(exact))),
                "max_over_range": float(err.max() / np.abs(exact).max()),
            }
    print(f"K = {args.k}, E4M3 inputs, (64, K) x (K, 64); {time.perf_counter() - start:.0f} s on the CPU\n")
    names = list(DISTRIBUTIONS)
    print(
        "| accumulator | "
        + " | ".join(f"{d}: max rel. error" for d in names[:2])
        + f" | {names[2]}: max error / max abs(out) |"
    )
    print("|---|" + "---|" * len(names))
    for name, cells in rows.items():
        vals = [pct(cells[d]["max_relative"]) for d in names[:2]] + [pct(cells[names[2]]["max_over_range"])]
        print(f"| {name} | " + " | ".join(vals) + " |")
    if args.json:
        _harness.write_json(args.json, {"k": args.k, "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
