"""gemm_report: counting the matmuls that really run in FP8."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8ax
from helpers import Batch, HaliaxMLP, In, Out, mse, sgd_step


@pytest.mark.needs_hax_dot
def test_report_on_a_training_step(getkey):
    import haliax as hax

    model = HaliaxMLP.init(key=getkey())
    x, y = hax.random.normal(getkey(), (Batch, In)), hax.random.normal(getkey(), (Batch, Out))
    plain = fp8ax.gemm_report(sgd_step(mse), model, x, y)
    direct = fp8ax.gemm_report(sgd_step(mse), fp8ax.fp8_linear_layers(model), x, y)
    qdq = fp8ax.gemm_report(sgd_step(mse), fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(mode="qdq")), x, y)
    # 2 layers x (forward + 2 gradient GEMMs), minus the input gradient of the first layer,
    # which nothing needs: 5 matmuls in each program.
    assert (plain.lowered_fp8, plain.lowered_total) == (0, 5)
    assert (direct.lowered_fp8, direct.lowered_total) == (5, 5)
    assert (qdq.lowered_fp8, qdq.lowered_total) == (0, 5)  # qdq relies on XLA's rewrite
    assert direct.backend == jax.default_backend()
    if jax.default_backend() == "cpu":
        # XLA:CPU has no FP8 GEMM: it upcasts, and the report says so.
        assert direct.compiled_fp8 == 0 and not direct.all_fp8
        assert direct.compiled_total >= 1


def test_report_counts_plain_functions():
    def f(a, b):
        return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    a = jnp.ones((4, 8), jnp.float8_e4m3fn)
    r = fp8ax.gemm_report(f, a, jnp.ones((8, 2), jnp.float8_e5m2))
    assert (r.lowered_fp8, r.lowered_total) == (1, 1)
    r = fp8ax.gemm_report(eqx.filter_jit(f), jnp.ones((4, 8)), jnp.ones((8, 2)))
    assert (r.lowered_fp8, r.lowered_total) == (0, 1)


def test_report_needs_a_callable():
    import pytest

    with pytest.raises(TypeError, match="`fn` must be a callable"):
        fp8ax.gemm_report("step")


def test_report_on_a_model_with_attention(getkey):
    model = fp8ax.fp8_linear_layers(eqx.nn.MultiheadAttention(num_heads=2, query_size=16, key=getkey()))
    x = jax.random.normal(getkey(), (3, 5, 16))  # 3 sequences of 5 tokens

    def loss(m, x):
        return jnp.sum(jax.vmap(lambda xi: m(xi, xi, xi))(x))

    report = fp8ax.gemm_report(eqx.filter_grad(loss), model, x)
    # The counts are the entries' counts.
    assert len(report.lowered) == report.lowered_total and sum(g.fp8 for g in report.lowered) == report.lowered_fp8
    assert len(report.compiled) == report.compiled_total
    assert sum(g.fp8 for g in report.compiled) == report.compiled_fp8
    # Every GEMM of the four converted projections takes FP8 operands ("direct" mode).
    ours = [g for g in report.lowered if g.fp8ax]
    assert ours and all(g.fp8 for g in ours) and report.lowered_converted_all_fp8
    assert all(g.lhs.startswith(("f8e4m3fn[", "f8e5m2[")) for g in ours)
    assert all("fp8ax.Fp8DotGeneral" in g.name for g in ours)
    # ... while the attention scores and the weighted sum of the values are not FP8, so
    # `all_fp8` can never hold for this model; they are listed with shapes and source.
    others = report.lowered_non_fp8
    assert others == [g for g in report.lowered if not g.fp8ax] and len(others) >= 2
    assert not report.all_fp8
    assert all(
        "MultiheadAttention" in g.name and g.location.split(":")[0].endswith("equinox/nn/_attention.py") for g in others
    )
    # Forward: scores (heads, q, k) from q and k (3 sequences x 5 tokens x 2 heads x 8).
    forward = [g for g in others if not g.name.split("/")[1].startswith("transpose")]
    assert sorted(g.out for g in forward) == ["f32[3,2,5,5]", "f32[3,2,5,8]"], forward
    assert {g.lhs for g in forward} >= {"f32[3,5,2,8]"}
    # The traceback reaches this test: the call of `m` inside `loss`.
    assert all(any(f.endswith(f"test_inspect.py:{_line_of('m(xi, xi, xi)')}") for f in g.traceback) for g in others)
    text = str(report)
    assert f"fp8ax layers {len(ours)}/{len(ours)} FP8" in text and "lowered matmuls without FP8 operands:" in text
    assert "equinox/nn/_attention.py:" in text and "(from " in text and "test_inspect.py:" in text
    if jax.default_backend() == "cpu":
        assert not report.converted_all_fp8 and len(report.non_fp8) == report.compiled_total
        assert {g.fp8ax for g in report.compiled} == {True, False}


def _line_of(snippet: str) -> int:
    import pathlib

    lines = pathlib.Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line and "_line_of" not in line)


def test_report_locates_plain_matmuls():
    def f(a, b):
        return jnp.tanh(a @ b)  # the matmul

    r = fp8ax.gemm_report(f, jnp.ones((4, 8)), jnp.ones((8, 2)))
    (g,) = r.lowered
    assert (g.lhs, g.rhs, g.out, g.fp8, g.fp8ax) == ("f32[4,8]", "f32[8,2]", "f32[4,2]", False, False)
    assert g.location.endswith(f"test_inspect.py:{_line_of('# the matmul')}")
    assert not r.lowered_converted_all_fp8 and not r.converted_all_fp8  # no fp8ax layer at all
    (c,) = r.compiled
    assert (c.out, c.fp8ax, c.location) == ("f32[4,2]", False, g.location)


@pytest.mark.needs_hax_dot
def test_report_on_a_haliax_attention_block(getkey):
    import haliax as hax

    Pos, KPos, Embed, Heads, Head = (
        hax.Axis("pos", 6),
        hax.Axis("kpos", 6),
        hax.Axis("embed", 16),
        hax.Axis("heads", 2),
        hax.Axis("head", 8),
    )

    class Attn(eqx.Module):
        q: hax.nn.Linear
        kv: hax.nn.Linear

        def __call__(self, x):
            q = self.q(x)
            kv = self.kv(x).rename({Pos: KPos})
            return hax.nn.attention.dot_product_attention(KPos, Head, q, kv, kv)

    model = Attn(
        hax.nn.Linear.init(Embed, (Heads, Head), key=getkey()), hax.nn.Linear.init(Embed, (Heads, Head), key=getkey())
    )
    x = hax.random.normal(getkey(), (Pos, Embed))
    for mode, lowered_ok in (("direct", True), ("qdq", False)):
        fp8 = fp8ax.fp8_linear_layers(model, fp8ax.Fp8Config(mode=mode))
        r = fp8ax.gemm_report(lambda m, x: m(x).array.sum(), fp8, x)
        assert r.lowered_converted_all_fp8 is lowered_ok, (mode, str(r))
        ours = [g for g in r.lowered if g.fp8ax]
        assert len(ours) == 2  # the forward GEMMs of the two projections
        others = [g for g in r.lowered if not g.fp8ax]
        assert len(others) == 2 and not any(g.fp8 for g in others)
        assert all("haliax/nn/attention.py" in g.location for g in others), others


# An optimized XLA:GPU module as jax 0.10 prints it (operands by name only, types on the
# instructions that define them): a Triton GEMM fusion whose dot multiplies two FP8
# parameters, one whose FP8 parameters are converted to bf16 before the dot (what XLA
# does with the qdq pattern on that path), a cuBLASLt FP8 GEMM, a bf16 cuBLAS GEMM, and
# an older print with the operand types written inline.
_GPU_HLO = """\
HloModule jit_step

%gemm_fp8 (p0: f8e4m3fn[64,128], p1: f8e4m3fn[32,128]) -> bf16[64,32] {
  %p0 = f8e4m3fn[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,128]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/fp8ax.Fp8DotGeneral/dot_general"}
}

%gemm_upcast (p2: f8e4m3fn[64,128], p3: f8e4m3fn[32,128]) -> bf16[64,32] {
  %p2 = f8e4m3fn[64,128]{1,0} parameter(0)
  %c2 = bf16[64,128]{1,0} convert(%p2)
  %p3 = f8e4m3fn[32,128]{1,0} parameter(1)
  %c3 = bf16[32,128]{1,0} convert(%p3)
  ROOT %dot.2 = bf16[64,32]{1,0} dot(%c2, %c3), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(step)/fp8ax.Fp8DotGeneral/dot_general"}
}

ENTRY %main (a: f8e4m3fn[64,128], b: f8e4m3fn[32,128], x: bf16[64,128], w: bf16[128,32]) -> bf16[64,32] {
  %a = f8e4m3fn[64,128]{1,0} parameter(0)
  %b = f8e4m3fn[32,128]{1,0} parameter(1)
  %x = bf16[64,128]{1,0} parameter(2)
  %w = bf16[128,32]{1,0} parameter(3)
  %s = f32[] constant(1)
  %f1 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fp8, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %f2 = bf16[64,32]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_upcast, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %g1 = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s, %s), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step)/fp8ax.Fp8DotGeneral/dot_general"}
  %g2 = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/dot_general"}
  %old = bf16[64,32]{1,0} dot(f8e4m3fn[64,128]{1,0} %a, f8e4m3fn[32,128]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %sum = bf16[64,32]{1,0} add(%f1, %f2)
}
"""


def test_compiled_gpu_matmuls_are_read_with_their_operand_types():
    from fp8ax._inspect.gemms import _compiled_gemms

    gemms = _compiled_gemms(_GPU_HLO, ())
    got = [(g.lhs, g.rhs, g.out, g.fp8, g.fp8ax) for g in gemms]
    assert got == [
        ("f8e4m3fn[64,128]", "f8e4m3fn[32,128]", "bf16[64,32]", True, True),  # Triton fusion on FP8 operands
        ("bf16[64,128]", "bf16[32,128]", "bf16[64,32]", False, True),  # converted to bf16 first: not FP8
        ("f8e4m3fn[64,128]", "f8e4m3fn[32,128]", "bf16[64,32]", True, True),  # cuBLASLt FP8
        ("bf16[64,128]", "bf16[128,32]", "bf16[64,32]", False, False),  # bf16 cuBLAS
        ("f8e4m3fn[64,128]", "f8e4m3fn[32,128]", "bf16[64,32]", True, False),  # types written inline
    ]
