"""conversion_report: what fp8_linear_layers converts, skips and cannot convert, and why."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import fp8ax
from helpers import Deep, Layers


class CNN(eqx.Module):
    """Equinox's MNIST CNN: a convolution, then three linear layers."""

    layers: list

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=k1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=k2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=k3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=k4),
        ]


def _converted_paths(model, converted):
    """Paths of the layers fp8_linear_layers really made FP8 (found independently of the report)."""
    return [
        p
        for p, old, new in ((f"layers.{i}", a, b) for i, (a, b) in enumerate(zip(model.layers, converted.layers)))
        if isinstance(new, fp8ax.Fp8Linear) and not isinstance(old, fp8ax.Fp8Linear)
    ]


@pytest.mark.parametrize("config", [None, fp8ax.Fp8Config(min_features=64), fp8ax.Fp8Config(targets=["layers.5"])])
def test_conv_and_linear(getkey, config):
    model = CNN(getkey())
    report = fp8ax.conversion_report(model, config)
    # The report and the transform agree, layer by layer.
    assert report.converted == _converted_paths(model, fp8ax.fp8_linear_layers(model, config))
    assert report.unsupported == ["layers.0"]
    conv = report.layers[0]
    assert (conv.kind, conv.in_features, conv.out_features, conv.action) == ("eqx.nn.Conv2d", 1, 3, "unsupported")
    assert "convolution" in conv.reason
    assert [(r.path, r.in_features, r.out_features) for r in report.layers[1:]] == [
        ("layers.3", 1728, 512),
        ("layers.5", 512, 64),
        ("layers.7", 64, 10),
    ]
    assert report.problem is None


def test_reasons_and_table(getkey):
    model = CNN(getkey())
    report = fp8ax.conversion_report(model, fp8ax.Fp8Config(targets=r"layers\.[37]", min_features=64))
    by_path = {r.path: r for r in report.layers}
    assert by_path["layers.3"].action == "convert"
    assert by_path["layers.5"].action == "skip" and by_path["layers.5"].reason == "not selected by `targets`"
    assert by_path["layers.7"].action == "skip"
    assert by_path["layers.7"].reason == "output size 10 < `min_features` (64)"
    assert report.skipped == ["layers.5", "layers.7"]
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == (
        r"fp8_linear_layers with targets='layers\\.[37]', min_features=64: 1 of 3 linear layers converted to FP8 "
        "(2 skipped, 1 other layer not converted)"
    )
    assert lines[1].split() == ["path", "kind", "in", "out", "decision", "reason"]
    assert lines[3].split()[:5] == ["layers.3", "eqx.nn.Linear", "1728", "512", "FP8"]
    assert lines[5].split()[:5] == ["layers.7", "eqx.nn.Linear", "64", "10", "skipped"]
    # Columns line up: every row's decision starts at the header's column.
    col = lines[1].index("decision")
    assert all(line[col:].split()[0] in ("decision", "FP8", "skipped", "not") for line in lines[1:])


def test_a_config_that_would_raise_is_reported_not_raised(getkey):
    model = CNN(getkey())
    config = fp8ax.Fp8Config(targets=["layers.3", "layer.5"])
    with pytest.raises(ValueError) as raised:
        fp8ax.fp8_linear_layers(model, config)
    report = fp8ax.conversion_report(model, config)
    assert report.problem == str(raised.value)
    assert str(report).splitlines()[-1] == f"fp8_linear_layers would raise: {raised.value}"
    assert fp8ax.conversion_report(model, fp8ax.Fp8Config(min_features=4096)).problem.startswith(
        "`config.min_features` (4096) skips all 3"
    )
    no_linear = fp8ax.conversion_report([eqx.nn.Conv1d(2, 2, 3, key=getkey())])
    assert no_linear.unsupported == ["0"] and "found no linear layer" in no_linear.problem


def test_attention_embedding_and_recurrent_cells_are_listed(getkey):
    model = {
        "attn": eqx.nn.MultiheadAttention(2, 16, key=getkey()),
        "emb": eqx.nn.Embedding(10, 16, key=getkey()),
        "gru": eqx.nn.GRUCell(4, 8, key=getkey()),
        "up": eqx.nn.ConvTranspose2d(2, 4, 3, key=getkey()),
    }
    report = fp8ax.conversion_report(model)
    assert [(r.path, r.action) for r in report.layers] == [
        ("attn", "unsupported"),
        ("attn.query_proj", "convert"),
        ("attn.key_proj", "convert"),
        ("attn.value_proj", "convert"),
        ("attn.output_proj", "convert"),
        ("emb", "unsupported"),
        ("gru", "unsupported"),
        ("up", "unsupported"),
    ]
    assert "attention-score matmuls" in report.layers[0].reason
    assert (report.layers[5].in_features, report.layers[5].out_features) == (10, 16)


@pytest.mark.needs_hax_dot
def test_haliax_stacked_and_already_converted(getkey):
    import haliax as hax

    model = Deep.init(key=getkey())
    config = fp8ax.Fp8Config(min_features=9)
    report = fp8ax.conversion_report(model, config)
    assert [(r.path, r.kind, r.in_features, r.out_features, r.stacked, r.action) for r in report.layers] == [
        ("blocks.stacked.mlp.up_proj", "hax.nn.Linear", 16, 32, (Layers.size,), "convert"),
        ("blocks.stacked.mlp.down_proj", "hax.nn.Linear", 32, 16, (Layers.size,), "convert"),
        ("head", "hax.nn.Linear", 16, 8, (), "skip"),
    ]
    assert "hax.nn.Linear x3" in str(report)
    # On the converted model the FP8 layers are kept, and the default config would convert the head.
    again = fp8ax.conversion_report(fp8ax.fp8_linear_layers(model, config))
    assert [r.action for r in again.layers] == ["keep", "keep", "convert"]
    assert again.layers[0].reason == "already FP8 (fp8ax); its state is kept"
    # Haliax's own FP8 op is left alone, and says so.
    own = eqx.tree_at(
        lambda m: m.head,
        model,
        hax.nn.Linear.init(
            model.head.In, model.head.Out, key=getkey(), dot_general=hax.quantization.Fp8DotGeneralOp.init()
        ),
    )
    row = fp8ax.conversion_report(own).layers[-1]
    assert row.action == "keep" and "Fp8DotGeneralOp" in row.reason


def test_bad_arguments(getkey):
    with pytest.raises(TypeError, match="`config` must be an `fp8ax.Fp8Config`, got dict"):
        fp8ax.conversion_report(CNN(getkey()), {"min_features": 3})
    with pytest.raises(ValueError, match="`action` must be 'convert', 'keep', 'skip' or 'unsupported', got 'fp8'"):
        fp8ax.conversion_report(CNN(getkey())).paths("fp8")
