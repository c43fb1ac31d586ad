"""Integer TFLite: ``--target tflite --quantize uint8|int16`` writes a full-integer .tflite
that LiteRT runs (int8 activations for uint8, 16x8 for int16), checked in LiteRT against
the fake-quantized (convert_pt2e) module the file was made from, in quantization steps of
the output; and the refusals that come before any work.

The single-op files pin what LiteRT 2.3.0's integer kernels need (targets.TFLITE's
quantized_* fields): a kernel fact that changes turns one of them red.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import circleops
from circleops.errors import TargetError
from circleops.pipeline.stages import export, export_module, hf_export_settings
from circleops.quantize import pt2e
from circleops.quantize.integer.masks import finite_masks

from rounding import pt2e_rounding_depth
from tflite_util import RESOLVERS, litert, opname, read

# conftest.py's cross-check (LiteRT against the reference interpreter) compares these files
# within rounding.integer_output_bounds: per op one kernel deviation of its output scale.
INTEGER_TYPES = {"INT8", "INT16", "INT32", "INT64"}
# LiteRT vs the fake-quantized module, in output steps: per activation rounding on the graph's
# deepest path (rounding.pt2e_rounding_depth) one kernel's deviation from torch's float
# rounding: int8 kernels 0-1 step, LiteRT's int16 LOGISTIC/SOFTMAX/TANH/RSQRT table lookups
# 1-3 steps (rounding.INTEGER_LUT_STEPS, the one-op files)
STEPS_PER_ROUNDING = {"uint8": 1, "int16": 3}


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    return transformers.LlamaForCausalLM(config).eval(), torch.randint(0, 256, (1, 16))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(12, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 5)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        h = torch.nn.functional.silu(self.b(h)) + h
        return torch.softmax(self.c(h), -1)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 16, 3, stride=2)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.nn.functional.max_pool2d(torch.relu(self.c1(x)), 2)
        g = self.c2(h)
        h = torch.sigmoid(g) * g.mean((2, 3), keepdim=True) + torch.tanh(g)
        return self.head(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def _fake_quantized(module, args, scheme, samples, *, llm=False):
    """(converted module, its program): what the file is checked against."""
    if llm:
        with hf_export_settings(module):
            wrapped = export_module(module)
            ep = export(wrapped, args, adapters=False)
    else:
        wrapped, ep = module, torch.export.export(module, args, strict=False)
    finite_masks(ep)
    with torch.no_grad():
        return pt2e.quantize(wrapped, args, pt2e.make_quantizer(scheme), samples, exported=ep)


def _output_step(path) -> float:
    """The scale of the integer tensor the file dequantizes into its (first) output."""
    m = read(path)
    sg = m.subgraphs[0]
    deq = next(op for op in sg.operators if op.outputs[0] == sg.outputs[0])
    assert opname(m, deq) == "DEQUANTIZE"
    return float(sg.tensors[deq.inputs[0]].quantization.scale[0])


def _types(path) -> list[tuple[str, set[str], set[str]]]:
    from ai_edge_litert import schema_py_generated as s

    names = {v: k for k, v in vars(s.TensorType).items() if not k.startswith("_")}
    m = read(path)
    sg = m.subgraphs[0]
    return [(opname(m, op), {names[sg.tensors[i].type] for i in op.inputs if i >= 0},
             {names[sg.tensors[i].type] for i in op.outputs}) for op in sg.operators]


def _assert_full_integer(path, scheme):
    """Every op between the input QUANTIZE (or the ids' GATHER) and the output DEQUANTIZE
    computes on integer tensors; no UINT8 tensor (TFLite's int8 activations); no composite."""
    act = {"uint8": "INT8", "int16": "INT16"}[scheme]
    ops = _types(path)
    for name, ins, outs in ops:
        assert name != "STABLEHLO_COMPOSITE"
        if name == "DEQUANTIZE":
            assert ins == {act} and outs == {"FLOAT32"}
        elif name == "QUANTIZE":
            assert outs == {act}
        else:
            assert ins | outs <= INTEGER_TYPES and act in outs, (name, ins, outs)
    m = read(path)
    for t in m.subgraphs[0].tensors:
        assert t.type != 3  # UINT8
        if t.type == 9 and t.quantization is not None and t.quantization.scale is not None \
                and len(t.quantization.scale) == 1:
            assert -128 <= int(t.quantization.zeroPoint[0]) <= 127  # int8 asymmetric activations
    return ops


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
def test_tiny_llama_in_litert_matches_fake_quant(tmp_path, scheme):
    model, ids = _llama()
    samples = pt2e.calibration_samples((ids,), 2, vocab_size=256)
    converted, ep = _fake_quantized(model, (ids,), scheme, samples, llm=True)
    path = tmp_path / f"llama-{scheme}.tflite"
    circleops.save(ep, path, target="tflite")
    ops = _assert_full_integer(path, scheme)
    names = {n for n, _, _ in ops}
    # RMSNorm, RoPE and attention as LiteRT's integer builtins
    assert {"MEAN", "RSQRT", "BATCH_MATMUL", "SOFTMAX", "FULLY_CONNECTED", "MUL", "ADD"} <= names
    with torch.no_grad():
        want = converted(ids).numpy() if not isinstance(converted(ids), tuple) else converted(ids)[0].numpy()
    step = _output_step(path)
    bound = STEPS_PER_ROUNDING[scheme] * pt2e_rounding_depth(converted.graph) + 1e-3  # + the float division
    for resolver in RESOLVERS:
        got = litert(path, [ids.numpy()], resolver)[0]
        steps = float(np.abs(got - want).max()) / step
        assert steps <= bound, (resolver, steps, bound)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_small_nets_in_litert_match_fake_quant(tmp_path, scheme, net):
    torch.manual_seed(0)
    model, x = (MLP(), torch.randn(4, 12)) if net == "mlp" else (CNN(), torch.randn(1, 3, 16, 16))
    model.eval()
    samples = pt2e.calibration_samples((x,), 4)
    converted, ep = _fake_quantized(model, (x,), scheme, samples)
    path = tmp_path / f"{net}-{scheme}.tflite"
    circleops.save(ep, path, target="tflite")
    _assert_full_integer(path, scheme)
    with torch.no_grad():
        want = converted(x).numpy()
    step = _output_step(path)
    bound = STEPS_PER_ROUNDING[scheme] * pt2e_rounding_depth(converted.graph) + 1e-3
    for resolver in RESOLVERS:
        got = litert(path, [x.numpy()], resolver)[0]
        steps = float(np.abs(got - want).max()) / step
        assert steps <= bound, (resolver, steps, bound)


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
def test_convert_verifies_in_litert(tmp_path, scheme):
    """circleops.convert(..., target="tflite", quantize=...): the unfused model, calibrated,
    written and verified in LiteRT against the fake-quantized module."""
    model, ids = _llama()
    path = tmp_path / "m.tflite"
    report = circleops.convert(model, (ids,), path, target="tflite", quantize=scheme, calibrate=2, verify=True,
                               rotate="off")
    assert report.verify.runtime == "litert" and report.verify.passed
    assert report.fused == {} or not any(report.fused.values())
    _assert_full_integer(path, scheme)


def test_cli_convert_and_inspect_show_quantized_tensors(tmp_path, capsys):
    from circleops.cli import main

    model, ids = _llama()
    model.save_pretrained(tmp_path / "hf")
    out = tmp_path / "m.tflite"
    assert main(["convert", str(tmp_path / "hf"), "-o", str(out), "--seq-len", "8", "--target", "tflite",
                 "--quantize", "int16", "--calibrate", "1", "--verify"]) == 0
    assert "verify:  litert" in capsys.readouterr().out
    assert main(["inspect", str(out), "--tensors"]) == 0
    text = capsys.readouterr().out
    assert "INT16" in text and "INT8" in text and "scale" in text


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantize="uint8", fuse="adapters"), "fuse='adapters'.*no integer RMS_NORM"),
    (dict(quantize="int16", fuse="patterns"), "fuse='patterns'"),
    (dict(quantize="int16", int16=["mlp"]), "int16 parts"),
])
def test_refused_before_any_work(tmp_path, kwargs, match):
    model, ids = _llama()
    with pytest.raises(TargetError, match=match):
        circleops.convert(model, (ids,), tmp_path / "m.tflite", target="tflite", calibrate=1, **kwargs)
    assert not list(tmp_path.iterdir())


def test_op_without_integer_form_is_named(tmp_path):
    class Abs(torch.nn.Module):
        def forward(self, x):
            return torch.abs(x) * x

    with pytest.raises(TargetError, match=r"target tflite: ABS .*would compute in float.*target 'circle'"):
        circleops.convert(Abs(), (torch.randn(2, 8),), tmp_path / "m.tflite", target="tflite", quantize="uint8",
                          calibrate=1)
    assert not list(tmp_path.iterdir())


def test_fused_program_is_refused_for_tflite(tmp_path):
    """A PT2E program quantized with the fused ops (what target circle takes) has no integer
    form in TFLite: the composite is named."""
    model, ids = _llama()
    with hf_export_settings(model):
        wrapped = export_module(model)
        ep = export(wrapped, (ids,), adapters=True)
    with torch.no_grad():
        _, qep = pt2e.quantize(wrapped, (ids,), pt2e.make_quantizer("int16"), [(ids,)], exported=ep)
    with pytest.raises(TargetError, match="fused op .*no integer composite"):
        circleops.save(qep, tmp_path / "m.tflite", target="tflite")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- LiteRT's kernels, one op a file

def _one_op_file(tmp_path, fn, scheme, *shapes):
    class One(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    torch.manual_seed(0)
    args = tuple(torch.randn(*s) for s in shapes)
    path = tmp_path / "one.tflite"
    circleops.convert(One(), args, path, target="tflite", quantize=scheme, calibrate=4)
    return path, args


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
def test_concatenation_inputs_take_the_output_parameters(tmp_path, scheme):
    """int8 CONCATENATION refuses inputs with other parameters, int16 copies them unscaled:
    each such input gets a QUANTIZE to the output's parameters first."""
    path, (x, y) = _one_op_file(tmp_path, lambda x, y: torch.cat([x, 3 * y], -1), scheme, (2, 4), (2, 4))
    names = [n for n, _, _ in _types(path)]
    assert "CONCATENATION" in names and names.count("QUANTIZE") >= 3  # 2 inputs + a requantize
    want = torch.cat([x, 3 * y], -1).numpy()
    got = litert(path, [x.numpy(), y.numpy()], "builtin")[0]
    assert float(np.abs(got - want).max()) <= 4 * _output_step(path) + 1e-6


def test_int8_neg_is_written_as_sub(tmp_path):
    """LiteRT's int8 NEG negates the stored value (255 steps off with a zero point): SUB(0, x)."""
    path, (x,) = _one_op_file(tmp_path, lambda x: -torch.relu(x) + 0.5 * x, "uint8", (4, 8))
    names = [n for n, _, _ in _types(path)]
    assert "NEG" not in names and "SUB" in names
    want = (-torch.relu(x) + 0.5 * x).numpy()
    got = litert(path, [x.numpy()], "builtin")[0]
    assert float(np.abs(got - want).max()) <= 4 * _output_step(path)


def test_int16_neg_of_a_saturated_input_keeps_its_sign(tmp_path):
    """LiteRT's int16 kernels saturate at -32768, where a raw NEG wraps (-(-32768) is -32768:
    SmolLM2's saturated keys flipped sign in RoPE's rotate_half): a NEG whose parameters
    mirror its input's is SUB(0, x) too."""
    path, (x,) = _one_op_file(tmp_path, lambda x: -x, "int16", (4, 8))
    assert "NEG" not in [n for n, _, _ in _types(path)]
    big = 4 * x  # beyond the calibrated range: the input's QUANTIZE saturates (to -32768 below)
    got = litert(path, [big.numpy()], "builtin")[0]
    limit = float(np.abs(got).max())  # the output's saturation
    want = np.clip(-big.numpy(), -limit, limit)
    assert float(np.abs(got - want).max()) <= 4 * _output_step(path)


def test_int16_rsqrt_over_a_wide_range(tmp_path):
    """LiteRT's int16 RSQRT interpolates a table over the whole input range: with mean
    squares up to 8e5 (SmolLM2's massive token) rsqrt(100) read ~1.0. The file computes it
    over three ranges 16x apart and takes their MINIMUM: within 2 % from 100 up."""

    class One(torch.nn.Module):
        def forward(self, x):
            return torch.rsqrt(x + 1e-5)

    x = torch.tensor([[5.0, 100, 300, 1e3, 3e3, 1e4, 1e5, 8e5]])  # (5: the calibrated output range)
    path = tmp_path / "rsqrt.tflite"
    circleops.convert(One(), (x,), path, target="tflite", quantize="int16", calibrate=1)
    names = [n for n, _, _ in _types(path)]
    assert names.count("RSQRT") == 3 and names.count("MINIMUM") == 2
    want = torch.rsqrt(x).numpy()
    for resolver in RESOLVERS:
        got = litert(path, [x.numpy()], resolver)[0]
        assert float(np.abs(got / want - 1)[0, 1:].max()) <= 0.02, (resolver, got)


class RMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(64))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_int16_rms_norm_beside_a_massive_token(tmp_path):
    """One token with an RMS ~200x the others' (SmolLM2's massive activation) sets the
    mean square's range: the others' mean squares got 0-1 levels and their normalizer was
    off by up to 22 %. The file also computes the mean square 256x finer and takes its
    rsqrt where it did not saturate: every other token within 5 %, most within 1 %."""
    torch.manual_seed(0)
    norm = RMSNorm().eval()
    x = torch.randn(1, 16, 64) * 4
    x[0, 0] *= 200
    path = tmp_path / "norm.tflite"
    circleops.convert(norm, (x,), path, target="tflite", quantize="int16", calibrate=2)
    with torch.no_grad():
        want = norm(x).numpy()
    for resolver in RESOLVERS:
        got = litert(path, [x.numpy()], resolver)[0]
        rel = np.linalg.norm(got - want, axis=-1)[0] / np.linalg.norm(want, axis=-1)[0]
        assert rel.max() <= 0.05 and float(np.median(rel)) <= 0.01, (resolver, rel)


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
@pytest.mark.parametrize("fn", [torch.sigmoid, lambda x: torch.softmax(x, -1), torch.tanh], ids=["sigmoid", "softmax",
                                                                                               "tanh"])
def test_fixed_output_parameters(tmp_path, scheme, fn):
    """LOGISTIC / SOFTMAX / TANH write TFLite's fixed output parameters (1/32768 for int16,
    1/256 for int8...), which LiteRT checks at prepare; the observed ones follow by a QUANTIZE."""
    path, (x,) = _one_op_file(tmp_path, fn, scheme, (4, 8))
    got = litert(path, [x.numpy()], "builtin")[0]
    assert float(np.abs(got - fn(x).numpy()).max()) <= 4 * _output_step(path)
