"""The program XLA:GPU builds from an FP8 step (issue: make it what the design says).

On every machine: what fp8ax hands XLA (the lowered StableHLO). With the CUDA plugin
installed (``pip install "jax[cuda12]"``): the optimized HLO of a small train step compiled
ahead of time for an H100 (bench/gpu_aot.py's topology), read with bench/gpu_hlo.py.
Without the plugin those tests skip, saying so.
"""

import importlib.util
import os
import pathlib
import re
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fp8ax
from fp8ax import _boundaries

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
DIMS = (((1,), (0,)), ((), ()))


def _dot_precisions(text: str) -> list[str]:
    """The precision of every `dot_general` in lowered StableHLO, in program order."""
    return [
        m.group(1) if m else "DEFAULT"
        for m in (re.search(r"precision = \[(\w+), \w+\]", line) for line in text.splitlines() if "dot_general" in line)
    ]


@pytest.mark.parametrize("mode", ["direct", "qdq"])
def test_backward_fp8_gemms_accumulate_in_full_precision(mode):
    dg = fp8ax.Fp8DotGeneral.init(mode=mode)
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))

    def loss(d, x, w):
        return jnp.sum(d(x, w, DIMS) ** 2)  # the forward GEMM's output is used

    text = jax.jit(jax.grad(loss, argnums=(1, 2))).trace(dg, x, w).lower().as_text()
    # Forward DEFAULT (fast accumulation allowed), the two backward GEMMs HIGHEST.
    assert sorted(_dot_precisions(text)) == ["DEFAULT", "HIGHEST", "HIGHEST"]

    # An explicit precision is the user's.
    dg_fast = fp8ax.Fp8DotGeneral.init(mode=mode, dlhs_precision=lax.Precision.HIGH, drhs_precision=lax.Precision.HIGH)
    text = jax.jit(jax.grad(loss, argnums=(1, 2))).trace(dg_fast, x, w).lower().as_text()
    assert sorted(_dot_precisions(text)) == ["DEFAULT", "HIGH", "HIGH"]


def _load(name):
    # A bench script imports its sibling modules (bench/_harness.py...), as it does when
    # run as `python bench/<name>.py`, where bench/ is first on sys.path.
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"fp8ax_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def h100():
    """`(mesh, gpu_hlo)`: a one-device mesh on a described H100, or a skip."""
    aot = _load("gpu_aot")
    try:
        mesh = aot.topology_mesh()
    except Exception as e:  # noqa: BLE001 (the reason is the skip message)
        reason = f"no deviceless GPU compile here (needs the CUDA plugin, pip install 'jax[cuda12]'): {e}"
        if os.environ.get("FP8AX_REQUIRE_GPU_AOT") == "1":  # CI's run 3 has the plugin
            pytest.fail(reason)
        pytest.skip(reason)
    return mesh, _load("gpu_hlo")


@pytest.fixture(scope="module")
def b200():
    """A one-device mesh on a described Blackwell B200 (compute capability 10.0), or a
    skip."""
    aot = _load("gpu_aot")
    try:
        return aot.topology_mesh(aot.B200_TARGET)
    except Exception as e:  # noqa: BLE001 (the reason is the skip message)
        reason = f"no deviceless GPU compile here (needs the CUDA plugin, pip install 'jax[cuda12]'): {e}"
        if os.environ.get("FP8AX_REQUIRE_GPU_AOT") == "1":
            pytest.fail(reason)
        pytest.skip(reason)


def _block_step_program(mesh, recipe, block_scaled_gemm) -> str:
    """The optimized HLO of the three GEMMs of a block-scaled layer (forward, input and
    weight gradient), compiled for `mesh`'s GPU."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    dg = fp8ax.Fp8DotGeneral.init(recipe, block_scaled_gemm=block_scaled_gemm)
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16, sharding=rep)
    step = jax.jit(jax.grad(lambda x, w: jnp.sum(dg(x, w, DIMS).astype(jnp.float32) ** 2), argnums=(0, 1)))
    return step.lower(x, w).compile().as_text()


@pytest.mark.parametrize(
    "recipe,values,scales",
    [(fp8ax.MXScaling(), "f8e4m3fn", "f8e8m0fnu"), (fp8ax.NVFP4Scaling(), "f4e2m1fn", "f8e4m3fn")],
    ids=["mxfp8", "nvfp4"],
)
def test_block_gemms_are_blackwell_block_scaled_gemms(b200, recipe, values, scales):
    """On compute capability 10.0, all three GEMMs of an MXFP8 or NVFP4 training step
    become cuDNN's block-scaled GEMM on the low-precision values and their block scales
    (no dequantized copy, no plain GEMM for them); without `block_scaled_gemm` they are
    dequantized and run as plain GEMMs. (NVFP4's Hadamard rotation of the weight
    gradient's operands is a small GEMM of its own, by a 16x16 matrix.)"""
    text = _block_step_program(b200, recipe, True)
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    assert calls.count("__cudnn$blockScaledDot") == 3, sorted(set(calls))
    # The calls' operands (parameters of their fusions): values and block scales.
    got_values = re.findall(r"%(?:lhs|rhs)\.\d+ = (\w+)\[", text)
    got_scales = re.findall(r"%(?:lhs|rhs)_scale\.\d+ = (\w+)\[", text)
    assert len(got_values) == len(got_scales) == 6 and set(got_values) == {values} and set(got_scales) == {scales}
    if isinstance(recipe, fp8ax.MXScaling):
        assert not [c for c in calls if c.startswith("__cublas")], sorted(set(calls))
    plain = re.findall(r'custom_call_target="([^"]+)"', _block_step_program(b200, recipe, False))
    assert "__cudnn$blockScaledDot" not in plain


def _step(mesh, mode, policy=None):
    """`(jitted step, abstract arguments placed on the described H100)`: the gradient of
    one FP8 layer's output, the layer in `mode` (under `jax.checkpoint` with `policy`, if
    one is given)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    dg = fp8ax.Fp8DotGeneral.init(mode=mode)
    rep = NamedSharding(mesh, P())
    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    x, w = abstract(jnp.zeros((256, 512), jnp.bfloat16)), abstract(jnp.zeros((512, 384), jnp.bfloat16))
    arrays, static = eqx.partition(dg, eqx.is_array)
    leaves, tree = jax.tree.flatten(arrays)

    def step(leaves, x, w):
        d = eqx.combine(jax.tree.unflatten(tree, leaves), static)
        loss = lambda d, x, w: jnp.sum(d(x, w, DIMS).astype(jnp.float32) ** 2)  # noqa: E731
        loss = loss if policy is None else jax.checkpoint(loss, policy=policy)
        return jax.grad(loss, argnums=(0, 1, 2))(d, x, w)

    return jax.jit(step), ([abstract(a) for a in leaves], x, w)


def _compile_step(mesh, mode, policy=None):
    step, args = _step(mesh, mode, policy)
    return step.lower(*args).compile().as_text()


@pytest.mark.parametrize("calibrate", [False, True])
def test_a_cpu_program_holds_no_optimization_barrier(calibrate):
    # fp8ax's optimization barriers keep a call's scalar arithmetic apart for XLA:GPU.
    # XLA:CPU in jax 0.12 keeps them through fusion and then computes each scalar they
    # hold in a kernel of its own: bench/state_cost.py's MLP block took 58 kernels
    # against 40 (jax 0.10 drops them before fusing). So a program lowered for CPU has
    # none (`_formats.fenced`); the H100's keeps them (the next test).
    dg = fp8ax.Fp8DotGeneral.init(fp8ax.DelayedScaling(calibrate_first_call=calibrate))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    loss = lambda d, x, w: jnp.sum(d(x, w, DIMS) ** 2)  # noqa: E731
    lowered = eqx.filter_jit(eqx.filter_grad(loss)).lower(dg, x, w)
    text = getattr(lowered, "lowered", lowered).as_text()
    assert "optimization_barrier" not in text


def test_a_gpu_program_keeps_its_optimization_barriers(h100):
    mesh, _ = h100
    step, args = _step(mesh, "direct")
    assert "optimization_barrier" in step.lower(*args).as_text()
    # With the GPU plugin this process can compile for a GPU: both branches are traced.
    assert not _boundaries.lowers_for_cpu_only()


def _grad_jaxpr_and_values(dg, x, w):
    jax.clear_caches()  # (JAX keeps the traces of fp8ax's inner `jit`s)
    # The gradients of the state (its new value), of the input and of the kernel.
    loss = lambda args: jnp.sum(args[0](args[1], args[2], DIMS) ** 2)  # noqa: E731
    jaxpr = str(eqx.filter_make_jaxpr(eqx.filter_grad(loss))((dg, x, w))[0])
    return jaxpr, jax.tree.leaves(eqx.filter_jit(eqx.filter_grad(loss))((dg, x, w)))


@pytest.mark.parametrize("recipe", [fp8ax.DelayedScaling(), fp8ax.CurrentScaling()])
def test_a_cpu_only_process_traces_the_cpu_branch_alone(recipe, getkey, monkeypatch):
    # `_formats.platform_dependent` (the amax, `computed_once`, the delayed-scaling plan,
    # `fenced`): where the process has no backend but its CPU and no GPU plugin, only the
    # CPU's branch is traced, and the step's values are those of the program with both.
    if not _boundaries.lowers_for_cpu_only():
        pytest.skip("this process can compile for a GPU (JAX's GPU plugin is installed)")
    dg = fp8ax.Fp8DotGeneral.init(recipe)
    x, w = jax.random.normal(getkey(), (8, 16)), jax.random.normal(getkey(), (16, 4))
    alone, values = _grad_jaxpr_and_values(dg, x, w)
    assert "platform_index" not in alone and "branches_platforms" not in alone
    monkeypatch.setattr(_boundaries, "_CPU_ONLY", False)
    both, values_both = _grad_jaxpr_and_values(dg, x, w)
    assert "platform_index" in both and "branches_platforms" in both
    assert (
        len(values) == len(values_both) == (3 if isinstance(recipe, fp8ax.DelayedScaling) else 2)
    )  # x, w and the one state
    for a, b in zip(values, values_both):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    monkeypatch.undo()
    jax.clear_caches()  # (the traces with both branches go)


def test_lowers_for_cpu_only_reads_the_backends_once(monkeypatch):
    # Decided at the first call and kept: a registry JAX no longer has means both branches.
    monkeypatch.setattr(_boundaries, "_CPU_ONLY", None)
    from jax._src import xla_bridge

    monkeypatch.delattr(xla_bridge, "_backend_factories")
    assert _boundaries.lowers_for_cpu_only() is False
    monkeypatch.setattr(xla_bridge, "_backend_factories", {"cpu": None, "cuda": None}, raising=False)
    assert _boundaries.lowers_for_cpu_only() is False  # (kept)
    monkeypatch.setattr(_boundaries, "_CPU_ONLY", None)
    assert _boundaries.lowers_for_cpu_only() is False  # a GPU plugin registered
    # The factories JAX registers whatever is installed.
    monkeypatch.setattr(xla_bridge, "_backend_factories", {"cpu": None, "tpu": None, "proxy": None})
    monkeypatch.setattr(_boundaries, "_CPU_ONLY", None)
    cpu_only = set(xla_bridge.backends()) == {"cpu"} and importlib.util.find_spec("libtpu") is None
    assert _boundaries.lowers_for_cpu_only() is cpu_only


@pytest.mark.parametrize("mode", ["direct", "qdq"])
def test_gemm_report_reads_a_gpu_program_compiled_here(h100, mode):
    # `fp8ax.gemm_report` on a step compiled ahead of time for an H100 (this process's
    # GEMM path: Triton GEMM fusions allowed, the default): it names the GPU, and counts
    # the Triton GEMM fusions that multiply FP8 operands (direct mode) and those whose
    # FP8 operands XLA converted to bf16 first (qdq mode on this path).
    mesh, _ = h100
    step, args = _step(mesh, mode)
    report = fp8ax.gemm_report(step, *args)
    assert report.backend == "gpu"
    assert report.compiled_total == 3 and all(g.fp8ax for g in report.compiled), str(report)
    triton = "--xla_gpu_enable_triton_gemm=false" not in os.environ.get("XLA_FLAGS", "")
    if mode == "direct" or not triton:
        assert report.converted_all_fp8, str(report)
    else:
        assert report.compiled_fp8 == 0, str(report)


@pytest.mark.parametrize("mode", ["direct", "qdq"])
def test_default_step_compiles_for_an_h100_without_one(h100, mode):
    mesh, gpu_hlo = h100
    s = gpu_hlo.summary(_compile_step(mesh, mode))
    assert s["host_callbacks"] == 0  # left out of a program this process cannot run
    assert s["gemms"] == 3
    if mode == "direct":  # qdq relies on XLA's pattern, which Triton's GEMM fusions do not take
        assert s["fp8_gemms"] == 3, s["gemm_paths"]


def _readme_step_program(mesh, jit_kwargs) -> str:
    """The optimized HLO of README.md's training step (an Equinox MLP converted by
    `fp8_linear_layers`, `skip_fp8_state(optax.adam)`), compiled for `mesh`'s GPU with
    `jax.jit(..., **jit_kwargs)` (which `eqx.filter_jit` forwards them to)."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    keys = jax.random.split(jax.random.key(0), 2)
    model = fp8ax.fp8_linear_layers(eqx.nn.MLP(512, 384, 1024, 1, key=keys[0]))
    opt = fp8ax.skip_fp8_state(optax.adam(1e-3))

    def step(model, opt_state, x, y):
        loss = lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2)  # noqa: E731
        grads = eqx.filter_grad(loss)(model)
        overwrite, grads = fp8ax.partition_for_grad_overwrite(grads)
        updates, opt_state = opt.update(grads, opt_state, params=model)
        return fp8ax.apply_updates(model, updates, overwrite), opt_state

    # eqx.filter_jit would take abstract leaves of the model for constants: a `jax.jit` of
    # the flattened arrays instead (docs/faq.md), with the same keyword arguments.
    rep = NamedSharding(mesh, P())
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    arrays, static = eqx.partition((model, opt_state), eqx.is_array)
    leaves, tree = jax.tree.flatten(arrays)

    def flat_step(leaves, x, y):
        return jax.tree.leaves(
            eqx.filter(step(*eqx.combine(jax.tree.unflatten(tree, leaves), static), x, y), eqx.is_array)
        )

    abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)  # noqa: E731
    args = [abstract(a) for a in leaves], abstract(jnp.zeros((256, 512))), abstract(jnp.zeros((256, 384)))
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam raises a float to its int32 count
        return jax.jit(flat_step, **jit_kwargs).lower(*args).compile().as_text()


def test_compiler_options_give_the_readme_step_cublaslt_fp8_gemms(h100):
    """`fp8ax.compiler_options()` in the step's `eqx.filter_jit`, with no `XLA_FLAGS`:
    the five GEMMs of README's step (two layers' forward and weight-gradient GEMMs, the
    second layer's input gradient) are cuBLASLt's FP8 GEMMs, none a Triton GEMM fusion (whose FP8 candidates take minutes to autotune). The
    same step compiled without them has Triton's GEMM fusions (XLA's default here)."""
    mesh, gpu_hlo = h100
    if "triton_gemm" in os.environ.get("XLA_FLAGS", ""):
        pytest.skip("XLA_FLAGS sets Triton's GEMMs for the whole process")
    fast = gpu_hlo.summary(_readme_step_program(mesh, {"compiler_options": fp8ax.compiler_options()}))
    assert fast["gemms"] == 5 and fast["fp8_gemms"] == 5, fast["gemm_paths"]
    assert all(p.startswith("cublas:fp8") for p in fast["gemm_paths"]), fast["gemm_paths"]
    default = gpu_hlo.summary(_readme_step_program(mesh, {}))
    assert any(p.startswith("triton:") for p in default["gemm_paths"]), default["gemm_paths"]


def test_saved_fp8_residuals_still_feed_fp8_gemms(h100):
    # Under a policy that saves residuals, the backward GEMMs read the forward's FP8
    # copies back from their bits (src/fp8ax/_gemm/residuals.py): still FP8 GEMMs.
    mesh, gpu_hlo = h100
    s = gpu_hlo.summary(_compile_step(mesh, "direct", jax.checkpoint_policies.everything_saveable))
    assert s["gemms"] == 3 and s["fp8_gemms"] == 3, s["gemm_paths"]


def _train_step_programs(paths: str, variants: str, tmp_path) -> dict:
    # bench/gpu_aot.py: the bench MLP block's train step (SGD, bf16 parameters, two
    # bias-free Haliax linear layers and a GELU: 5 GEMMs) at its full size (8192 tokens,
    # 4096 -> 14336 -> 4096: the shapes change the program, at a sixteenth of them XLA
    # splits the weight-gradient GEMMs' K into float32 partial sums; they do not change
    # the compile time), compiled for an H100 in a subprocess per GEMM path (XLA reads
    # its flags once per process).
    import json
    import subprocess

    out = tmp_path / "aot.json"
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_aot.py"),
            "--steps",
            "mlp",
            "--paths",
            paths,
            "--variants",
            variants,
            "--repeat",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())["results"]


def test_train_step_program_is_what_the_design_says(h100, tmp_path):
    # `calibrate_first_call=False` (fp8ax_direct, fp8ax_qdq) and the default, whose one
    # program serves every step (fp8ax_direct_first): each GEMM on FP8 operands, in both
    # GEMM paths for direct mode and on cuBLASLt for qdq (Triton's GEMM fusions do not take
    # XLA's dequantize pattern, for Haliax's FP8 neither); each GEMM writes the layer's
    # dtype (bf16); no conditional; no host callback. Without first-call calibration no FP8
    # cast waits on a reduction of its own input; with it, each cast's scale is a select
    # on its tensor's own amax, so its casts wait (on every step).
    # Against Haliax's FP8 step: fewer kernels (a layer's three scaling states are
    # computed on together, one GEMM's output scale beside them), and no more HBM bytes
    # outside the GEMMs (up to 0.2 MB of state arithmetic, of 3.5 GB: fp8ax keeps the
    # amaxes in float32 where Haliax rounds them to bf16, and stacks a layer's three
    # states, each one array of unit, scale and history, to read them together; 0.107 MB
    # over Haliax's since the state became one array per operand, 2026-11-28).
    results = _train_step_programs("triton,cublas", "haliax_fp8,fp8ax_direct,fp8ax_qdq,fp8ax_direct_first", tmp_path)
    for path, by_variant in results.items():
        haliax, ours = by_variant["mlp/haliax_fp8"], by_variant["mlp/fp8ax_direct"]
        assert ours["kernels"] < haliax["kernels"], (path, ours["kernels"], haliax["kernels"])
        assert ours["non_gemm_bytes"] <= haliax["non_gemm_bytes"] + 2e5, (
            path,
            ours["non_gemm_bytes"],
            haliax["non_gemm_bytes"],
        )
        for variant in ("fp8ax_direct", "fp8ax_qdq", "fp8ax_direct_first"):
            info = by_variant[f"mlp/{variant}"]
            where = f"{path} {variant}: {info.get('gemm_paths', info)}"
            assert "error" not in info, where
            assert info["gemms"] == 5, where
            if variant != "fp8ax_qdq" or path == "cublas":
                assert info["fp8_gemms"] == 5, where
            assert set(info["gemm_out_dtypes"]) == {"bf16"}, where
            assert info["conditionals"] == 0 and info["host_callbacks"] == 0, where
            if variant != "fp8ax_direct_first":
                assert info["waiting_casts"] == [], where


def test_fp8_all_gather_halves_the_fsdp_gathers_on_8_h100s(h100):
    # bench/multigpu_collectives.py: an FSDP step over a described host of 8 H100s. With
    # `fp8_all_gather`, every all-gather of the plain bf16 step that carries a weight
    # carries it in E4M3 instead, once per step: exactly half the bytes (the biases stay
    # bf16); the reduce-scatters of the bf16 gradients do not change.
    from jax.experimental import topologies

    bench = _load("multigpu_collectives")
    topo = topologies.get_topology_desc(platform="cuda", target_config=bench.H100_TARGET, topology="1x1x8")
    mesh = topologies.make_mesh(topo, (8,), ("data",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plain = bench.collectives(bench.compile_variant(mesh, None))
        fp8 = bench.collectives(bench.compile_variant(mesh, fp8ax.Fp8Config(fp8_all_gather=True)))
    gathered_plain, gathered_fp8 = plain["all-gather"]["bytes_by_dtype"], fp8["all-gather"]["bytes_by_dtype"]
    assert set(gathered_plain) == {"bf16"} and set(gathered_fp8) == {"bf16", "f8e4m3fn"}, (plain, fp8)
    assert plain["all-gather"]["count"] == fp8["all-gather"]["count"] == 3 * bench.N_BLOCKS, (plain, fp8)
    weights = 2 * bench.N_BLOCKS * bench.Embed.size * bench.Mlp.size
    assert gathered_fp8["f8e4m3fn"] == weights and gathered_plain["bf16"] - gathered_fp8["bf16"] == 2 * weights
    assert fp8["reduce-scatter"] == plain["reduce-scatter"]


def _forward_dot_result_types(dg, x, w) -> list[str]:
    text = jax.jit(lambda d, x, w: d(x, w, DIMS)).trace(dg, x, w).lower().as_text()
    return [line.rsplit("->", 1)[1].strip() for line in text.splitlines() if "dot_general" in line]


def test_direct_gemm_writes_a_16_bit_layer_dtype():
    # The GEMM's own output is the layer's dtype (XLA:GPU then scales and converts in the
    # GEMM's epilogue); a float32 layer keeps the float32 product.
    dg = fp8ax.Fp8DotGeneral.init(mode="direct")
    k = jax.random.split(jax.random.key(1), 2)
    x, w = jax.random.normal(k[0], (32, 256)), jax.random.normal(k[1], (256, 48))
    assert _forward_dot_result_types(dg, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)) == ["tensor<32x48xbf16>"]
    assert _forward_dot_result_types(dg, x, w) == ["tensor<32x48xf32>"]


def test_direct_bf16_output_against_a_replay():
    # Independent replay with ml_dtypes: fresh state with the first-call calibration, so
    # each operand's scale is amax / 448 (E4M3, current scaling on the first call); the values are x / scale cast
    # to E4M3; the product is accumulated exactly (float64), rounded to bf16, multiplied
    # by bf16(scale_x * scale_w) and rounded again. XLA accumulates in float32, in its own
    # order, so the result may round the other way: at most 1 bf16 ulp (2**-7 relative).
    import ml_dtypes
    import numpy as np

    dg = fp8ax.Fp8DotGeneral.init(fp8ax.DelayedScaling(calibrate_first_call=True), mode="direct")
    k = jax.random.split(jax.random.key(2), 2)
    x = (3 * jax.random.normal(k[0], (16, 512))).astype(jnp.bfloat16)
    w = jax.random.normal(k[1], (512, 24)).astype(jnp.bfloat16)
    got = np.asarray(dg(x, w, DIMS).astype(jnp.float32))

    def quantize(a):
        a = np.asarray(a.astype(jnp.float32))
        scale = np.float32(np.abs(a).max()) / np.float32(448)
        return (a / scale).astype(ml_dtypes.float8_e4m3fn), scale

    qx, sx = quantize(x)
    qw, sw = quantize(w)
    acc = qx.astype(np.float64) @ qw.astype(np.float64)
    scale = np.float32(sx * sw).astype(ml_dtypes.bfloat16).astype(np.float32)
    want = acc.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) * scale
    want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=0)
    assert np.mean(got == want) > 0.99  # almost all bit for bit


@pytest.mark.parametrize("per_expert", [False, True], ids=["tensor", "per_expert"])
def test_grouped_gemms_run_on_fp8_operands(h100, per_expert):
    """An `Fp8RaggedDot`'s three grouped GEMMs (forward, input and weight gradient) are
    FP8 GEMMs in the H100 program, with no FP8 operand dequantized first. (XLA:GPU
    expands a ragged dot into a dense GEMM over every expert, masked: bench/moe.py
    measures that; this checks that the operands reach it in FP8.)"""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh, gpu_hlo = h100
    recipe = fp8ax.DelayedScaling(calibrate_first_call=False)
    op = fp8ax.Fp8RaggedDot.init(recipe, num_experts=4, per_expert_weights=per_expert)
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((4, 256, 384), jnp.bfloat16, sharding=rep)
    sizes = jnp.array([100, 0, 300, 112], jnp.int32)
    loss = lambda x, w: jnp.sum(op(x, w, sizes).astype(jnp.float32) ** 2)  # noqa: E731
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    summary = gpu_hlo.summary(text)
    assert summary["gemms"] == summary["fp8_gemms"] == 3, summary["gemm_paths"]
