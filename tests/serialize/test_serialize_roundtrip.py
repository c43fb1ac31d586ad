"""write -> read -> write gives the same bytes; the reader restores what was written."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.serialize import read_model, write_model
from serialize import tiny_models

BUILDERS = {
    "fc_add": lambda: tiny_models.fc_add()[0],
    "rms_norm_circle": lambda: tiny_models.rms_norm_circle()[0],
    "composite": lambda: tiny_models.rms_norm_composite()[0],
    "broadcast_to": lambda: tiny_models.broadcast_to()[0],
    "mixed_constants": tiny_models.mixed_constants,
}
CASES = [(name, fmt) for name in BUILDERS for fmt in ("circle", "tflite") if not
         (name == "rms_norm_circle" and fmt == "tflite")]


@pytest.mark.parametrize("weights_after", [False, True])
@pytest.mark.parametrize("name,fmt", CASES)
def test_roundtrip_identical_bytes(tmp_path, name, fmt, weights_after):
    first, second = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
    write_model(BUILDERS[name](), first, fmt, weights_after=weights_after)
    write_model(read_model(first), second, fmt, weights_after=weights_after)
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_deterministic(tmp_path, fmt):
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(tiny_models.rms_norm_composite()[0], a, fmt)
    write_model(tiny_models.rms_norm_composite()[0], b, fmt)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("weights_after", [False, True])
def test_reader_restores_constants(tmp_path, weights_after):
    model = tiny_models.mixed_constants()
    path = tmp_path / "m.circle"
    info = write_model(model, path, "circle", weights_after=weights_after)
    back = read_model(path)
    assert back.metadata == {"note": b"circleops test"}
    assert back.description == model.description
    orig = {t.name: t for t in model.subgraphs[0].tensors}
    for t in back.subgraphs[0].tensors:
        o = orig[t.name]
        assert (t.shape, t.dtype) == (o.shape, o.dtype)
        if o.data is None:
            assert t.data is None
            continue
        want = o.data
        if isinstance(want, torch.Tensor):
            want = (want.view(torch.int16) if want.dtype == torch.bfloat16 else want).numpy()
        assert t.data.tobytes() == np.ascontiguousarray(want).tobytes(), t.name
        assert t.data.shape == o.shape
    # data sits 16-byte aligned in the file, whichever layout
    assert info.file_bytes % 16 == 0
    for t in back.subgraphs[0].tensors:
        if t.data is not None:
            assert _file_offset(t.data) % 16 == 0, t.name


def _file_offset(arr: np.ndarray) -> int:
    """Offset of a reader view in its memory-mapped file."""
    root = arr
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    start = np.frombuffer(root, np.uint8).__array_interface__["data"][0]
    return arr.__array_interface__["data"][0] - start


def test_reader_composite_and_signatures(tmp_path):
    path = tmp_path / "m.tflite"
    write_model(tiny_models.rms_norm_composite(eps=1e-5)[0], path, "tflite")
    back = read_model(path)
    op = back.subgraphs[0].operators[0]
    assert op.opcode == "STABLEHLO_COMPOSITE" and op.options_type == "StableHLOCompositeOptions"
    assert op.options["name"] == "odml.rms_norm"
    assert op.options["decompositionSubgraphIndex"] == 1
    assert op.options["compositeAttributes"] == {"epsilon": 1e-5}
    assert [s.name for s in back.subgraphs] == ["main", "odml.rms_norm.decomposition"]
    (sig,) = back.signatures
    assert (sig.key, sig.subgraph_index, sig.inputs, sig.outputs) == ("serving_default", 0, {"x": 0}, {"y": 2})
    mean = back.subgraphs[1].operators[1]
    assert (mean.opcode, mean.options_type, mean.options["keepDims"]) == ("MEAN", "ReducerOptions", True)
    assert back.subgraphs[0].tensors[0].shape == (2, 8)


def test_dynamic_dims_kept(tmp_path):
    path = tmp_path / "m.tflite"
    write_model(tiny_models.mixed_constants(), path, "tflite")
    assert read_model(path).subgraphs[0].tensors[-1].shape == (-1, 3)


def test_rewrite_in_place(tmp_path):
    """Reading a file (its constants map the file) and writing it back to the same path is
    safe: the new file replaces the old one by rename, the map keeps the old bytes."""
    path = tmp_path / "m.circle"
    write_model(tiny_models.mixed_constants(), path, "circle")
    before = path.read_bytes()
    model = read_model(path)
    write_model(model, path, "circle")
    assert path.read_bytes() == before
    assert model.subgraphs[0].tensors[0].data.shape == (4, 3)  # still readable
