"""fp8ax's Haliax entry points fail with one clear error when Haliax cannot run on the installed JAX.

Haliax 1.4.dev453's `hax.dot` calls `jax.core.is_constant_dim`, which jax 0.11 removed. On
jax 0.10 the tests remove it themselves, so both CI runs check the error.
"""

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import pytest

import fp8ax
from conftest import hax_dot_failure
from fp8ax._haliax_compat import hax_dot_problem
from helpers import Batch, HaliaxMLP, In


def _remove_is_constant_dim(mp: pytest.MonkeyPatch) -> None:
    """Makes `jax.core.is_constant_dim` raise AttributeError, as on jax 0.11 and later.

    jax 0.10 serves it as a deprecated name, through the module's `__getattr__`.
    """
    if "is_constant_dim" in vars(jax.core):
        mp.delattr(jax.core, "is_constant_dim")
    served = getattr(jax.core, "__getattr__", None)

    def module_getattr(name):
        if name == "is_constant_dim" or served is None:
            raise AttributeError(f"module 'jax.core' has no attribute {name!r}")
        return served(name)

    mp.setattr(jax.core, "__getattr__", module_getattr, raising=False)
    assert not hasattr(jax.core, "is_constant_dim")


@pytest.fixture
def broken_hax_dot(monkeypatch):
    """`hax.dot` as it is on jax 0.11 and later: `jax.core.is_constant_dim` is gone."""
    _remove_is_constant_dim(monkeypatch)
    hax_dot_problem.cache_clear()
    yield
    hax_dot_problem.cache_clear()  # the next probe sees JAX as monkeypatch restores it


def _assert_names_the_fix(excinfo, entry):
    msg = str(excinfo.value)
    assert msg.startswith(f"{entry}: haliax "), msg
    assert f"on jax {jax.__version__}" in msg and "is_constant_dim" in msg, msg
    assert 'pip install "jax>=0.10,<0.11"' in msg and ".[haliax]" in msg, msg


def test_the_probe_agrees_with_the_test_suites_own():
    # conftest's probe (eager and jit, values checked) decides which tests skip.
    assert (hax_dot_problem() is None) == (hax_dot_failure() is None)


def test_converting_a_haliax_model_names_the_versions(getkey, broken_hax_dot):
    model = HaliaxMLP.init(key=getkey())
    with pytest.raises(RuntimeError) as excinfo:
        fp8ax.fp8_linear_layers(model)
    _assert_names_the_fix(excinfo, "fp8ax.fp8_linear_layers")
    # What the user would otherwise see first: Haliax's AttributeError from inside hax.dot.
    with pytest.raises(AttributeError, match="is_constant_dim"):
        model.up_proj(hax.random.normal(getkey(), (Batch, In)))


def test_equinox_models_convert_and_run_with_a_broken_haliax(getkey, broken_hax_dot):
    mlp = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 4, 16, 1, key=getkey()))
    assert mlp(jnp.ones(8)).shape == (4,)


@pytest.mark.needs_hax_dot  # the model is converted and served before hax.dot breaks
def test_serving_a_haliax_model_names_the_versions(getkey):
    trained = fp8ax.fp8_linear_layers(HaliaxMLP.init(key=getkey()))
    x = hax.random.normal(getkey(), (Batch, In))
    trained = fp8ax.calibrate(trained, lambda m, x: hax.sum(m(x)).array, [(x,)])
    served = fp8ax.to_serving(trained)
    served(x)
    with pytest.MonkeyPatch.context() as mp:
        _remove_is_constant_dim(mp)
        hax_dot_problem.cache_clear()
        try:
            with pytest.raises(RuntimeError) as excinfo:
                fp8ax.to_serving(trained)
            _assert_names_the_fix(excinfo, "fp8ax.to_serving")
            with pytest.raises(RuntimeError) as excinfo:
                served(x)
            _assert_names_the_fix(excinfo, "fp8ax.ServingHaliaxLinear")
        finally:
            hax_dot_problem.cache_clear()
