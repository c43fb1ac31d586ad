"""Files past 2 GiB store the weights after the flatbuffer (Buffer.offset/size), which
LiteRT reads. Writing 2 GiB here would take minutes, so the limit is lowered instead: the
convert path then takes the same switch a large model takes, and LiteRT runs the result."""
from __future__ import annotations

import numpy as np

import circleops
from circleops import targets
from families import BY_NAME, example_ids
from tflite_util import litert, read


def _layout(path) -> tuple[int, int]:
    """(buffers with inline data, buffers placed by offset/size)."""
    m = read(path)
    inline = sum(1 for b in m.buffers if b.data is not None and len(b.data) > 0)
    after = sum(1 for b in m.buffers if b.offset > 1 and b.size > 0)
    return inline, after


def test_past_the_limit_weights_go_after_the_flatbuffer(tmp_path, monkeypatch):
    model = BY_NAME["llama"].build()
    ids = example_ids(seq_len=8)
    small = tmp_path / "inline.tflite"
    circleops.convert(model, (ids,), small, target="tflite")
    inline, after = _layout(small)
    assert inline > 0 and after == 0

    # a limit the graph fits under but graph + weights do not: what a 2 GiB model meets
    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", small.stat().st_size // 2)
    big = tmp_path / "offset.tflite"
    report = circleops.convert(model, (ids,), big, target="tflite", verify=True)
    assert report.verify.runtime == "litert" and report.verify.passed
    inline, after = _layout(big)
    assert inline == 0 and after > 0
    assert big.read_bytes()[4:8] == b"TFL3"
    for resolver in ("xnnpack", "builtin"):
        np.testing.assert_array_equal(litert(big, [ids.numpy()], resolver)[0], litert(small, [ids.numpy()], resolver)[0])
