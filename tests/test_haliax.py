"""fp8ax's door to Haliax (`fp8ax/_haliax.py`).

- `import fp8ax` imports neither Haliax nor AQT nor Flax; an Equinox model trains without
  them; once the program imports Haliax, Haliax's own helpers recognise fp8ax's modules.
- fp8ax's Haliax entry points fail with one clear error when Haliax cannot run on the
  installed JAX. Haliax 1.4.dev453's `hax.dot` (and marin-haliax 0.2.20's) calls
  `jax.core.is_constant_dim`, which jax 0.11 removed. The tests take it away from where the
  installed Haliax looks it up, so every CI run checks the error, whatever its versions.
- The weight layout `fp8_all_gather` asks for is a sharding constraint with either Haliax.
"""

import subprocess
import sys
import textwrap

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import pytest

import fp8ax
from conftest import hax_dot_failure
from fp8ax._haliax import hax_dot_problem
from helpers import Batch, HaliaxMLP, In

_WITHOUT_HALIAX = textwrap.dedent(
    """
    import sys

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import fp8ax

    heavy = ("haliax", "aqt", "flax")
    assert not [m for m in sys.modules if m.split(".")[0] in heavy], sorted(sys.modules)

    # An Equinox model converts, trains a step, reports and serves without them.
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(8, 8, 16, 1, key=jax.random.key(0)))
    opt = fp8ax.skip_fp8_state(optax.adam(1e-3))
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((4, 8))
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
    updates, opt_state = opt.update(grads, opt_state, params=model)
    model = fp8ax.apply_updates(model, updates, overwrite)
    fp8ax.check_state(model, written=True)
    fp8ax.conversion_report(model)
    fp8ax.scaling_stats(model)
    fp8ax.to_serving(model)
    assert not [m for m in sys.modules if m.split(".")[0] in heavy], sorted(sys.modules)
    dg = model.layers[0].dot_general

    # Haliax imported later: its helpers know fp8ax's modules from the first fp8ax call on.
    import haliax.quantization as haxq
    from fp8ax._haliax import overwrite_base

    fp8ax.partition_for_grad_overwrite(grads)
    assert isinstance(dg, overwrite_base(haxq))
    assert issubclass(fp8ax.Fp8DotGeneral, overwrite_base(haxq))
    print("ok")
    """
)


def test_import_fp8ax_loads_no_haliax_aqt_or_flax():
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_HALIAX], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_haliax_helpers_recognise_fp8ax_modules():
    # This process imported Haliax before any fp8ax module was built (the usual order).
    # Haliax's base class is `OverwriteWithGradient` in haliax 1.4.dev453 and marin-haliax
    # 0.2.20, `CustomGradientAccumulation` in newer marin-haliax.
    import haliax.quantization as haxq

    from fp8ax._haliax import overwrite_base

    dg = fp8ax.Fp8DotGeneral.init()
    assert isinstance(dg, overwrite_base(haxq))
    assert isinstance(fp8ax.Fp8RaggedDot.init(num_experts=2), overwrite_base(haxq))
    # Haliax's own helpers put fp8ax's state where they put theirs.
    model = {"dg": dg, "w": jnp.ones(3)}
    overwrite, rest = haxq.partition_for_grad_overwrite(model)
    assert overwrite["dg"] is dg and overwrite["w"] is None and rest["dg"] is None
    assert haxq.apply_updates(model, {"dg": None, "w": jnp.ones(3)}, overwrite)["dg"] is dg


class _CoreWithout:
    """A stand-in for a JAX core module without `is_constant_dim`; the rest is the module's."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        if name == "is_constant_dim":
            raise AttributeError(f"module {self._module.__name__!r} has no attribute {name!r}")
        return getattr(self._module, name)


def _remove_is_constant_dim(mp: pytest.MonkeyPatch) -> None:
    """Makes `jax.core.is_constant_dim` raise AttributeError, as on jax 0.11 and later,
    and the same where a newer marin-haliax looks it up (`haliax.jax_utils.jax_core`,
    which is `jax._src.core`: a working `hax.dot` on jax 0.12).

    jax 0.10 serves `jax.core.is_constant_dim` as a deprecated name, through the module's
    `__getattr__`.
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
    import haliax.jax_utils

    if hasattr(haliax.jax_utils, "jax_core"):
        mp.setattr(haliax.jax_utils, "jax_core", _CoreWithout(haliax.jax_utils.jax_core))


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
    assert 'pip install "jax>=0.10,<0.11"' in msg and 'pip install -U "fp8ax[haliax]"' in msg, msg
    assert "pip uninstall haliax" in msg, msg  # the old distribution, before marin-haliax


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


@pytest.mark.parametrize("mapping", [{"Batch": "data"}, {"Mid": "data"}], ids=["replicated", "sharded"])
def test_the_fp8_all_gather_layout_is_a_sharding_constraint(mapping):
    # `fp8_all_gather` lays out a weight's FP8 bits as the compute axis mapping asks, so
    # that the FSDP all-gather moves FP8. For FSDP that layout is replicated (the mapping
    # names none of the weight's axes). marin-haliax's `hax.shard` emits a `reshard` for a
    # spec that names no mesh axis, which on `Auto` axes constrains nothing; fp8ax asks
    # for the constraint itself (the 8-device HLO check is test_sharding.py's
    # `fp8_all_gather` case).
    from fp8ax import _haliax

    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    bits = jnp.zeros((4, 2), jnp.uint8)
    with hax.partitioning.set_mesh(mesh), hax.axis_mapping(mapping):
        jaxpr = jax.make_jaxpr(lambda b: _haliax.shard_by_axis_mapping(b, ("Mid", "In")))(bits)
    assert [e.primitive.name for e in jaxpr.eqns] == ["sharding_constraint"], jaxpr
    spec = tuple(jaxpr.eqns[0].params["sharding"].spec)
    assert spec + (None,) * (2 - len(spec)) == (mapping.get("Mid"), None), jaxpr
    # Without an axis mapping, nothing is constrained.
    with hax.partitioning.set_mesh(mesh):
        assert not jax.make_jaxpr(lambda b: _haliax.shard_by_axis_mapping(b, ("Mid", "In")))(bits).eqns
