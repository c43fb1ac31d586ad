"""`circleops inspect`: text and JSON views of Circle and TFLite files, clear errors."""
from __future__ import annotations

import json

import pytest

from circleops.cli import main as cli
from circleops.serialize import write_model
from serialize import tiny_models


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inspect")
    out = {}
    model, _ = tiny_models.rms_norm_composite(eps=1e-5)
    write_model(model, d / "comp.tflite", "tflite")
    model, _ = tiny_models.rms_norm_circle()
    write_model(model, d / "rms.circle", "circle", weights_after=True)
    write_model(tiny_models.mixed_constants(), d / "mixed.circle", "circle")
    out.update(comp=d / "comp.tflite", rms=d / "rms.circle", mixed=d / "mixed.circle", dir=d)
    return out


def _json(capsys, path):
    assert cli(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_composite_tflite(files, capsys):
    s = _json(capsys, files["comp"])
    assert s["format"] == "tflite" and s["weights"] == "inline"
    assert s["op_histogram"] == {"MUL": 3, "ADD": 1, "MEAN": 1, "RSQRT": 1, "STABLEHLO_COMPOSITE": 1}
    assert [(g["name"], g["ops"]) for g in s["subgraphs"]] == [("main", 1), ("odml.rms_norm.decomposition", 6)]
    assert s["composites"] == [{"name": "odml.rms_norm", "decomposition_subgraph": 1,
                                "attributes": {"epsilon": 1e-5}, "version": 0, "count": 1}]
    (sig,) = s["signatures"]
    assert sig["key"] == "serving_default"
    assert sig["inputs"] == [{"name": "x", "dtype": "FLOAT32", "shape": [2, 8], "tensor": "x"}]
    assert s["subgraphs"][0]["outputs"] == [{"name": "y", "dtype": "FLOAT32", "shape": [2, 8]}]
    # gamma (32 B) in main; eps (4 B) and axis (INT32, 4 B) in the decomposition
    assert s["constants_by_dtype"] == {"FLOAT32": {"tensors": 2, "bytes": 36}, "INT32": {"tensors": 1, "bytes": 4}}


def test_json_circle_offsets_and_dtypes(files, capsys):
    s = _json(capsys, files["rms"])
    assert s["format"] == "circle" and s["weights"].startswith("after the flatbuffer")
    assert s["op_histogram"] == {"RMS_NORM": 1}
    s = _json(capsys, files["mixed"])
    by = s["constants_by_dtype"]
    assert by["BFLOAT16"] == {"tensors": 2, "bytes": 16} and by["INT64"] == {"tensors": 1, "bytes": 48}
    assert by["FLOAT32"] == {"tensors": 2, "bytes": 52} and by["BOOL"] == {"tensors": 1, "bytes": 3}
    assert s["subgraphs"][0]["inputs"][0]["shape"] == [-1, 3]
    assert s["metadata"] == {"note": 14}


def test_text(files, capsys):
    assert cli(["inspect", str(files["comp"])]) == 0
    out = capsys.readouterr().out
    assert "TFLite (TFL3)" in out
    assert "odml.rms_norm x1  decomposition subgraph 1  {epsilon=1e-05}" in out
    assert "'serving_default' -> subgraph 0" in out
    assert "STABLEHLO_COMPOSITE" in out and "[1] odml.rms_norm.decomposition: 6 ops" in out


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    (b"not a flatbuffer at all", "not a Circle or TFLite flatbuffer"),
    ("truncated", "cannot be decoded"),
])
def test_errors(files, capsys, content, message):
    path = files["dir"] / "bad.circle"
    if content == "truncated":
        path.write_bytes(files["mixed"].read_bytes()[:40])
    elif content is not None:
        path.write_bytes(content)
    else:
        path = files["dir"] / "missing.circle"
    assert cli(["inspect", str(path)]) == 2
    assert message in capsys.readouterr().err
