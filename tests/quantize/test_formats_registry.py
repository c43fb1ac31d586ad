"""A weight format is one registry entry plus its codec (circleops.quantize.formats): this
test registers one that exists only here, a Q8_0 whose values are truncated toward zero
instead of rounded, and converts, writes, verifies and runs a model with it; the option
checks, the CLI's choices and the weight pass all learn of it from the entry alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.errors import TargetError
from circleops.quantize import WEIGHT_FORMATS, WEIGHT_ONLY_FORMATS, formats, ggml
from circleops.runtime import reference
from circleops.serialize import read_model

NAME = "q8_0-trunc"
BLOCK = 32  # the codec interface: K must be a multiple of it


def encode(weight, dtype, importance=None):
    """GGML_Q8_0 blocks (fp16 d + 32 int8) with q = trunc(x / d): another codec for the
    same TensorType, so the interpreter's kernel runs it and the bytes show whose it is."""
    w = (weight.detach() if isinstance(weight, torch.Tensor) else torch.as_tensor(weight)).float().numpy()
    x = w.reshape(-1, BLOCK)
    d = (np.abs(x).max(axis=1) / 127).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d.astype(np.float32)))
    q = np.clip(np.trunc(x * inv[:, None]), -127, 127).astype(np.int8)
    return np.concatenate([d[:, None].view(np.uint8), q.view(np.uint8)], axis=1).reshape(-1)


def decode(packed, dtype, shape):
    return ggml.decode(packed, dtype, shape)


def decode_into(packed, dtype, out):
    return ggml.decode_into(packed, dtype, out)


@pytest.fixture
def registered():
    fmt = formats.register(formats.WeightFormat(
        NAME, "GGML_Q8_0 linear weights, truncated (a test's format)", formats.WEIGHTS, "GGML_Q8_0", __name__,
        file_formats=frozenset({"circle"}), target_refusal="is a Circle-only test format",
        runtimes=frozenset({"reference"})))
    yield fmt
    formats.unregister(NAME)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32)).eval()


def test_a_format_registered_in_a_test_converts_verifies_and_runs(tmp_path, registered):
    import argparse

    from circleops.cli import convert as cli_convert

    assert NAME in WEIGHT_FORMATS and WEIGHT_ONLY_FORMATS[NAME] == "GGML_Q8_0"
    parser = argparse.ArgumentParser()
    cli_convert.add_arguments(parser)
    assert NAME in next(a for a in parser._actions if "--quantize" in a.option_strings).choices

    model, x = _model(), torch.randn(3, 64)
    path = tmp_path / "m.circle"
    report = circleops.convert(model, (x,), path, target="circle", quantize=NAME, verify="reference")
    assert report.verify.passed and report.quantization.format == NAME
    assert [w.dtype for w in report.quantization.weights] == ["GGML_Q8_0", "GGML_Q8_0"]

    weights = {t.name: t for t in read_model(path).subgraphs[0].tensors if t.dtype == "GGML_Q8_0"}
    assert len(weights) == 2
    for name, layer in (("0.weight", model[0]), ("2.weight", model[2])):
        stored = np.asarray(weights[name].data).reshape(-1)
        assert np.array_equal(stored, encode(layer.weight, "GGML_Q8_0"))  # the test's codec wrote it
        assert not np.array_equal(stored, ggml.quantize(layer.weight, "GGML_Q8_0"))  # not ggml's rounding

    # the interpreter computes with the truncated values (and, as onert, each input rounded
    # to Q8_0): torch on them gives the same
    q8 = ggml.quantize_q8_0_input
    with torch.no_grad():
        h = torch.relu(q8(x) @ decode(encode(model[0].weight, ""), "GGML_Q8_0", (96, 64)).T + model[0].bias)
        want = q8(h) @ decode(encode(model[2].weight, ""), "GGML_Q8_0", (32, 96)).T + model[2].bias
    (got,) = reference.run(str(path), [x.numpy()])
    assert np.abs(got - want.numpy()).max() < 1e-4


def test_a_registered_format_refuses_the_targets_its_entry_refuses(tmp_path, registered):
    with pytest.raises(TargetError, match=f"quantize='{NAME}' is a Circle-only test format"):
        circleops.convert(_model(), (torch.randn(1, 64),), tmp_path / "m.tflite", target="tflite", quantize=NAME)


def test_an_unregistered_format_is_unknown(tmp_path):
    assert NAME not in WEIGHT_FORMATS
    with pytest.raises(TargetError, match=f"unknown quantize='{NAME}'"):
        circleops.convert(_model(), (torch.randn(1, 64),), tmp_path / "m.circle", quantize=NAME)
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.get("q8_0"))
