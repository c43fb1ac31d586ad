"""Quantized tensors through the writer and reader: GGML block weights (Circle only) and
affine QuantizationParameters (Circle and TFLite) come back as they were written."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from circleops import ir
from circleops.errors import ModelLoadError, TargetError
from circleops.serialize import read_model, write_model

GGML = {"GGML_Q4_0": gguf.GGMLQuantizationType.Q4_0, "GGML_Q8_0": gguf.GGMLQuantizationType.Q8_0}


def _ggml_fc(dtype: str, n: int = 8, k: int = 64) -> tuple[ir.Model, np.ndarray]:
    """y = x @ W.T with W stored as GGML blocks (what onert's FULLY_CONNECTED runs)."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(w, GGML[dtype]).reshape(-1)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, k), "FLOAT32"))
    wi = sg.add_tensor(ir.Tensor("w", (n, k), dtype, blocks))
    y = sg.add_tensor(ir.Tensor("y", (1, n), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, wi, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": "NONE"}))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})]), blocks


def _quantized_model(per_channel: bool) -> ir.Model:
    """An INT8 constant with per-tensor or per-channel scales, and a UINT8 activation."""
    sg = ir.Subgraph("main")
    q = (ir.QuantParams(np.array([0.5, 0.25, 0.125], np.float32), np.zeros(3, np.int64), 0)
         if per_channel else ir.QuantParams(np.array([0.1], np.float32), np.array([0], np.int64)))
    x = sg.add_tensor(ir.Tensor("x", (3, 4), "UINT8",
                                quant=ir.QuantParams(np.array([0.02], np.float32), np.array([128], np.int64))))
    w = sg.add_tensor(ir.Tensor("w", (3, 4), "INT8", np.arange(-6, 6, dtype=np.int8).reshape(3, 4), q))
    y = sg.add_tensor(ir.Tensor("y", (3, 4), "FLOAT32"))
    sg.operators.append(ir.Operator("ADD", [x, w], [y]))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])


@pytest.mark.parametrize("weights_after", [False, True])
@pytest.mark.parametrize("dtype", sorted(GGML))
def test_ggml_weights_roundtrip(tmp_path, dtype, weights_after):
    model, blocks = _ggml_fc(dtype)
    a, b = tmp_path / "a.circle", tmp_path / "b.circle"
    info = write_model(model, a, "circle", weights_after=weights_after)
    per_block, block_bytes = ir.GGML_BLOCKS[dtype]
    assert info.weight_bytes == 8 * 64 // per_block * block_bytes
    back = read_model(a)
    t = back.subgraphs[0].tensors[1]
    assert (t.name, t.shape, t.dtype, t.quant) == ("w", (8, 64), dtype, None)
    assert t.data.dtype == np.uint8 and t.data.tobytes() == blocks.tobytes()
    assert t.nbytes == blocks.nbytes
    write_model(back, b, "circle", weights_after=weights_after)
    assert a.read_bytes() == b.read_bytes()


def test_ggml_type_codes_in_the_file(tmp_path):
    """The file carries Circle's TensorType codes (GGML_Q4_0 = -2, GGML_Q8_0 = -4)."""
    from circleops.serialize.schema import get_schema

    schema = get_schema("circle")
    for dtype, code in (("GGML_Q4_0", -2), ("GGML_Q8_0", -4)):
        path = tmp_path / f"{dtype}.circle"
        write_model(_ggml_fc(dtype)[0], path, "circle")
        m = schema.cls("Model").InitFromPackedBuf(path.read_bytes(), 0)
        assert int(m.subgraphs[0].tensors[1].type) == code
        assert m.subgraphs[0].tensors[1].quantization is None


@pytest.mark.parametrize("dtype", sorted(GGML))
def test_ggml_in_tflite_is_a_clear_error(tmp_path, dtype):
    path = tmp_path / "m.tflite"
    with pytest.raises(TargetError, match=f"{dtype}.*only in Circle"):
        write_model(_ggml_fc(dtype)[0], path, "tflite")
    assert list(tmp_path.iterdir()) == []


def test_ggml_rows_must_be_whole_blocks(tmp_path):
    model, _ = _ggml_fc("GGML_Q8_0")
    model.subgraphs[0].tensors[1].shape = (16, 32 + 2)  # same bytes count is impossible anyway
    with pytest.raises(ValueError, match="blocks of 32 along the last dimension"):
        write_model(model, tmp_path / "m.circle", "circle")


def test_ggml_wrong_block_bytes_rejected(tmp_path):
    model, blocks = _ggml_fc("GGML_Q4_0")
    model.subgraphs[0].tensors[1].data = blocks[:-18]
    with pytest.raises(ValueError, match="needs"):
        write_model(model, tmp_path / "m.circle", "circle")


def test_reader_rejects_truncated_ggml_buffer(tmp_path):
    """A file whose GGML tensor has fewer block bytes than its shape needs is corrupt."""
    model, _ = _ggml_fc("GGML_Q8_0")
    path = tmp_path / "m.circle"
    write_model(model, path, "circle")
    from circleops.serialize.schema import get_schema

    schema = get_schema("circle")
    m = schema.cls("Model").InitFromPackedBuf(path.read_bytes(), 0)
    m.subgraphs[0].tensors[1].shape = [16, 64]  # twice the rows the buffer holds
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(m.Pack(builder), file_identifier=b"CIR0")
    path.write_bytes(bytes(builder.Output()))
    with pytest.raises(ModelLoadError, match="corrupt"):
        read_model(path)


@pytest.mark.parametrize("weights_after", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_quantization_parameters_roundtrip(tmp_path, fmt, per_channel, weights_after):
    model = _quantized_model(per_channel)
    a, b = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    write_model(model, a, fmt, weights_after=weights_after)
    back = read_model(a)
    for want, got in zip(model.subgraphs[0].tensors, back.subgraphs[0].tensors):
        assert (got.name, got.shape, got.dtype) == (want.name, want.shape, want.dtype)
        if want.quant is None:
            assert got.quant is None
            continue
        np.testing.assert_array_equal(got.quant.scale, want.quant.scale)
        np.testing.assert_array_equal(got.quant.zero_point, want.quant.zero_point)
        assert got.quant.scale.dtype == np.float32 and got.quant.zero_point.dtype == np.int64
        assert got.quant.quantized_dimension == want.quant.quantized_dimension
        assert got.quant.per_channel == per_channel or got.name == "x"
    np.testing.assert_array_equal(back.subgraphs[0].tensors[1].data, model.subgraphs[0].tensors[1].data)
    write_model(back, b, fmt, weights_after=weights_after)
    assert a.read_bytes() == b.read_bytes()


def test_quantized_dimension_is_written(tmp_path):
    model = _quantized_model(False)
    w = model.subgraphs[0].tensors[1]
    w.quant = ir.QuantParams(np.array([1.0, 2.0, 3.0, 4.0], np.float32), np.array([0, 1, 2, 3]), 1)
    path = tmp_path / "m.circle"
    write_model(model, path, "circle")
    q = read_model(path).subgraphs[0].tensors[1].quant
    assert q.quantized_dimension == 1 and q.zero_point.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("quant,match", [
    (ir.QuantParams(np.array([1.0, 2.0], np.float32), np.zeros(2, np.int64), 0), "do not match shape"),
    (ir.QuantParams(np.array([1.0, 2.0, 3.0], np.float32), np.zeros(2, np.int64), 0), "one zero point per scale"),
    (ir.QuantParams(np.array([], np.float32), np.array([], np.int64)), "0 scales"),
])
def test_inconsistent_quantization_rejected(tmp_path, quant, match):
    model = _quantized_model(False)
    model.subgraphs[0].tensors[1].quant = quant
    with pytest.raises(TargetError, match=match):
        write_model(model, tmp_path / "m.circle", "circle")
    assert list(tmp_path.iterdir()) == []


def test_float_tensors_have_no_quantization_table(tmp_path):
    """Converters put empty tables on float tensors; the reader gives them no QuantParams."""
    from circleops.serialize.schema import get_schema

    model = _quantized_model(False)
    path = tmp_path / "m.tflite"
    write_model(model, path, "tflite")
    schema = get_schema("tflite")
    m = schema.cls("Model").InitFromPackedBuf(path.read_bytes(), 0)
    m.subgraphs[0].tensors[2].quantization = schema.cls("QuantizationParameters")()
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    path.write_bytes(bytes(builder.Output()))
    assert read_model(path).subgraphs[0].tensors[2].quant is None
