"""Files as other writers lay them out: weights after the flatbuffer, no options tables,
several signatures over several subgraphs."""
from __future__ import annotations

import numpy as np
import pytest

from circleops import ir
from circleops.runtime import reference
from circleops.serialize import read_model, write_model
from refbuild import Const, Feed, one_op

rng = np.random.default_rng(0)


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_weights_after_the_flatbuffer(tmp_path, fmt):
    x, w, b = rng.standard_normal((3, 16), np.float32), rng.standard_normal((8, 16), np.float32), rng.standard_normal(8, np.float32)
    model, feeds = one_op("FULLY_CONNECTED", [Feed(x), Const(w), Const(b)], [x @ w.T + b])
    info = write_model(model, tmp_path / f"fc.{fmt}", fmt, weights_after=True)
    assert info.layout == "offset"
    (y,) = reference.run(tmp_path / f"fc.{fmt}", feeds)
    np.testing.assert_allclose(y, x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_operators_without_options_use_the_schema_defaults():
    """A writer may omit an options table: ADD then has no activation, FULLY_CONNECTED
    flattens (keep_num_dims false), CONCATENATION's axis is 0."""
    x = rng.standard_normal((2, 2, 4), np.float32)
    w = rng.standard_normal((3, 4), np.float32)
    for opcode, operands, want in [
        ("ADD", [Feed(x), Feed(-x - 1)], np.full_like(x, -1)),
        ("FULLY_CONNECTED", [Feed(x), Const(w), None], x.reshape(4, 4) @ w.T),
        ("CONCATENATION", [Feed(x), Feed(x)], np.concatenate([x, x], 0)),
    ]:
        model, feeds = one_op(opcode, operands, [want])
        assert model.subgraphs[0].operators[0].options_type is None
        (y,) = reference.run(model, feeds)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_signatures_select_their_subgraph(tmp_path):
    """Two entry points (as prefill/decode files have) in one file, each its own subgraph."""
    model = ir.Model()
    for k, (opcode, name) in enumerate([("NEG", "prefill"), ("EXP", "decode")]):
        sg = ir.Subgraph(name)
        a = sg.add_tensor(ir.Tensor(f"{name}_x", (2,), "FLOAT32"))
        o = sg.add_tensor(ir.Tensor(f"{name}_y", (2,), "FLOAT32"))
        sg.operators.append(ir.Operator(opcode, [a], [o]))
        sg.inputs, sg.outputs = [a], [o]
        model.subgraphs.append(sg)
        model.signatures.append(ir.Signature(name, k, {"x": a}, {"y": o}))
    write_model(model, tmp_path / "two.circle", "circle")
    x = np.array([0.0, 1.0], np.float32)
    interp = reference.Interpreter(read_model(tmp_path / "two.circle"))
    np.testing.assert_allclose(interp.run([x], signature="prefill")[0], -x)
    np.testing.assert_allclose(interp.run({"x": x}, signature="decode")[0], np.exp(x), rtol=1e-6)
    np.testing.assert_allclose(interp.run([x])[0], -x)  # no signature: subgraph 0
