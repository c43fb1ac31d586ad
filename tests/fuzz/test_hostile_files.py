"""Hand-made hostile Circle/TFLite files, one per defect found by hand: each must be refused
with a CircleOpsError that says what is wrong, quickly and without big allocations."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

import fuzz  # noqa: E402
from circleops import ir  # noqa: E402
from circleops.errors import CircleOpsError, ModelLoadError, RuntimeRunError  # noqa: E402
from circleops.runtime import reference  # noqa: E402
from circleops.serialize import read_model, write_model  # noqa: E402
from circleops.serialize.decode import WORK_FLOOR, WORK_PER_BYTE  # noqa: E402
from bounds import address_space_limit, reader_work  # noqa: E402


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return {s.name: s for s in fuzz.build_seeds(tmp_path_factory.mktemp("seeds"))}


def _write(tmp_path, data, suffix=".circle"):
    p = tmp_path / f"f{suffix}"
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_amplification_bomb_is_refused_fast(seeds, tmp_path, fmt, monkeypatch):
    # Thousands of subgraph entries sharing one operator table: bounded by the file's size,
    # counted in the reader's work units (the 20000 subgraphs would cost ~20000x more)
    data = fuzz._bomb(seeds[f"tiny_{fmt}"].data, fmt, 20000)
    path = _write(tmp_path, data, "." + fmt)
    with reader_work(monkeypatch) as work, pytest.raises(ModelLoadError, match="more work than a .*-byte file"):
        read_model(path)
    one = len(seeds[f"tiny_{fmt}"].data)  # the last charge may overshoot by one subgraph's cost
    assert work[0] <= WORK_PER_BYTE * len(data) + WORK_FLOOR + WORK_PER_BYTE * one + WORK_FLOOR


def test_the_same_file_without_sharing_still_reads(seeds, tmp_path):
    path = _write(tmp_path, fuzz._bomb(seeds["tiny_circle"].data, "circle", 1))
    assert len(read_model(path).subgraphs) == 1


def _model_with(mutate) -> ir.Model:
    m = fuzz._shape_ops_model()
    mutate(m.subgraphs[0])
    return m


def _write_ir(tmp_path, model, fmt="circle"):
    path = tmp_path / f"m.{fmt}"
    write_model(model, path, fmt)
    return path


def _patch_int32(data: bytes, old: list[int], new: list[int]) -> bytes:
    """Replace the one int32 vector holding exactly ``old`` (length-prefixed) with ``new``."""
    import struct

    needle = struct.pack(f"<I{len(old)}i", len(old), *old)
    assert data.count(needle) == 1, "the vector to patch is not unique"
    return data.replace(needle, struct.pack(f"<I{len(new)}i", len(new), *new))


def test_negative_tensor_index_does_not_wrap(tmp_path):
    model = fuzz._shape_ops_model()
    path = _write_ir(tmp_path, model)
    sg = model.subgraphs[0]
    fill = sg.operators[0]
    # FILL [dims, val] -> [filled]: point its second input at tensor -2 (would be the
    # second-to-last tensor with Python's negative indexing).
    data = _patch_int32(path.read_bytes(), fill.inputs, [fill.inputs[0], -2])
    with pytest.raises(ModelLoadError, match=r"input 1 of operator 0 of subgraph 0 \(FILL\) is -2, out of range"):
        read_model(_write(tmp_path, data))


def test_opcode_index_out_of_range(tmp_path):
    import struct

    tensors = [ir.Tensor(n, (2,), "FLOAT32") for n in "abc"]
    model = ir.Model([ir.Subgraph("g", tensors, [ir.Operator("RELU", [0], [1]), ir.Operator("TANH", [1], [2])],
                                  [0], [2])])
    path = _write_ir(tmp_path, model)
    data = bytearray(path.read_bytes())
    from circleops.serialize.schema import get_schema

    schema = get_schema("circle")
    root = schema.reader_cls("Model").GetRootAs(data, 0)
    op = root.Subgraphs(0).Operators(1)
    o = op._tab.Offset(4)  # opcode_index (1: written, not the default)
    assert o != 0 and op.OpcodeIndex() == 1
    struct.pack_into("<I", data, op._tab.Pos + o, 5)
    with pytest.raises(ModelLoadError, match="opcode index of operator 1 of subgraph 0 is 5, out of range"):
        read_model(_write(tmp_path, bytes(data)))


def test_constant_whose_shape_does_not_match_its_data_is_refused(tmp_path):
    model = fuzz._shape_ops_model()
    path = _write_ir(tmp_path, model)
    data = path.read_bytes()
    # "bshape" is INT32 [3] with data [3, 5, 4]; declare it [4]: 16 bytes wanted, 12 held.
    import struct

    needle = struct.pack("<Ii", 1, 3) + b""
    bad = None
    from circleops.serialize.schema import get_schema

    schema = get_schema("circle")
    buf = bytearray(data)
    root = schema.reader_cls("Model").GetRootAs(buf, 0)
    sg = root.Subgraphs(0)
    for i in range(sg.TensorsLength()):
        t = sg.Tensors(i)
        if t.Name() == b"bshape":
            vec = t._tab.Vector(t._tab.Offset(4))
            struct.pack_into("<i", buf, vec, 4)
            bad = bytes(buf)
    assert bad is not None and needle
    with pytest.raises(ModelLoadError, match=r"'bshape' of subgraph 0 is INT32 \[4\] \(16 bytes\) but its buffer"):
        read_model(_write(tmp_path, bad))


@pytest.mark.parametrize("op, values", [("FILL", [1 << 20, 1 << 20]), ("TILE", [1 << 30, 1 << 30]),
                                        ("BROADCAST_TO", [1 << 12, 1 << 12, 1 << 12]), ("PAD", [0, 1 << 30, 0, 1])])
def test_value_computed_shapes_are_checked_before_allocating(tmp_path, op, values, monkeypatch):
    # A ~2 KB file whose constants ask for terabytes: refused before allocating, by name.
    monkeypatch.delenv("CIRCLEOPS_MAX_TENSOR_BYTES", raising=False)
    model = fuzz._shape_ops_model()
    sg = model.subgraphs[0]
    name = {"FILL": "dims", "TILE": "mult", "BROADCAST_TO": "bshape", "PAD": "pads"}[op]
    t = next(t for t in sg.tensors if t.name == name)
    t.data = np.array(values, np.int32).reshape(t.data.shape if t.data.size == len(values) else (-1,))
    t.shape = tuple(t.data.shape)
    path = _write_ir(tmp_path, model)
    # with at most 200 MB more address space, an allocation of the asked size would fail
    # as a MemoryError, not as this refusal
    with address_space_limit(200 << 20), \
            pytest.raises(RuntimeRunError, match=rf"{op}.*over the interpreter's limit"):
        reference.run(path, [np.zeros((2, 3), np.float32)])


def test_declared_tensor_over_the_limit_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("CIRCLEOPS_MAX_TENSOR_BYTES", str(1 << 20))
    model = ir.Model([ir.Subgraph("g", [ir.Tensor("x", (4,), "FLOAT32"), ir.Tensor("huge", (1 << 20, 8), "FLOAT32")],
                                  [ir.Operator("RELU", [0], [1])], [0], [1])])
    with pytest.raises(RuntimeRunError, match="tensor 1 'huge' of subgraph 0 is declared FLOAT32"):
        reference.run(model, [np.zeros(4, np.float32)])


def test_broadcast_of_two_small_inputs_to_a_huge_output_is_refused(monkeypatch):
    monkeypatch.delenv("CIRCLEOPS_MAX_TENSOR_BYTES", raising=False)
    n = 1 << 18
    tensors = [ir.Tensor("a", (n, 1), "FLOAT32"), ir.Tensor("b", (1, n), "FLOAT32"), ir.Tensor("c", (-1, -1), "FLOAT32")]
    model = ir.Model([ir.Subgraph("g", tensors, [ir.Operator("ADD", [0, 1], [2], "AddOptions", {})], [0, 1], [2])])
    with pytest.raises(RuntimeRunError, match="broadcasting ADD.*over the interpreter's limit"):
        reference.run(model, [np.zeros((n, 1), np.float32), np.zeros((1, n), np.float32)])


def test_subgraph_calling_itself_is_an_error_not_a_crash(tmp_path):
    sg = ir.Subgraph("g", [ir.Tensor("x", (2,), "FLOAT32"), ir.Tensor("y", (2,), "FLOAT32")],
                     [ir.Operator("STABLEHLO_COMPOSITE", [0], [1], "StableHLOCompositeOptions",
                                  {"name": "loop", "decompositionSubgraphIndex": 0, "compositeAttributes": {}})],
                     [0], [1])
    with pytest.raises(RuntimeRunError, match="nested deeper than"):
        reference.run(ir.Model([sg]), [np.zeros(2, np.float32)])


def test_inconsistent_ir_model_is_a_runtime_error():
    sg = ir.Subgraph("g", [ir.Tensor("x", (2,), "FLOAT32")], [ir.Operator("RELU", [0], [7])], [0], [0])
    with pytest.raises(RuntimeRunError, match="inconsistent"):
        reference.run(ir.Model([sg]), [np.zeros(2, np.float32)])


@pytest.mark.parametrize("cut", [0, 7, 12, 40, 200, -300])
def test_truncated_files_are_model_load_errors(seeds, tmp_path, cut):
    for name in ("tiny_circle", "tiny_tflite"):
        data = seeds[name].data
        path = _write(tmp_path, data[:cut], seeds[name].suffix)
        with pytest.raises(CircleOpsError):
            read_model(path)


def test_composite_attributes_with_shared_references_are_bounded():
    from flatbuffers import flexbuffers

    from circleops.serialize.composite import decode_attributes

    # A vector of 40 references to one vector of 40 references to ...: 40^depth leaves
    # from a few KB. The bounded walk refuses it instead of expanding it.
    b = flexbuffers.Builder()
    with b.Vector():
        for _ in range(40):
            with b.Vector():
                for _ in range(40):
                    b.Int(1)
    small = b.Finish()
    assert len(decode_attributes(np.frombuffer(small, np.uint8))["value"]) == 40
    with pytest.raises(ValueError, match="more elements than their bytes"):
        decode_attributes(np.frombuffer(small, np.uint8), max_items=100)


def test_output_that_nothing_computes_is_a_runtime_error():
    sg = ir.Subgraph("g", [ir.Tensor("x", (2,), "FLOAT32"), ir.Tensor("y", (2,), "FLOAT32"),
                           ir.Tensor("orphan", (2,), "FLOAT32")],
                     [ir.Operator("RELU", [0], [1])], [0], [1, 2])
    with pytest.raises(RuntimeRunError, match=r"\['orphan'\].*never computed"):
        reference.run(ir.Model([sg]), [np.zeros(2, np.float32)])
