"""A CUSTOM op's custom_options round trip, one attribute kind at a time, with values that are
NOT the schema's defaults (issue 31): a lost attribute whose default happened to be the value
used passed every other registry test. Each op's reference kernel folds its attribute into
the output, so the reference interpreter's result also shows which value it read back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.runtime import reference
from circleops.serialize.composite import decode_attributes
from circleops.serialize.reader import read_model

X = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 8

# kind -> (schema after the name, call arguments after x, the attributes written, reference kernel)
KINDS = {
    "int": ("(Tensor x, int a=1) -> Tensor", (7,), {"a": 7}, lambda x, a: x + a),
    "float": ("(Tensor x, float a=1.0) -> Tensor", (2.5,), {"a": 2.5}, lambda x, a: x * a),
    "bool": ("(Tensor x, bool a=False) -> Tensor", (True,), {"a": True}, lambda x, a: x + (10.0 if a else 0.0)),
    "int list": ("(Tensor x, int[] a=[1]) -> Tensor", ([3, 4],), {"a": [3, 4]},
                 lambda x, a: x * a[0] + 10 * len(a) + a[-1]),
    "float list": ("(Tensor x, float[] a=[1.0]) -> Tensor", ([0.5, -2.0],), {"a": [0.5, -2.0]},
                   lambda x, a: x * a[0] + a[-1] + len(a)),
    "str": ("(Tensor x, str a='x') -> Tensor", ("gelu",), {"a": "gelu"}, lambda x, a: x + len(a) + ord(a[0])),
    # the optional tensor left out (input -1), then an attribute after it: nothing may shift
    "Tensor? left out": ("(Tensor x, Tensor? b=None, int k=2) -> Tensor", (None, 5), {"k": 5},
                         lambda x, b, k: x * k + (100.0 if b is None else b)),
}
_OPS: dict[str, circleops.ops.OpSpec] = {}


def _op(kind: str):
    if kind not in _OPS:
        schema, _, _, kernel = KINDS[kind]
        name = "co_test::" + kind.replace(" ", "_").replace("?", "q")
        _OPS[kind] = circleops.op(name + schema, circle="custom")(kernel)
    return _OPS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_custom_options_round_trip_with_non_default_values(kind, tmp_path):
    spec, (_, args, written, _) = _op(kind), KINDS[kind]

    class M(torch.nn.Module):
        def forward(self, x):
            return spec.op(x, *args)

    path = tmp_path / "m.circle"
    circleops.convert(M(), (X,), path, target="circle")
    model = read_model(path)
    customs = [op for sg in model.subgraphs for op in sg.operators if op.opcode == "CUSTOM"]
    assert len(customs) == 1
    assert customs[0].options["customCode"] == spec.qualname
    assert decode_attributes(customs[0].options["customOptions"]) == written
    want = M()(X).numpy()
    assert not np.array_equal(want, spec.reference(X).numpy())  # the defaults would give other numbers
    np.testing.assert_array_equal(reference.run(str(path), [X.numpy()])[0], want)
