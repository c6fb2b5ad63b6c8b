"""The quantize-then-GEMM pipeline: true delayed scaling in the traced step, the one program
of first-call calibration, and the one settings object."""

import dataclasses
import re
import subprocess
import sys
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8ax
from helpers import train_step, walk_train_step as _walk_step


def _model(getkey, recipe=None):
    mlp = eqx.nn.MLP(8, 4, 16, 2, key=getkey())  # three linear layers
    return fp8ax.fp8_linear_layers(mlp, fp8ax.Fp8Config(recipe=recipe))


def test_delayed_scaling_casts_do_not_wait_for_their_amax(getkey):
    """With the default recipe (no first-call calibration) no FP8 cast in the step
    depends on any tensor's amax, fresh or filled: each tensor is quantized with the scale
    its state gives, and its amax (for the next state) is computed beside the cast."""
    fresh = _model(getkey)
    x = jax.random.normal(getkey(), (32, 8))
    for model in (fresh, eqx.filter_jit(train_step)(fresh, x)):
        walk = _walk_step(model, x)
        # 3 layers x (input, kernel, output gradient), each quantized once.
        assert len(walk.converts) == 9
        assert walk.amaxes >= 9  # every tensor's amax is still computed, for the state
        assert walk.branches == []
        assert not any(walk.converts)


def test_first_call_calibration_is_one_program_whose_casts_wait(getkey):
    # The same walk finds the dependence where it exists: with `calibrate_first_call=True`
    # each scale is a `select` between the tensor's own amax and its history, on a fresh
    # model and after the first step alike (one program, no conditional).
    fresh = _model(getkey, fp8ax.DelayedScaling(calibrate_first_call=True))
    x = jax.random.normal(getkey(), (32, 8))
    for model in (fresh, eqx.filter_jit(train_step)(fresh, x)):
        walk = _walk_step(model, x)
        assert walk.branches == []
        assert len(walk.converts) == 9 and all(walk.converts)


def test_current_scaling_casts_depend_on_their_amax(getkey, monkeypatch):
    model = _model(getkey, fp8ax.CurrentScaling())
    monkeypatch.setattr(fp8ax._gemm.dense, "_WARNED", set())
    jax.clear_caches()  # the warning is given while a pass is traced, and JAX caches that
    with pytest.warns(UserWarning, match="per example"):  # the step calls the MLP per example
        walk = _walk_step(model, jax.random.normal(getkey(), (32, 8)))
    assert walk.converts and all(walk.converts)


def test_no_calibration_means_no_branch(getkey):
    model = _model(getkey, fp8ax.DelayedScaling(calibrate_first_call=False))
    walk = _walk_step(model, jax.random.normal(getkey(), (32, 8)))
    assert walk.branches == []
    assert len(walk.converts) == 9 and not any(walk.converts)


# --------------------------------------------------------------------------------------
# One settings object


def test_settings_is_the_one_static_field(getkey):
    settings = fp8ax.GemmSettings(fp8ax.CurrentScaling("row"), "qdq", high_precision_gemms=("drhs",))
    dg = fp8ax.Fp8DotGeneral.init(settings=settings)
    static = [f.name for f in dataclasses.fields(dg) if f.metadata.get("static")]
    assert static == ["settings"]
    assert dg.settings is settings
    # Read through the module and the config under the old names.
    assert (dg.recipe, dg.mode, dg.high_precision_gemms) == (settings.recipe, "qdq", ("drhs",))
    config = fp8ax.Fp8Config(targets=["x"], settings=settings, min_features=4)
    assert (config.recipe, config.mode, config.min_features) == (settings.recipe, "qdq", 4)
    # The keyword arguments build the same settings.
    same = fp8ax.Fp8Config(
        targets=["x"], recipe=fp8ax.CurrentScaling("row"), mode="qdq", high_precision_gemms=("drhs",), min_features=4
    )
    assert same == config
    # dataclasses.replace re-checks.
    assert dataclasses.replace(settings, mode="direct").mode == "direct"
    with pytest.raises(ValueError, match="`mode` must be one of"):
        dataclasses.replace(settings, mode="fast")
    with pytest.raises(AttributeError):
        settings.mode = "direct"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(recipe="delayed"), TypeError, "`recipe` must be an fp8ax recipe"),
        (dict(mode="fp8"), ValueError, "`mode` must be one of"),
        (dict(compute_dtype=jnp.int8), TypeError, "`compute_dtype` must be a floating dtype"),
        (dict(fwd_precision="fast"), TypeError, "`fwd_precision` must be None or a `jax.lax.Precision`"),
        (dict(grad_recipe=fp8ax.DelayedScaling()), TypeError, "`grad_recipe` must be None"),
        (dict(high_precision_gemms="drhs"), ValueError, "`high_precision_gemms` must be a sequence"),
        (dict(high_precision_gemms=("bwd",)), ValueError, "`high_precision_gemms` must be a sequence"),
        (dict(fp8_all_gather_axes="In"), TypeError, "`fp8_all_gather_axes` must be None or a sequence"),
        (dict(lhs_recipe="off"), ValueError, "need a stateless `recipe`"),
    ],
)
def test_settings_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fp8ax.GemmSettings(**kwargs)


def test_settings_and_gemm_arguments_are_exclusive():
    settings = fp8ax.GemmSettings()
    with pytest.raises(ValueError, match=r"either `settings` or GEMM arguments.*\['mode'\]"):
        fp8ax.Fp8Config(settings=settings, mode="qdq")
    with pytest.raises(TypeError, match="`settings` must be an `fp8ax.GemmSettings`, got dict"):
        fp8ax.Fp8Config(settings={})
    with pytest.raises(TypeError, match="`settings` must be an `fp8ax.GemmSettings`, got str"):
        fp8ax.Fp8DotGeneral.init(settings="direct")
    with pytest.raises(ValueError, match="not both"):
        fp8ax.Fp8DotGeneral.init(fp8ax.DelayedScaling(), settings=settings)


@pytest.mark.parametrize(
    "recipe",
    [
        fp8ax.DelayedScaling(),
        fp8ax.CurrentScaling(),
        fp8ax.CurrentScaling("row"),
        fp8ax.MXScaling(block_size=4),
        fp8ax.Int8Scaling(),
    ],
    ids=["delayed", "tensor", "row", "mx", "int8"],
)
def test_every_recipe_declares_its_scale_layout(recipe, getkey):
    x = jax.random.normal(getkey(), (6, 8))
    state = recipe.init_state()
    raw = None if state is None else (state.scale, state.amax_history)
    # What the pipeline calls: the operands of a call, each with its role.
    ((q, new),) = recipe.quantize_operands([fp8ax.Operand(x, (1,), recipe.fwd_dtype, raw, role="lhs")])
    assert q.layout == recipe.scale_layout
    assert (new is None) == (not recipe.stateful)


def test_tracing_leaves_nothing_behind_at_exit():
    # The table that maps state leaves to their max-accumulating values empties through
    # weak-reference callbacks; at interpreter exit they must not fail (they once printed
    # "Exception ignored ..." for every entry).
    code = (
        "import equinox as eqx, jax, jax.numpy as jnp, fp8ax\n"
        "m = fp8ax.fp8_linear_layers(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)))\n"
        "g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(4)))))(m)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok\n"
    assert "Exception ignored" not in out.stderr, out.stderr


def test_forward_operands_are_quantized_together(getkey, monkeypatch):
    # Each layer's two forward operands go through one `quantize_operands` (delayed
    # scaling: one conditional for both), its output gradient through another.
    groups = []
    quantize_operands = fp8ax.DelayedScaling.quantize_operands

    def counting(self, operands):
        groups.append(len(operands))
        return quantize_operands(self, operands)

    monkeypatch.setattr(fp8ax.DelayedScaling, "quantize_operands", counting)
    jax.clear_caches()  # (a pass of the same signature traced before would not be traced again)
    dgs = [fp8ax.Fp8DotGeneral.init() for _ in range(3)]
    ws = [jax.random.normal(getkey(), shape) for shape in ((8, 16), (16, 16), (16, 4))]
    x = jax.random.normal(getkey(), (32, 8))
    dims = (((1,), (0,)), ((), ()))

    def loss(dgs):
        y = x
        for dg, w in zip(dgs, ws):
            y = dg(y, w, dims)
        return jnp.sum(y**2)

    eqx.filter_jit(eqx.filter_grad(loss)).lower(dgs)
    assert groups == [2, 2, 2, 1, 1, 1]


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def test_gemm_output_scales_are_planned_with_the_operand_scales(getkey, monkeypatch):
    # After the first step, each of a bf16 layer's three FP8 GEMMs gets its output scale
    # (the product of its operands' scales) from the plan, computed beside the scales;
    # and the step is bit for bit the one that multiplies the scales at the GEMM.
    from fp8ax._gemm import dense

    model = fp8ax.cast_floating(_model(getkey, fp8ax.DelayedScaling(calibrate_first_call=False)), jnp.bfloat16)
    x = jax.random.normal(getkey(), (32, 8)).astype(jnp.bfloat16)
    model = eqx.filter_jit(train_step)(model, x)
    gemm = dense.run_gemm
    given = []

    def recording(call, qa, a, qb, b, dims, precision, out_dtype, scale=None):
        # Which GEMM: called from `_forward`, or through `_gemm_fn` from `_backward` (input
        # gradient) or `_drhs` (weight gradient).
        caller = sys._getframe(1).f_code.co_name
        if caller != "_forward":
            caller = next(
                f.f_code.co_name for f in _frames(sys._getframe(1)) if f.f_code.co_name in ("_backward", "_drhs")
            )
        given.append((caller, scale is not None))
        return gemm(call, qa, a, qb, b, dims, precision, out_dtype, scale)

    def fresh():  # trace everything again (newer JAX caches what `custom_vmap` traced)
        dense._batchable_drhs.cache_clear()
        jax.clear_caches()

    monkeypatch.setattr(dense, "run_gemm", recording)
    fresh()
    planned = eqx.filter_jit(lambda m, x: train_step(m, x))(model, x)  # a new function: traced again
    # Each of the three GEMMs of every layer (JAX may trace some twice: `custom_vmap`
    # traces the weight gradient's unbatched function before its rule in jax 0.10).
    assert {c for c, _ in given} == {"_forward", "_backward", "_drhs"} and all(s for _, s in given), given
    assert sum(c == "_forward" for c, _ in given) == 3, given
    given.clear()
    monkeypatch.setattr(fp8ax.DelayedScaling, "planned_scale", lambda self, plan: None)
    fresh()
    unplanned = eqx.filter_jit(lambda m, x: train_step(m, x))(model, x)
    assert {c for c, _ in given} == {"_forward", "_backward", "_drhs"} and not any(s for _, s in given), given
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    assert len(arrays(planned)) == len(arrays(unplanned)) == 9  # each layer's weight, bias and state
    for a, b in zip(arrays(planned), arrays(unplanned)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_layers_of_one_shape_share_one_traced_pass(getkey):
    # `_gemm/passes.py`: each custom-VJP pass is a `jax.jit` keyed on the call's static
    # part, so four layers of one shape are traced once, and the lowered module holds one
    # forward and one backward function, called four times each. (Before, each layer's
    # passes were traced and lowered inline: the first step grew with depth.)
    dgs = [fp8ax.Fp8DotGeneral.init() for _ in range(4)]
    ws = [jax.random.normal(getkey(), (16, 16)) for _ in range(4)]
    x = jax.random.normal(getkey(), (8, 16))
    dims = (((1,), (0,)), ((), ()))

    def loss(args):
        dgs, ws, y = args
        for dg, w in zip(dgs, ws):
            y = dg(y, w, dims)
        return jnp.sum(y**2)

    # (Everything differentiated: where JAX drops a gradient nobody asks for, such as the
    # input's of a first layer, it prunes that call's residuals, a function of its own.)
    text = eqx.filter_jit(eqx.filter_grad(loss)).lower((dgs, ws, x)).lowered.as_text()
    for name in ("fp8ax.Fp8DotGeneral.forward", "fp8ax.Fp8DotGeneral.backward"):
        defined = re.findall(rf"func\.func private @({re.escape(name)}\w*)\(", text)
        assert defined == [name], (name, defined)
        assert len(re.findall(rf"\bcall @{re.escape(name)}\(", text)) == 4, name


def test_a_pass_is_keyed_on_haliax_axis_mapping():
    # A pass that lays out the FP8 weight by Haliax's axis mapping (the FP8 all-gather)
    # reads the mapping while it is traced, so the mapping is part of its key: another
    # mapping traces it again; a call that does not lay out by it is not keyed on it.
    hax = pytest.importorskip("haliax")
    from fp8ax._gemm.passes import _context

    def call(axes):
        return SimpleNamespace(settings=SimpleNamespace(fp8_all_gather_axes=axes))

    gathered = call(("embed", "mlp"))
    assert _context(gathered) is None  # no mapping in effect
    with hax.axis_mapping({"embed": "data"}):
        data = _context(gathered)
        assert _context(call(None)) is None
    with hax.axis_mapping({"embed": "model", "mlp": ("data", "model")}):
        model = _context(gathered)
    assert data == (("embed", "data"),) and model == (("embed", "model"), ("mlp", ("data", "model")))
    hash(model)  # a static argument of `jax.jit`
