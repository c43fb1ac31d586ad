"""What a user sees when a file or the inputs do not fit: one clear RuntimeRunError."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops import ir
from circleops.errors import CircleOpsError, RuntimeRunError
from circleops.runtime import reference
from circleops.runtime.reference import Interpreter
from refbuild import Const, Feed, one_op


def _add_model():
    x = np.ones((2, 3), np.float32)
    return one_op("ADD", [Feed(x), Const(np.ones((3,), np.float32))], [x])


def test_unknown_opcode_names_the_opcode_operator_and_output():
    model, feeds = one_op("RELU", [Feed(np.ones((2,), np.float32))], [np.ones((2,), np.float32)])
    model.subgraphs[0].operators[0].opcode = "NON_MAX_SUPPRESSION_V5"
    model.subgraphs[0].tensors[model.subgraphs[0].outputs[0]].name = "boxes"
    with pytest.raises(RuntimeRunError, match=r"no kernel for opcode NON_MAX_SUPPRESSION_V5 \(operator 0 .*'boxes'"):
        reference.run(model, feeds)


@pytest.mark.parametrize("inputs,match", [
    ([], r"takes 1 input\(s\) \(in0 float32\[2, 3\]\), 0 given"),
    ([np.ones((2, 3), np.float32)] * 2, r"takes 1 input\(s\)"),
    ([np.ones((3, 2), np.float32)], r"input #0 'in0' has shape \[3, 2\], the file expects \[2, 3\]"),
    ([np.ones((2, 3), np.float64)], r"input #0 'in0' is float64, the file expects float32.*astype\(np.float32\)"),
])
def test_input_count_shape_dtype_mismatch(inputs, match):
    model, _ = _add_model()
    with pytest.raises(RuntimeRunError, match=match):
        reference.run(model, inputs)


def test_unknown_dims_accept_any_size():
    model, _ = _add_model()
    model.subgraphs[0].tensors[model.subgraphs[0].inputs[0]].shape = (-1, 3)
    model.subgraphs[0].tensors[model.subgraphs[0].outputs[0]].shape = (-1, 3)
    (y,) = reference.run(model, [np.zeros((5, 3), np.float32)])
    assert y.shape == (5, 3) and (y == 1).all()


def test_kernel_failure_names_operator_inputs_and_cause():
    x = np.ones((2, 3), np.float32)
    model, feeds = one_op("RESHAPE", [Feed(x), Const(np.array([4, 2], np.int32))], [np.ones((4, 2), np.float32)])
    with pytest.raises(RuntimeRunError, match=r"operator 0 \(RESHAPE\).*'in0' float32\[2, 3\].*invalid for input of size 6"):
        reference.run(model, feeds)


def test_declared_output_dtype_is_enforced():
    x = np.ones((2,), np.float32)
    model, feeds = one_op("CAST", [Feed(x)], [x.astype(np.int32)])
    model.subgraphs[0].operators[0].opcode = "NEG"  # computes float32, declared INT32
    with pytest.raises(RuntimeRunError, match=r"computed as torch.float32 \[2\] but declared torch.int32"):
        reference.run(model, feeds)


def test_missing_file_and_unknown_signature(tmp_path):
    with pytest.raises(RuntimeRunError, match="does not exist"):
        reference.run(tmp_path / "nope.circle", [])
    model, feeds = _add_model()
    with pytest.raises(RuntimeRunError, match=r"no signature 'decode'.*none"):
        reference.run(model, feeds, signature="decode")


def test_errors_are_circleops_errors():
    assert issubclass(RuntimeRunError, CircleOpsError)


def test_signature_orders_inputs_and_outputs_by_name():
    a, b = np.full((2,), 2, np.float32), np.full((2,), 3, np.float32)
    model, _ = one_op("SUB", [Feed(a), Feed(b)], [a])
    sg = model.subgraphs[0]
    x0, x1 = sg.inputs
    model.signatures = [ir.Signature("serving", 0, {"b": x1, "a": x0}, {"d": sg.outputs[0]})]
    (d,) = reference.run(model, [b, a], signature="serving")  # signature order: b, a
    np.testing.assert_array_equal(d, a - b)
    (d2,) = reference.run(model, {"a": a, "b": b}, signature="serving")
    np.testing.assert_array_equal(d2, a - b)


def test_outputs_are_copies_and_inputs_are_not_modified():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    model, feeds = one_op("RESHAPE", [Feed(x), Const(np.array([3, 2], np.int32))], [x.reshape(3, 2)])
    (y,) = reference.run(model, [x])
    y[0, 0] = 100
    assert x[0, 0] == 0


def test_bf16_inputs_and_outputs():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = torch.randn(4).to(torch.bfloat16)
    model, _ = one_op("NEG", [Feed(x)], [x])
    (y,) = reference.run(model, [x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)])
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y.astype(np.float32), (-x).float().numpy())


def test_custom_op_error_names_its_custom_code():
    model, feeds = one_op("RELU", [Feed(np.ones((2,), np.float32))], [np.ones((2,), np.float32)])
    op = model.subgraphs[0].operators[0]
    op.opcode, op.options = "CUSTOM", {"customCode": "MyFancyOp", "customOptions": b""}
    # no registered op (circleops.op, a plugin) has this custom_code
    with pytest.raises(RuntimeRunError, match=r"operator 0 of subgraph 0 'main': CUSTOM op with custom_code "
                                              r"'MyFancyOp': no registered op provides it"):
        reference.run(model, feeds)
