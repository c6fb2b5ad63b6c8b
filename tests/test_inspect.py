"""gemm_report: counting the matmuls that really run in FP8."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import Batch, HaliaxMLP, In, Out, mse, sgd_step

import fp8ax


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
