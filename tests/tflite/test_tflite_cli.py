"""`circleops convert ... --target tflite --verify` and `circleops inspect model.tflite`."""
from __future__ import annotations

import json

import pytest

from circleops.cli import main
from families import BY_NAME


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    BY_NAME["llama"].config().to_json_file(str(path))
    return path


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_convert_and_inspect(capsys, tmp_path, config_json, dtype):
    out = tmp_path / "m.tflite"
    report = tmp_path / "report.json"
    assert main(["convert", "--config", str(config_json), "-o", str(out), "--target", "tflite", "--dtype", dtype,
                 "--seq-len", "8", "--verify", "--report", str(report), "-q"]) == 0
    rep = json.loads(report.read_text())
    assert rep["verify"]["runtime"] == "litert" and rep["verify"]["passed"]
    assert rep["format"] == "tflite" and rep["dtype"] == dtype
    assert out.read_bytes()[4:8] == b"TFL3"
    capsys.readouterr()

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TFLite (TFL3)" in text
    eps = BY_NAME["llama"].config().rms_norm_eps
    assert f"odml.rms_norm" in text and f"epsilon={eps}" in text
    assert "circle.attention" in text and "scale=" in text

    assert main(["inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in summary["composites"]}
    layers = BY_NAME["llama"].config().num_hidden_layers
    counts = {}
    for c in summary["composites"]:
        counts[c["name"]] = counts.get(c["name"], 0) + c["count"]
    assert counts == {"odml.rms_norm": 2 * layers + 1, "circle.attention": layers}
    assert names["odml.rms_norm"]["attributes"] == {"epsilon": pytest.approx(eps)}
