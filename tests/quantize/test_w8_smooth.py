"""SmoothQuant folding for --quantize w8 (circleops.quantize.smooth): exact in fp32, the user's
model unchanged, convert --verify with it, and a smaller w8 error where an input channel
carries outliers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.quantize.smooth import ALPHA, find_groups, smoothed
from families import BY_NAME, example_ids


def _llama(outlier: float | None = None) -> torch.nn.Module:
    model = BY_NAME["llama"].build()
    if outlier is not None:
        # channel 3 of every RMSNorm output (the q/k/v and gate/up inputs) `outlier` times the others:
        # onert's per-row int8 step (max|x_row| / 127) is then about outlier/127 of a typical value
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight.fill_(1.0)
                    norm.weight[3] = outlier
    return model.eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def test_finds_every_llama_layer():
    model = _llama()
    groups = find_groups(model)
    assert [g["layer"] for g in groups] == [f"model.layers.{k}" for k in range(len(model.model.layers))]


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_fold_is_exact_in_fp32_and_restored(alpha):
    model = _llama(outlier=30.0)
    ids = example_ids(16)
    want = _logits(model, ids)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with smoothed(model, alpha=alpha) as report:
        assert report.linears == 6 * len(model.model.layers) and report.layers == len(model.model.layers)
        layer = model.model.layers[0]
        assert not torch.equal(layer.input_layernorm.weight, before["model.layers.0.input_layernorm.weight"])
        assert not torch.equal(layer.mlp.down_proj.weight, before["model.layers.0.mlp.down_proj.weight"])
        got = _logits(model, ids)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())  # bit for bit, the same tensors


def test_off_switch_and_no_pattern(monkeypatch):
    model = _llama()
    monkeypatch.setenv("CIRCLEOPS_W8_SMOOTH", "off")
    with smoothed(model) as report:
        assert report.linears == 0 and "off" in report.summary_line()
    monkeypatch.delenv("CIRCLEOPS_W8_SMOOTH")
    mlp = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with smoothed(mlp, (torch.randn(4, 40),)) as report:
        assert report.linears == 0 and report.summary_line().startswith("no SmoothQuant")


def test_convert_w8_verify_names_the_smoothing_and_leaves_the_model(tmp_path):
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = circleops.convert(model, (example_ids(16),), tmp_path / "m.circle", target="onert", quantize="w8",
                               verify=True)
    assert report.verify.passed
    layers = len(model.model.layers)
    lines = report.quantization.summary_lines()
    assert any(f"SmoothQuant (alpha {ALPHA:g}," in line and f"{6 * layers} linears in {layers} decoder layers" in line
               for line in lines), lines
    assert report.quantization.to_dict()["smoothing"].startswith("SmoothQuant")
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())


def test_smoothing_lowers_the_w8_error_with_an_outlier_channel(tmp_path, monkeypatch):
    """Norm outputs with one channel 100x the others: unsmoothed, each q/k/v and gate/up input row
    is quantized with a step of ~0.8 typical values (most of them round to 0); smoothed, the
    outlier channel is divided by m_3 ~ 100^alpha relative to the rest, the step several times finer."""
    from circleops.runtime import reference  # onert's kernel exactly (onert itself may differ by a quantum per row)

    model = _llama(outlier=100.0)
    ids = example_ids(16)
    want = _logits(model, ids)[0].numpy()
    errors, ops = {}, {}
    for setting in ("off", "default"):
        if setting == "off":
            monkeypatch.setenv("CIRCLEOPS_W8_SMOOTH", setting)
        else:
            monkeypatch.delenv("CIRCLEOPS_W8_SMOOTH")
        path = tmp_path / f"m_{setting}.circle"
        # no verify: torch's reference has fp32 activations, and the unsmoothed file's error from
        # quantizing them is what this measures (above verify's tolerance)
        ops[setting] = circleops.convert(model, (ids,), path, target="onert", quantize="w8").ops
        got = reference.run(path, [ids.numpy()])[0][0]
        errors[setting] = float(np.sqrt(np.mean((got.astype(np.float64) - want) ** 2)))
    assert ops["default"] == ops["off"]  # the same graph: smoothing only changes weight values
    assert errors["default"] < 0.5 * errors["off"], errors  # measured 0.0032 vs 0.0086 (RMS of the logits error)


def test_convert_graphs_w8_smooths_and_restores(tmp_path, monkeypatch):
    """The fold is undone once the files are written, before verify's runtime runs them (the
    folded weights are written pages: the 1B shape's 4.5 GB beside the runtime's child;
    a mapped weight's restore drops them, tests/quantize/test_weight_memory.py)."""
    from circleops.generation.generator import Generator
    from circleops.package.manifest import read_manifest
    from circleops.recipes.llm import LLMRecipe, convert_graphs

    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    restored, compare = [], LLMRecipe.compare

    def spy(self, *args, **kwargs):
        restored.append(all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()))
        return compare(self, *args, **kwargs)

    monkeypatch.setattr(LLMRecipe, "compare", spy)
    report = convert_graphs(model, tmp_path / "g", target="onert", prefill_len=8, max_cache_len=32, verify=True,
                            quantize="w8")
    assert report.quantization.smoothing.startswith(f"SmoothQuant (alpha {ALPHA:g},")
    assert restored == [True]  # the files were compared once, on the model's own weights again
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    gen = Generator(read_manifest(tmp_path / "g")).generate([5, 17, 42], 4)
    assert len(gen.tokens) == 4 or gen.stopped_at_eos
