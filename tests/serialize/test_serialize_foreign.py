"""read_model on files laid out the way other writers do it (tico, old TFLite converters)."""
from __future__ import annotations

import flatbuffers
import numpy as np
import pytest

from circleops.serialize import read_model, write_model
from circleops.serialize.schema import get_schema


def _foreign_file(path, fmt: str, w: np.ndarray) -> None:
    """MUL(x, w) written with the plain object API: one buffer per tensor (empty ones too),
    the opcode only in deprecated_builtin_code, data packed by the Builder, no signatures."""
    s = get_schema(fmt)
    bufs = []
    for data in (None, None, w, None):  # buffer 0 empty, then one per tensor
        b = s.cls("Buffer")()
        if data is not None:
            b.data = np.frombuffer(data.tobytes(), np.uint8)
        bufs.append(b)
    tensors = []
    for i, (name, shape) in enumerate((("input", [2, 3]), ("const", [2, 3]), ("output", [2, 3]))):
        t = s.cls("Tensor")()
        t.name, t.shape, t.type, t.buffer = name, shape, s.tensor_types["FLOAT32"], i + 1
        tensors.append(t)
    oc = s.cls("OperatorCode")()
    oc.deprecatedBuiltinCode = s.opcodes["MUL"]  # the pre-2.3 TFLite field only
    oc.builtinCode = 0
    op = s.cls("Operator")()
    op.opcodeIndex, op.inputs, op.outputs = 0, [0, 1], [2]
    sg = s.cls("SubGraph")()
    sg.tensors, sg.operators, sg.inputs, sg.outputs = tensors, [op], [0], [2]
    m = s.cls("Model")()
    m.version, m.operatorCodes, m.subgraphs, m.buffers, m.description = s.version, [oc], [sg], bufs, "other tool"
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=s.identifier)
    path.write_bytes(b.Output())


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_read_and_rewrite_foreign_file(tmp_path, fmt):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    src = tmp_path / f"foreign.{fmt}"
    _foreign_file(src, fmt, w)
    m = read_model(src)
    (sg,) = m.subgraphs
    assert [op.opcode for op in sg.operators] == ["MUL"]
    assert m.signatures == [] and m.description == "other tool"
    np.testing.assert_array_equal(sg.tensors[1].data, w)
    assert sg.tensors[0].data is None and sg.tensors[2].data is None

    out = tmp_path / f"ours.{fmt}"
    write_model(m, out, fmt)
    # The rewrite carries a default MulOptions table: onert dereferences it unchecked and
    # crashes (SIGSEGV) on the source file, so only LiteRT runs the source.
    assert read_model(out).subgraphs[0].operators[0].options_type == "MulOptions"
    x = np.full((2, 3), 1.5, np.float32)
    for p in ((src, out) if fmt == "tflite" else (out,)):
        if fmt == "tflite":
            from circleops.runtime import litert

            got = litert.run(p, [x])[0]
        else:
            import onert

            got = onert.infer.session(str(p), "cpu").infer([x])[0]
        np.testing.assert_array_equal(got, x * w)
