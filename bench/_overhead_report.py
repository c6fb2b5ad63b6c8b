"""bench/overhead.py's table."""

from __future__ import annotations

import sys


def print_table(results: dict, out=sys.stdout):
    hdr = (
        f"{'dtype':<9} {'variant':<9} {'step ms':>9} {'x plain':>7} {'compile s':>9} {'x plain':>7} "
        f"{'SHLO ops':>8} {'+/layer':>8} {'inlined':>7} {'+/layer':>8} {'HLO entry':>9} {'+/layer':>8} "
        f"{'kernels':>7} {'+/layer':>8}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)

    def fmt(vp, key, spec, default):
        return format(vp[key], spec) if vp else default

    for dtype_name, res in results.items():
        for v, i in res["variants"].items():
            vp = i.get("vs_plain")
            one, dash = ("1", "-") if v == "plain" else ("n/a", "n/a")
            print(
                f"{dtype_name:<9} {v:<9} {i['step_s_median'] * 1e3:>9.2f} "
                f"{fmt(vp, 'step_ratio', '.3f', one):>7} "
                f"{i['lower_compile_s_median']:>9.3f} {fmt(vp, 'compile_ratio', '.2f', one):>7} "
                f"{i['stablehlo_ops']:>8d} {fmt(vp, 'stablehlo_ops_added_per_layer', '+.1f', dash):>8} "
                f"{i['stablehlo_ops_inlined']:>7d} {fmt(vp, 'stablehlo_ops_inlined_added_per_layer', '+.1f', dash):>8} "
                f"{i['hlo_instructions_entry']:>9d} {fmt(vp, 'hlo_entry_instructions_added_per_layer', '+.1f', dash):>8} "
                f"{i['hlo_entry_kernels']:>7d} {fmt(vp, 'hlo_entry_kernels_added_per_layer', '+.1f', dash):>8}",
                file=out,
            )
    print(
        "\ncompile s: trace+lower+XLA compile of the step (median).\n"
        "SHLO ops: `stablehlo.*` op lines in Lowered.as_text() (private funcs counted once); inlined: the same "
        "with every `call` expanded;\nHLO entry: instructions in the ENTRY computation of the optimized HLO "
        "(~ kernels that run); kernels: the same less parameter/constant/tuple/get-tuple-element/bitcast.\n"
        "+/layer: (variant - plain) / number of FP8 layers.\n",
        file=out,
    )
    for dtype_name, res in results.items():
        for v, i in res["variants"].items():
            vp = i.get("vs_plain")
            if not vp:
                continue
            top = list(vp["op_kinds_added_per_layer_inlined"].items())[:10]
            s = ", ".join(f"{k.removeprefix('stablehlo.')} {c:+g}" for k, c in top)
            print(f"{dtype_name:<9} {v:<7} top op kinds added per layer (inlined): {s}", file=out)
    print(file=out)
    for dtype_name, res in results.items():
        vs = res["variants"]
        for name in ("fp8ax", "fp8ax-cal"):
            if name not in vs or "haliax" not in vs:
                continue
            f, h = vs[name], vs["haliax"]
            print(
                f"{dtype_name:<9} {name} / haliax: step {f['step_s_median'] / h['step_s_median']:.3f}x, "
                f"compile {f['lower_compile_s_median'] / h['lower_compile_s_median']:.2f}x "
                f"(lower {f['lower_s_median'] / h['lower_s_median']:.2f}x, XLA {f['compile_s_median'] / h['compile_s_median']:.2f}x; "
                f"Python calls to lower {f['lower_python_calls'] / 1e3:.0f}k vs {h['lower_python_calls'] / 1e3:.0f}k), "
                f"StableHLO ops {f['stablehlo_ops'] / h['stablehlo_ops']:.2f}x "
                f"(inlined {f['stablehlo_ops_inlined'] / h['stablehlo_ops_inlined']:.2f}x)",
                file=out,
            )
            fp, hp = f.get("vs_plain"), h.get("vs_plain")
            if fp and hp:
                print(
                    f"{'':<9} per converted layer: kernels added "
                    f"{fp['hlo_entry_kernels_added_per_layer']:+.1f} vs {hp['hlo_entry_kernels_added_per_layer']:+.1f} "
                    f"({fp['hlo_entry_kernels_added_per_layer'] / hp['hlo_entry_kernels_added_per_layer']:.2f}x), "
                    f"entry instructions {fp['hlo_entry_instructions_added_per_layer']:+.1f} vs "
                    f"{hp['hlo_entry_instructions_added_per_layer']:+.1f}; step overhead vs plain "
                    f"{fp['step_ratio']:.3f} vs {hp['step_ratio']:.3f}",
                    file=out,
                )
