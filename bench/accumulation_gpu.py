"""How well `fp8ax.EmulatedAccumulation` models a real GPU's FP8 GEMM accumulation.

On a CUDA GPU: E4M3 x E4M3 GEMMs, (M, K) x (K, N), computed by XLA:GPU (cuBLASLt) with
`lax.Precision.DEFAULT` (FP8 fast accumulation allowed) and `HIGHEST` (not allowed), and,
where PyTorch is installed, by `torch._scaled_mm` with `use_fast_accum` on and off. Each
result is compared with the exact product (float64) and with the emulated accumulator
for several settings (fraction bits, products per step, promotion interval), computed on
the same GPU (the emulation is exact arithmetic, so any backend gives the same bits):
the share of outputs that match bit for bit and the maximum relative error.

Needs only JAX, NumPy, ml_dtypes and fp8ax (installed; its `_tensor_core` module, which
Haliax is not needed for). Writes JSON to --json.

    python bench/accumulation_gpu.py --json bench/results/accumulation_gpu_h100.json
"""

import argparse
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import _harness
from fp8ax import _tensor_core as acc

MATMUL = (((1,), (0,)), ((), ()))
SETTINGS = (
    [(m, g, None) for m in (12, 13, 14) for g in (1, 4, 8, 16, 32)]
    + [(13, 32, p) for p in (32, 64, 128, 256, 512, 1024)]
    + [(14, 32, p) for p in (64, 128, 256)]
    + [(22, 1, None)]
)


def e4m3(x):
    return (x * (448 / np.abs(x).max())).astype(ml_dtypes.float8_e4m3fn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = jax.devices()[0]
    print("device:", device.device_kind, "| jax", jax.__version__)
    rng = np.random.default_rng(0)
    report = {"device": device.device_kind, "jax": jax.__version__, "shape": [args.m, args.k, args.n], "cases": {}}
    for dist in ("abs(N(0,1))", "N(0.5,1)", "N(0,1)"):
        draw = {
            "abs(N(0,1))": lambda s: np.abs(rng.standard_normal(s)),
            "N(0.5,1)": lambda s: rng.standard_normal(s) + 0.5,
        }
        draw = draw.get(dist, lambda s: rng.standard_normal(s))
        a8, b8 = e4m3(draw((args.m, args.k))), e4m3(draw((args.k, args.n)))
        a, b = jnp.asarray(a8), jnp.asarray(b8)
        exact = a8.astype(np.float64) @ b8.astype(np.float64)
        gpu = {}
        for name, precision in (("xla_default", jax.lax.Precision.DEFAULT), ("xla_highest", jax.lax.Precision.HIGHEST)):
            f = jax.jit(
                lambda x, y, p=precision: jax.lax.dot_general(
                    x, y, MATMUL, precision=p, preferred_element_type=jnp.float32
                )
            )
            gpu[name] = np.asarray(f(a, b))
        try:
            import torch

            ta = torch.from_numpy(a8.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
            tb = torch.from_numpy(np.ascontiguousarray(b8.T).view(np.uint8)).cuda().view(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            for fast in (True, False):
                out = torch._scaled_mm(ta, tb, one, one, out_dtype=torch.float32, use_fast_accum=fast)
                gpu[f"torch_fast_accum_{fast}"] = out.cpu().numpy()
        except Exception as e:  # noqa: BLE001 (reported, not needed)
            print("torch._scaled_mm skipped:", type(e).__name__, str(e)[:200])
        emulated = {}
        start = time.perf_counter()
        for m, g, p in SETTINGS:
            setting = acc.EmulatedAccumulation(m, g, p)
            f = jax.jit(lambda x, y, s=setting: acc.emulated_dot_general(x, y, MATMUL, s))
            emulated[f"m{m}_g{g}_p{p}"] = np.asarray(f(a, b))
        print(f"\n{dist}: emulations took {time.perf_counter() - start:.1f} s")
        case = {}
        with np.errstate(divide="ignore", invalid="ignore"):
            for gname, out in gpu.items():
                rel = np.abs(out - exact) / np.abs(exact)
                row = {
                    "max_rel_vs_exact": float(np.nanmax(rel)),
                    "max_err_over_range": float(np.abs(out - exact).max() / np.abs(exact).max()),
                }
                for ename, emu in emulated.items():
                    row[f"match_{ename}"] = float(np.mean(out == emu))
                    row[f"maxdiff_{ename}"] = float(np.abs(out - emu).max() / np.abs(exact).max())
                case[gname] = row
                best = max(emulated, key=lambda e: row[f"match_{e}"])
                print(
                    f"  {gname:24s} max rel {row['max_rel_vs_exact']:.2e}  err/range {row['max_err_over_range']:.2e}"
                    f"  best emulation {best}: {row['match_' + best]:.1%} bit-equal, max diff/range"
                    f" {row['maxdiff_' + best]:.1e}"
                )
            for ename, emu in emulated.items():
                rel = np.abs(emu - exact) / np.abs(exact)
                case[f"emulated_{ename}"] = {
                    "max_rel_vs_exact": float(np.nanmax(rel)),
                    "max_err_over_range": float(np.abs(emu - exact).max() / np.abs(exact).max()),
                }
        report["cases"][dist] = case
    if args.json:
        _harness.write_json(args.json, report, indent=1)


if __name__ == "__main__":
    main()
