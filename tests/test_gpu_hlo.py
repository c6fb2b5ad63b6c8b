"""bench/gpu_hlo.py reads optimized XLA:GPU HLO: kernels, FP8 GEMMs, HBM bytes, casts that
wait on their own amax. Checked on small hand-written modules whose answers are known."""

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gpu_hlo.py"


@pytest.fixture(scope="module")
def gpu_hlo():
    spec = importlib.util.spec_from_file_location("fp8ax_bench_gpu_hlo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Two casts of x (1024 x 1024 bf16) to FP8. `waits` is scaled by a scale computed from
# x's own amax: it cannot start before the reduction has read all of x. `free` uses the
# scale the step was given; the amax it also takes (for the next state) runs beside it.
CASTS = """\
HloModule step

%amax_comp (p: bf16[1024,1024]) -> f32[] {
  %p = bf16[1024,1024]{1,0} parameter(0)
  %c = f32[1024,1024]{1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%c, %z), dimensions={0,1}, to_apply=%max
}

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%scale_comp (a: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %k = f32[] constant(448)
  ROOT %d = f32[] divide(%a, %k)
}

%cast_comp (x: bf16[1024,1024], s: f32[]) -> f8e4m3fn[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %c = f32[1024,1024]{1,0} convert(%x)
  %b = f32[1024,1024]{1,0} broadcast(%s), dimensions={}
  %q = f32[1024,1024]{1,0} divide(%c, %b)
  ROOT %f = f8e4m3fn[1024,1024]{1,0} convert(%q)
}

%branch (p: f32[]) -> f32[] {
  ROOT %p = f32[] parameter(0)
}

ENTRY %main (x: bf16[1024,1024], s: f32[], i: s32[]) -> (f8e4m3fn[1024,1024], f8e4m3fn[1024,1024], f32[], f32[]) {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %i = s32[] parameter(2)
  %amax = f32[] fusion(%x), kind=kInput, calls=%amax_comp
  %scale = f32[] fusion(%amax), kind=kLoop, calls=%scale_comp
  %waits = f8e4m3fn[1024,1024]{1,0} fusion(%x, %scale), kind=kLoop, calls=%cast_comp
  %free = f8e4m3fn[1024,1024]{1,0} fusion(%x, %s), kind=kLoop, calls=%cast_comp
  %cond = f32[] conditional(%i, %s), branch_computations={%branch, %branch}
  %cb = () custom-call(%s), custom_call_target="xla_ffi_python_gpu_callback"
  ROOT %t = (f8e4m3fn[1024,1024]{1,0}, f8e4m3fn[1024,1024]{1,0}, f32[], f32[]) tuple(%waits, %free, %amax, %cond)
}
"""


def test_waiting_casts_kernels_and_bytes(gpu_hlo):
    s = gpu_hlo.summary(CASTS)
    assert s["waiting_casts"] == ["waits"]
    # amax, scale, waits, free, the conditional, the callback: 6 kernels, no GEMM.
    assert (s["kernels"], s["gemms"], s["non_gemm_kernels"]) == (6, 0, 6)
    assert (s["conditionals"], s["host_callbacks"]) == (1, 1)
    mib = 1024 * 1024
    # Reads and writes: amax 2 MiB + 4; scale 4 + 4; each cast 2 MiB + 4 in, 1 MiB out;
    # the conditional 4 + 4 + 4; the callback 4.
    assert s["non_gemm_bytes"] == (2 * mib + 4) + 8 + 2 * (3 * mib + 4) + 12 + 4


# What does not count as waiting on the tensor's own amax. `normed` casts a normalized
# x, which needs x's per-row statistics (a reduction over x, but not to a scalar);
# `sibling` reads `t`, a full-size tensor that the kernel reducing x to its amax also
# writes (a multi-output fusion), and is scaled by the given scale. Both fail the old
# rule (any reduction over the cast's input among its producers).
NOT_WAITING = """\
HloModule step2

%max (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%rows_comp (p: bf16[1024,1024]) -> f32[1024] {
  %p = bf16[1024,1024]{1,0} parameter(0)
  %c = f32[1024,1024]{1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r = f32[1024]{0} reduce(%c, %z), dimensions={1}, to_apply=%max
}

%norm_cast_comp (x: bf16[1024,1024], r: f32[1024]) -> f8e4m3fn[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %r = f32[1024]{0} parameter(1)
  %c = f32[1024,1024]{1,0} convert(%x)
  %b = f32[1024,1024]{1,0} broadcast(%r), dimensions={0}
  %q = f32[1024,1024]{1,0} divide(%c, %b)
  ROOT %f = f8e4m3fn[1024,1024]{1,0} convert(%q)
}

%amax_and_t_comp (p: bf16[1024,1024]) -> (f32[], bf16[1024,1024]) {
  %p = bf16[1024,1024]{1,0} parameter(0)
  %c = f32[1024,1024]{1,0} convert(%p)
  %z = f32[] constant(0)
  %r = f32[] reduce(%c, %z), dimensions={0,1}, to_apply=%max
  %t = bf16[1024,1024]{1,0} tanh(%p)
  ROOT %o = (f32[], bf16[1024,1024]{1,0}) tuple(%r, %t)
}

%cast_comp (x: bf16[1024,1024], s: f32[]) -> f8e4m3fn[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %c = f32[1024,1024]{1,0} convert(%x)
  %b = f32[1024,1024]{1,0} broadcast(%s), dimensions={}
  %q = f32[1024,1024]{1,0} divide(%c, %b)
  ROOT %f = f8e4m3fn[1024,1024]{1,0} convert(%q)
}

ENTRY %main (x: bf16[1024,1024], s: f32[]) -> (f8e4m3fn[1024,1024], f8e4m3fn[1024,1024], f32[]) {
  %x = bf16[1024,1024]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %rows = f32[1024]{0} fusion(%x), kind=kInput, calls=%rows_comp
  %normed = f8e4m3fn[1024,1024]{1,0} fusion(%x, %rows), kind=kLoop, calls=%norm_cast_comp
  %both = (f32[], bf16[1024,1024]{1,0}) fusion(%x), kind=kInput, calls=%amax_and_t_comp
  %amax = f32[] get-tuple-element(%both), index=0
  %t = bf16[1024,1024]{1,0} get-tuple-element(%both), index=1
  %sibling = f8e4m3fn[1024,1024]{1,0} fusion(%t, %s), kind=kLoop, calls=%cast_comp
  ROOT %out = (f8e4m3fn[1024,1024]{1,0}, f8e4m3fn[1024,1024]{1,0}, f32[]) tuple(%normed, %sibling, %amax)
}
"""


def test_per_row_statistics_and_sibling_outputs_are_not_waiting(gpu_hlo):
    assert gpu_hlo.summary(NOT_WAITING)["waiting_casts"] == []
    # A cast of x scaled by that kernel's amax of x does wait.
    waits = NOT_WAITING.replace("fusion(%t, %s), kind=kLoop", "fusion(%x, %amax), kind=kLoop")
    assert gpu_hlo.summary(waits)["waiting_casts"] == ["sibling"]


def test_gemm_flops_and_roofline(gpu_hlo):
    hlo = """\
HloModule g

%gemm (a: f8e4m3fn[256,512], b: f8e4m3fn[128,512]) -> bf16[256,128] {
  %a = f8e4m3fn[256,512]{1,0} parameter(0)
  %b = f8e4m3fn[128,512]{1,0} parameter(1)
  ROOT %d = bf16[256,128]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

ENTRY %main (a: f8e4m3fn[256,512], b: f8e4m3fn[128,512]) -> bf16[256,128] {
  %a = f8e4m3fn[256,512]{1,0} parameter(0)
  %b = f8e4m3fn[128,512]{1,0} parameter(1)
  ROOT %g = bf16[256,128]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""
    s = gpu_hlo.summary(hlo)
    assert (s["gemms"], s["fp8_gemms"], s["gemm_out_dtypes"]) == (1, 1, ["bf16"])
    assert s["gemm_flops"] == s["fp8_gemm_flops"] == 2 * 256 * 128 * 512
    assert s["gemm_bytes"] == 256 * 512 + 128 * 512 + 2 * 256 * 128
    # Compute-bound at 1e12 FLOP/s (67 us) against 0.26 MB at 1e12 B/s (0.26 us).
    t = gpu_hlo.roofline_s(s, fp8_flops_per_s=1e12, bf16_flops_per_s=0.5e12, bytes_per_s=1e12)
    assert t == pytest.approx(2 * 256 * 128 * 512 / 1e12)


def test_no_entry_is_an_error(gpu_hlo):
    with pytest.raises(ValueError, match="no ENTRY"):
        gpu_hlo.summary("HloModule empty\n")
