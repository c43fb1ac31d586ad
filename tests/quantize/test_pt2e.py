"""Integer models through PT2E: CircleQuantizer -> convert_pt2e -> circleops.save, run by the
reference interpreter's integer kernels and compared with the fake-quantized torch module."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import circleops
from circleops.quantize import pt2e
from circleops.runtime import reference
from circleops.runtime.kernels import quantized as qk
from circleops.serialize import read_model

INTEGER = {"UINT8", "INT8", "INT16", "INT32"}


# ------------------------------------------------------------------ fixed-point arithmetic
def _srdhm(a: int, b: int) -> int:
    """TFLite SaturatingRoundingDoublingHighMul, scalar C++ semantics."""
    if a == b == -(2 ** 31):
        return 2 ** 31 - 1
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    q = abs(ab + nudge) // (1 << 31)
    return q if ab + nudge >= 0 else -q


def _rdbpot(x: int, e: int) -> int:
    mask = (1 << e) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> e) + (1 if remainder > threshold else 0)


def _mbqm(x: int, m: int, shift: int) -> int:
    return _rdbpot(_srdhm(x * (1 << max(shift, 0)), m), max(-shift, 0))


def test_quantize_multiplier_matches_tflite():
    # QuantizeMultiplier(0.5) = (1 << 30, 0); 0.25 -> (1 << 30, -1); 1.0 -> (1 << 30, 1)
    assert qk.quantize_multiplier(0.5) == (1 << 30, 0)
    assert qk.quantize_multiplier(0.25) == (1 << 30, -1)
    assert qk.quantize_multiplier(1.0) == (1 << 30, 1)
    m, s = qk.quantize_multiplier(0.0123)
    assert abs(m * 2.0 ** (s - 31) - 0.0123) < 1e-11


def test_multiply_by_quantized_multiplier_matches_scalar_reference():
    gen = torch.Generator().manual_seed(0)
    xs = torch.randint(-(2 ** 24), 2 ** 24, (200,), generator=gen, dtype=torch.int64)
    for real in (0.000731, 0.0123, 0.49, 0.9999, 1.7, 3.2):
        m, s = qk.quantize_multiplier(real)
        got = qk.multiply_by_quantized_multiplier(xs, torch.tensor(m), torch.tensor(s))
        want = [_mbqm(int(x), m, s) for x in xs]
        assert got.tolist() == want, real
        # and it is the real product, rounded
        assert (got.double() - xs.double() * real).abs().max() <= 1.0 + 1e-6 * xs.abs().max() * real


# ------------------------------------------------------------------ models
class SmallNet(torch.nn.Module):
    """conv, depthwise conv, relu, mean, linear, a scalar multiply, a slice and an add."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.dw = torch.nn.Conv2d(8, 8, 3, groups=8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = self.dw(torch.relu(self.conv(x))).mean((2, 3))
        return self.fc(y) * 0.5 + y[:, :4]


def _quantized_program(model, args, quantizer, samples=4, exported=None):
    calib = pt2e.calibration_samples(args, samples)
    return pt2e.quantize(model, args, quantizer, calib, exported=exported)


@pytest.fixture(scope="module")
def small_net_uint8():
    """SmallNet quantized once (uint8, int8 per-channel weights) for the tests that only
    write it differently: (model, x, converted module, its ExportedProgram)."""
    torch.manual_seed(0)
    model, x = SmallNet().eval(), torch.randn(1, 3, 8, 8)
    converted, ep = _quantized_program(model, (x,), pt2e.make_quantizer("uint8"))
    return model, x, converted, ep


def _op_dtypes(path):
    sg = read_model(str(path)).subgraphs[0]
    return sg, [(op.opcode, [sg.tensors[i].dtype for i in op.inputs if i >= 0],
                 [sg.tensors[i].dtype for i in op.outputs]) for op in sg.operators]


def _assert_integer_inside(ops):
    """QUANTIZE first, DEQUANTIZE last, and every compute op in between on integers."""
    for opcode, ins, outs in ops:
        if opcode in ("QUANTIZE", "DEQUANTIZE"):
            continue
        assert set(outs) <= INTEGER, (opcode, ins, outs)
        assert not {"FLOAT32"} & set(ins), (opcode, ins, outs)


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
def test_small_net_integer_file_matches_fake_quant(tmp_path, scheme, request):
    if scheme == "uint8":
        model, x, converted, ep = request.getfixturevalue("small_net_uint8")
    else:
        torch.manual_seed(0)
        model, x = SmallNet().eval(), torch.randn(1, 3, 8, 8)
        converted, ep = _quantized_program(model, (x,), pt2e.make_quantizer(scheme))
    report = circleops.save(ep, tmp_path / "m.circle", verify="reference")
    assert report.verify.passed
    sg, ops = _op_dtypes(tmp_path / "m.circle")
    assert [o[0] for o in ops].count("QUANTIZE") == 1 and ops[-1][0] == "DEQUANTIZE"
    _assert_integer_inside(ops)
    act = "UINT8" if scheme == "uint8" else "INT16"
    by_op = {o[0]: o for o in ops}
    assert by_op["CONV_2D"][1] == [act, "INT8", "INT32"] and by_op["CONV_2D"][2] == [act]
    assert by_op["DEPTHWISE_CONV_2D"][1] == [act, "INT8", "INT32"]
    assert by_op["FULLY_CONNECTED"][1] == [act, "INT8", "INT32"]
    # per-channel weights: the depthwise filter [1, kh, kw, C] is quantized along dim 3
    dw = next(op for op in sg.operators if op.opcode == "DEPTHWISE_CONV_2D")
    w, b, xin = (sg.tensors[dw.inputs[i]] for i in (1, 2, 0))
    assert w.quant.quantized_dimension == 3 and len(w.quant.scale) == 8
    np.testing.assert_allclose(b.quant.scale, xin.quant.scale[0] * w.quant.scale, rtol=1e-6)
    # the integer arithmetic lands within 2 output steps of the fake-quantized torch module
    out = reference.run(str(tmp_path / "m.circle"), [x.numpy()])[0]
    want = converted(x).detach().numpy()
    step = float(sg.tensors[sg.operators[-1].inputs[0]].quant.scale[0])
    assert np.abs(out - want).max() <= 2 * step + 1e-7


def test_integer_io_keeps_integer_inputs_and_outputs(tmp_path, small_net_uint8):
    model, x, converted, ep = small_net_uint8
    circleops.save(ep, tmp_path / "m.circle", integer_io=True)
    sg, ops = _op_dtypes(tmp_path / "m.circle")
    assert sg.tensors[sg.inputs[0]].dtype == "UINT8" and sg.tensors[sg.outputs[0]].dtype == "UINT8"
    assert not [o for o in ops if o[0] in ("QUANTIZE", "DEQUANTIZE")]
    qin, qout = sg.tensors[sg.inputs[0]].quant, sg.tensors[sg.outputs[0]].quant
    xq = np.clip(np.round(x.numpy() / qin.scale[0]) + qin.zero_point[0], 0, 255).astype(np.uint8)
    out = reference.run(str(tmp_path / "m.circle"), [xq])[0]
    real = (out.astype(np.float32) - qout.zero_point[0]) * qout.scale[0]
    assert np.abs(real - converted(x).detach().numpy()).max() <= 2 * qout.scale[0] + 1e-7


def test_conv_net_with_instance_norm_uint8(tmp_path, convnet_uint8):
    model, x, converted, qep = convnet_uint8  # tests/quantize/conftest.py
    report = circleops.save(qep, tmp_path / "net.circle", verify="reference")
    assert report.verify.passed
    _, ops = _op_dtypes(tmp_path / "net.circle")
    norms = [o for o in ops if o[0] == "INSTANCE_NORM"]
    assert norms and all(o[1] == ["UINT8"] * 3 and o[2] == ["UINT8"] for o in norms)
    # nothing computes in float but the final DEQUANTIZE (the reflection pads share their
    # input's parameters, so the first QUANTIZE sits right after the input)
    assert [o[0] for o in ops if o[2] == ["FLOAT32"]] == ["DEQUANTIZE"] and ops[0][0] == "QUANTIZE"


@pytest.fixture(scope="module")
def tiny_llama():
    from families import FAMILIES

    from circleops.pipeline.convert import hf_export_settings, export, export_module

    fam = next(f for f in FAMILIES if f.name == "llama")
    model = fam.build()
    module = export_module(model)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with hf_export_settings(model), torch.no_grad():
        ep = export(module, (ids,))
    return model, module, ep, ids


@pytest.mark.parametrize("scheme", ["uint8", "int16"])
def test_llm_fused_ops_quantized_whole(tmp_path, tiny_llama, scheme):
    model, module, ep, ids = tiny_llama
    samples = pt2e.calibration_samples((ids,), 3, vocab_size=256)
    converted, qep = pt2e.quantize(module, (ids,), pt2e.make_quantizer(scheme), samples, exported=ep)
    report = circleops.save(qep, tmp_path / "llm.circle", verify="reference")
    assert report.verify.passed
    _, ops = _op_dtypes(tmp_path / "llm.circle")
    _assert_integer_inside([o for o in ops if o[0] != "ATTENTION"])
    act = "UINT8" if scheme == "uint8" else "INT16"
    counts = collections.Counter(o[0] for o in ops)
    assert counts["RMS_NORM"] == 5 and counts["ATTENTION"] == 2
    for opcode, ins, outs in ops:
        if opcode == "RMS_NORM":
            assert ins == [act, act] and outs == [act]
        if opcode == "ATTENTION":  # x, 4 projections, cos, sin quantized; mask, caches, pos float/int
            assert ins[:7] == [act, "INT8", "INT8", "INT8", "INT8", act, act] and outs == [act]


def test_mixed_precision_by_op_type_part_and_module_name(tmp_path, tiny_llama):
    model, module, ep, ids = tiny_llama
    # an operator type, a part (residual: the float adds) and an HF module name (matched under
    # the CausalLMLogits wrapper, as "model.model.layers.1.mlp.down_proj")
    q = pt2e.make_quantizer("uint8", int16_ops=[torch.ops.circle.rms_norm],
                            int16=["residual", "model.layers.1.mlp.down_proj"])
    samples = pt2e.calibration_samples((ids,), 2, vocab_size=256)
    _, qep = pt2e.quantize(module, (ids,), q, samples, exported=ep)
    report = circleops.save(qep, tmp_path / "mixed.circle", verify="reference")
    assert report.verify.passed
    sg, ops = _op_dtypes(tmp_path / "mixed.circle")
    assert all(o[2] == ["INT16"] for o in ops if o[0] == "RMS_NORM")
    adds = [o for o in ops if o[0] == "ADD"]
    assert len(adds) == 4 and all(o[1] == ["INT16", "INT16"] and o[2] == ["INT16"] for o in adds)
    # FCs in graph order; a down projection's weight is [hidden, intermediate]
    fcs = [(list(sg.tensors[op.inputs[1]].shape), sg.tensors[op.inputs[0]].dtype, sg.tensors[op.outputs[0]].dtype)
           for op in sg.operators if op.opcode == "FULLY_CONNECTED"]
    down = [k for k, f in enumerate(fcs) if f[0] == [model.config.hidden_size, model.config.intermediate_size]]
    assert len(down) == 2 and fcs[down[1]][1:] == ("INT16", "INT16"), fcs
    assert all(f[1:] == ("UINT8", "UINT8") for k, f in enumerate(fcs) if k != down[1]), fcs
    # int16 -> uint8 (and back) are requantizing QUANTIZE ops between the two precisions
    assert any(o[0] == "QUANTIZE" and o[1] == ["INT16"] and o[2] == ["UINT8"] for o in ops)


def test_int16_parts_name_what_they_select(tiny_llama):
    from circleops.quantize import INT16_PARTS, INT16_PRESETS
    from circleops.quantize.quantizer import QuantizeConfigError

    ops, modules = pt2e.int16_parts(["llm", "mlp_out", "lm_head", "model.norm"])
    assert torch.ops.circle.rms_norm in ops and torch.ops.aten.add.Tensor in ops
    assert modules == ["*.mlp", "*.mlp.down_proj", "*lm_head", "model.norm", "*.model.norm"]
    assert set(INT16_PRESETS["llm"]) <= set(INT16_PARTS)
    with pytest.raises(QuantizeConfigError, match="norms, residual"):
        pt2e.int16_parts(["rms norm!"])
    # a module name that names nothing in the model fails at prepare, naming it
    model, module, ep, ids = tiny_llama
    q = pt2e.make_quantizer("uint8", int16=["model.layers.7.mlp"])
    with pytest.raises(QuantizeConfigError, match="model.layers.7.mlp"):
        pt2e.quantize(module, (ids,), q, [(ids,)], exported=ep)


def test_quantizer_is_a_torchao_quantizer():
    from torchao.quantization.pt2e.quantizer import Quantizer

    from circleops.quantize.quantizer import CircleQuantizer, QuantizeConfigError

    assert issubclass(CircleQuantizer, Quantizer)
    with pytest.raises(QuantizeConfigError, match="int16"):
        CircleQuantizer("int4")


def test_calibration_file_and_errors(tmp_path):
    x = torch.randn(1, 3, 4, 4)
    torch.save(torch.randn(5, 3, 4, 4), tmp_path / "calib.pt")
    samples = pt2e.calibration_samples((x,), 3, data=tmp_path / "calib.pt")
    assert len(samples) == 3 and samples[0][0].shape == (1, 3, 4, 4)
    torch.save(torch.randn(5, 3, 8, 8), tmp_path / "wrong.pt")
    with pytest.raises(pt2e.CalibrationError, match="shapes"):
        pt2e.calibration_samples((x,), 3, data=tmp_path / "wrong.pt")
    noisy = pt2e.calibration_samples((x,), 3)
    assert torch.equal(noisy[0][0], x) and not torch.equal(noisy[1][0], x)
    assert torch.equal(pt2e.calibration_samples((x,), 3)[2][0], noisy[2][0])  # seeded
    # an LLM's token ids from a file: checked against the vocabulary (issue 31), not an
    # IndexError from the embedding deep inside calibration
    ids = torch.zeros(1, 6, dtype=torch.int64)
    torch.save(torch.tensor([[1, 2, 3, 4, 5, 31]] * 2), tmp_path / "ok.pt")
    assert len(pt2e.calibration_samples((ids,), 2, data=tmp_path / "ok.pt", vocab_size=32)) == 2
    for bad in (32, -1):
        torch.save(torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, bad, 5, 6]]), tmp_path / "bad.pt")
        with pytest.raises(pt2e.CalibrationError, match=rf"calibration sample 1 in .*bad.pt: token id {bad} outside "
                                                        "the model's vocabulary of 32 tokens"):
            pt2e.calibration_samples((ids,), 2, data=tmp_path / "bad.pt", vocab_size=32)


def test_tflite_target_writes_the_integer_graph_litert_runs(tmp_path, small_net_uint8):
    """The same program for target tflite: int8 activations (uint8's values, zero point - 128),
    depthwise and plain convolutions included, verified in LiteRT against the converted module
    (tests/tflite/test_tflite_integer.py has the rest)."""
    _, _, _, ep = small_net_uint8
    report = circleops.save(ep, tmp_path / "m.tflite", target="tflite", verify="litert")
    assert report.verify.runtime == "litert" and report.verify.passed
    dtypes = {t.dtype for t in read_model(str(tmp_path / "m.tflite")).subgraphs[0].tensors}
    assert "INT8" in dtypes and "UINT8" not in dtypes


def test_inspect_shows_quantization_of_every_tensor(tmp_path, capsys, small_net_uint8):
    from circleops.cli import main

    _, _, _, ep = small_net_uint8
    circleops.save(ep, tmp_path / "m.circle", integer_io=True)
    assert main(["inspect", str(tmp_path / "m.circle"), "--tensors"]) == 0
    out = capsys.readouterr().out
    sg = read_model(str(tmp_path / "m.circle")).subgraphs[0]
    x_q = sg.tensors[sg.inputs[0]].quant
    assert f"UINT8     [1, 3, 8, 8]  scale {float(x_q.scale[0]):.4g}, zero point {int(x_q.zero_point[0])}" in out
    assert "quantized activations (" in out and "per-channel (dim 3, 8 scales)" in out  # the depthwise filter


@pytest.mark.parametrize("scheme,runtime", [("uint8", "onert")])  # int16 in the reference: the same code path
def test_check_reports_layer_sqnr_and_agreement(scheme, runtime):
    from families import BY_NAME

    from circleops.tools.quant_report import quant_check

    if runtime == "onert":
        pytest.importorskip("onert")
    r = quant_check(BY_NAME["llama"].build(), None, quantize=scheme, prompt_ids=[5, 17, 42], new_tokens=4,
                    window=32, max_windows=1, runtime=runtime)
    assert len(r.layer_sqnr_db) == len(r.layer_max_abs) == 2
    assert all(db > (30 if scheme == "int16" else 10) for db in r.layer_sqnr_db), r.table()
    assert 0 <= r.agreement <= 4 and abs(r.perplexity_ratio - 1) < 0.2
    assert "SQNR (dB)" in r.table() and f"{scheme} activations" in r.table()
