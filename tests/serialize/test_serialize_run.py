"""Written files run in their runtime and compute what numpy computes."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.serialize import read_model, write_model
from serialize import tiny_models

onert = pytest.importorskip("onert")


def _onert_run(path, inputs):
    return onert.infer.session(str(path), "cpu").infer(inputs)


@pytest.mark.parametrize("build", [tiny_models.fc_add, tiny_models.rms_norm_circle])
def test_circle_runs_in_onert(tmp_path, build):
    model, reference = build()
    path = tmp_path / "m.circle"
    info = write_model(model, path, "circle")
    assert info.layout == "inline"
    assert path.read_bytes()[4:8] == b"CIR0"
    x = np.random.default_rng(0).standard_normal(model.subgraphs[0].tensors[0].shape).astype(np.float32) * 3
    (got,) = _onert_run(path, [x])
    np.testing.assert_allclose(got, reference(x)[0], rtol=1e-5, atol=1e-5)


def test_circle_extended_op_codes(tmp_path):
    """Negative (extended) codes go in both code fields; ordinary ops cap the int8 field at 127."""
    from circle_schema import circle

    model, _ = tiny_models.rms_norm_circle()
    sg = model.subgraphs[0]
    # add an ordinary op whose code passes int8 (STABLEHLO_COMPOSITE, 206) to check the cap
    model.subgraphs.append(tiny_models.rms_norm_composite()[0].subgraphs[1])
    sg.operators.append(type(sg.operators[0])(
        "STABLEHLO_COMPOSITE", [0, 1], [2], "StableHLOCompositeOptions",
        {"name": "odml.rms_norm", "decompositionSubgraphIndex": 1, "compositeAttributes": {"epsilon": 1e-6}}))
    path = tmp_path / "m.circle"
    write_model(model, path, "circle")
    m = circle.Model.ModelT.InitFromPackedBuf(bytearray(path.read_bytes()), 0)
    codes = {(oc.builtinCode, oc.deprecatedBuiltinCode) for oc in m.operatorCodes}
    assert (-6, -6) in codes and (206, 127) in codes
    assert [op.opcode for op in read_model(path).subgraphs[0].operators] == ["RMS_NORM", "STABLEHLO_COMPOSITE"]


@pytest.mark.parametrize("build", [tiny_models.fc_add, tiny_models.rms_norm_composite,
                                   tiny_models.broadcast_to])
@pytest.mark.parametrize("weights_after", [False, True])
def test_tflite_runs_in_litert(tmp_path, build, weights_after):
    from circleops.runtime import litert

    model, reference = build()
    path = tmp_path / "m.tflite"
    info = write_model(model, path, "tflite", weights_after=weights_after)
    assert info.layout == ("offset" if weights_after else "inline")
    assert path.read_bytes()[4:8] == b"TFL3"
    x = np.random.default_rng(1).standard_normal(model.subgraphs[0].tensors[0].shape).astype(np.float32) * 3
    for got in (litert.run(path, [x])[0], litert.run(path, [x], signature="serving_default")[0]):
        np.testing.assert_allclose(got, reference(x)[0], rtol=1e-5, atol=1e-5)


def test_tflite_op_versions(tmp_path):
    from ai_edge_litert import schema_py_generated as tfl

    model, _ = tiny_models.broadcast_to()
    path = tmp_path / "m.tflite"
    write_model(model, path, "tflite")
    m = tfl.ModelT.InitFromPackedBuf(bytearray(path.read_bytes()), 0)
    assert m.version == 3
    assert [(oc.builtinCode, oc.version) for oc in m.operatorCodes] == [(tfl.BuiltinOperator.BROADCAST_TO, 2)]


def test_litert_run_errors(tmp_path):
    from circleops.errors import RuntimeRunError
    from circleops.runtime import litert

    model, _ = tiny_models.fc_add()
    path = tmp_path / "m.tflite"
    write_model(model, path, "tflite")
    with pytest.raises(RuntimeRunError, match="float64.*float32"):
        litert.run(path, [np.zeros((1, 4))])
    with pytest.raises(RuntimeRunError, match=r"takes 1 input\(s\)"):
        litert.run(path, [])
    with pytest.raises(RuntimeRunError, match="no signature 'nope'"):
        litert.run(path, [np.zeros((1, 4), np.float32)], signature="nope")
    circle_path = tmp_path / "m.circle"
    write_model(model, circle_path, "circle")
    with pytest.raises(RuntimeRunError, match="LiteRT cannot load"):
        litert.run(circle_path, [np.zeros((1, 4), np.float32)])


def _no_options_model(opcode, in_dtype, out_dtype, out_shape, const=None):
    from circleops import ir

    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (2, 3), in_dtype))
    ins = [x] + ([sg.add_tensor(ir.Tensor("c", const.shape, "INT32", const))] if const is not None else [])
    y = sg.add_tensor(ir.Tensor("y", out_shape, out_dtype))
    sg.operators.append(ir.Operator(opcode, ins, [y]))  # no options_type: the writer fills it
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])


@pytest.mark.parametrize("fmt", ["tflite", "circle"])
@pytest.mark.parametrize("opcode,in_dtype,out_dtype,out_shape,const,reference", [
    ("ARG_MIN", "FLOAT32", "INT32", (2,), np.array([1], np.int32), lambda x: x.argmin(1).astype(np.int32)),
    ("CAST", "FLOAT32", "INT32", (2, 3), None, lambda x: x.astype(np.int32)),
    ("MUL", "FLOAT32", "FLOAT32", (2, 3), None, lambda x: x * x),
])
def test_ops_without_options_get_a_table(tmp_path, fmt, opcode, in_dtype, out_dtype, out_shape, const, reference):
    """A default options table (dtype fields from the tensors): onert crashes without one,
    LiteRT's ARG_MIN fails with a FLOAT32 outputType."""
    model = _no_options_model(opcode, in_dtype, out_dtype, out_shape, const)
    if opcode == "MUL":
        op = model.subgraphs[0].operators[0]
        op.inputs = [0, 0]
    path = tmp_path / f"m.{fmt}"
    write_model(model, path, fmt)
    assert read_model(path).subgraphs[0].operators[0].options_type is not None
    x = np.array([[1.5, -2.0, 3.0], [0.25, 7.0, -1.0]], np.float32)
    if fmt == "tflite":
        from circleops.runtime import litert

        got = litert.run(path, [x])[0]
    else:
        got = _onert_run(path, [x])[0]
    np.testing.assert_array_equal(got, reference(x))
