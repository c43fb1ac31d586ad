"""circleops.serialize.integrity: every file circleops writes passes; every kind of damage
that makes onert read outside the file (or outside a buffer) is a CorruptFileError naming
the file and what is wrong; the verifier itself never raises anything else and never hangs."""
from __future__ import annotations

import os
import random
import sys

import flatbuffers
import numpy as np
import pytest
import torch

from circleops import ir
from circleops.errors import CircleOpsError, CorruptFileError, ModelLoadError
from circleops.serialize import write_model
from circleops.serialize.schema import get_schema
from circleops.serialize.integrity import (SCALAR, STRING, TABLE, UNION, VEC_SCALAR, VEC_TABLE, table_plan,
                                        union_members, check_file)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fuzz"))


def _reachable(fmt: str) -> set[str]:
    """Every table reachable from Model, through fields and every union member."""
    seen, todo = set(), ["Model"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for f in table_plan(fmt, name).fields:
            if f.kind in (TABLE, VEC_TABLE):
                todo.append(f.target)
            elif f.kind == UNION:
                todo.extend(union_members(fmt, f.target).values())
    return seen


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_every_table_of_the_schema_has_a_plan_from_the_bindings(fmt):
    tables = _reachable(fmt)
    assert {"Model", "SubGraph", "Tensor", "Operator", "Buffer", "OperatorCode", "SignatureDef",
            "QuantizationParameters", "SparsityParameters", "StableHLOCompositeOptions"} <= tables
    assert len(tables) > 150  # every options table of both unions
    kinds = {f.name: (f.kind, f.size, f.target) for f in table_plan(fmt, "Tensor").fields}
    assert kinds["Shape"] == (VEC_SCALAR, 4, None) and kinds["Type"][:2] == (SCALAR, 1)
    assert kinds["Name"][0] == STRING and kinds["Quantization"] == (TABLE, 4, "QuantizationParameters")
    op = {f.name: f for f in table_plan(fmt, "Operator").fields}
    assert op["BuiltinOptions"].kind == UNION and op["BuiltinOptions"].target == "BuiltinOptions"
    assert op["BuiltinOptionsType"].slot + 1 == op["BuiltinOptions"].slot
    assert {f.name: f.default for f in table_plan(fmt, "OperatorCode").fields}["Version"] == 1


# --------------------------------------------------------------------------- files that pass

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        import circleops.ops  # noqa: F401

        return torch.ops.circle.rms_norm(self.lin(x), self.w).softmax(-1)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    import circleops

    d = tmp_path_factory.mktemp("verify")
    x = torch.randn(2, 4, 8)
    out = {}
    for target, suffix in (("circle", ".circle"), ("onert", ".circle"), ("tflite", ".tflite")):
        out[target] = d / f"net_{target}{suffix}"
        circleops.convert(_Net().eval(), (x,), out[target], target=target, fuse="auto")
    return out


def _ggml_model(last: int = 64, nbytes: int | None = None) -> ir.Model:
    per_block, block = ir.GGML_BLOCKS["GGML_Q4_0"]
    n = 4 * last // per_block * block if nbytes is None else nbytes
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, last), "FLOAT32"))
    w = sg.add_tensor(ir.Tensor("w", (4, last), "GGML_Q4_0", np.zeros(n, np.uint8)))
    y = sg.add_tensor(ir.Tensor("y", (1, 4), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions", {}))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])


def test_files_circleops_writes_pass(written, tmp_path):
    for target, path in written.items():
        info = check_file(path)
        assert info.fmt == ("tflite" if target == "tflite" else "circle") and info.tables > 10
        assert "FLOAT32" in info.tensor_types and info.offset_buffers == 0
    ggml = tmp_path / "q4.circle"
    write_model(_ggml_model(), ggml, "circle")
    assert "GGML_Q4_0" in check_file(ggml).tensor_types
    # weights after the flatbuffer (Buffer.offset/size): sound, and reported
    from circleops.serialize import read_model

    after = tmp_path / "after.circle"
    write_model(read_model(written["onert"]), after, "circle", weights_after=True)
    assert check_file(after).offset_buffers > 0


def test_composite_with_its_decomposition_subgraph_passes(written):
    from circleops.serialize import read_model

    m = read_model(written["tflite"])
    assert len(m.subgraphs) > 1  # the STABLEHLO_COMPOSITE's decomposition
    check_file(written["tflite"])


# --------------------------------------------------------------------------- damage

def _edit(src, dst, edit, fmt="circle"):
    schema = get_schema(fmt)
    m = schema.cls("Model").InitFromPackedBuf(bytearray(src.read_bytes()), 0)
    edit(m)
    b = flatbuffers.Builder(0)
    b.Finish(m.Pack(b), file_identifier=schema.identifier)
    dst.write_bytes(bytes(b.Output()))
    return dst


def _first_const(m):
    for t in m.subgraphs[0].tensors:
        data = m.buffers[t.buffer].data
        if data is not None and len(data) >= 16:
            return t
    raise AssertionError("no constant")


def _fc(m):
    return next(op for op in m.subgraphs[0].operators if len(op.inputs) >= 2)


def _move_weights(buffer):
    buffer.data, buffer.offset, buffer.size = None, 1 << 40, 64


DAMAGE = {
    # what -> (edit of the ModelT, words the error must contain)
    "op input out of range": (lambda m: _fc(m).inputs.__setitem__(0, 100000), "input 0 is tensor 100000"),
    "op output -1": (lambda m: m.subgraphs[0].operators[0].outputs.__setitem__(0, -1), "output 0 is tensor -1"),
    "two writers": (lambda m: m.subgraphs[0].operators[1].outputs.__setitem__(0, m.subgraphs[0].operators[0].outputs[0]),
                    "already holds a value"),
    "negative stride": (lambda m: setattr(next(op.builtinOptions for op in m.subgraphs[0].operators
                                               if hasattr(op.builtinOptions, "strideH")), "strideH", -2),
                        "StrideH is -2"),
    "weights omitted": (lambda m: _fc(m).inputs.__setitem__(1, -1), "input 1 is missing (-1)"),
    # long fuzz run of 2026-12-01: a shared vtable's name entry nulled, onert SIGSEGV while loading
    "tensor without a name": (lambda m: setattr(m.subgraphs[0].tensors[0], "name", None), "tensor 0: it has no name"),
    "deprecated code 0": (lambda m: setattr(next(oc for oc in m.operatorCodes if oc.builtinCode > 0),
                                            "deprecatedBuiltinCode", 0), "name different operators"),
    "codes disagree": (lambda m: setattr(next(oc for oc in m.operatorCodes if oc.builtinCode < 0),
                                         "deprecatedBuiltinCode", 0), "name different operators"),
    "opcode index": (lambda m: setattr(m.subgraphs[0].operators[0], "opcodeIndex", 1000), "opcode index 1000"),
    "buffer index": (lambda m: setattr(_first_const(m), "buffer", 100000), "buffer index 100000"),
    "subgraph input": (lambda m: m.subgraphs[0].inputs.__setitem__(0, 7777), "input 0 is tensor 7777"),
    "constant size": (lambda m: _first_const(m).shape.__setitem__(0, _first_const(m).shape[0] * 4), "needs"),
    "tensor type": (lambda m: setattr(m.subgraphs[0].tensors[0], "type", 99), "tensor type 99"),
    "unknown operator": (lambda m: [setattr(m.operatorCodes[0], a, v) for a, v in (("builtinCode", 250),
                                                                                   ("deprecatedBuiltinCode", 127))],
                         "builtin code 250"),
    "union tag": (lambda m: setattr(next(op for op in m.subgraphs[0].operators if op.builtinOptions is not None),
                                    "builtinOptionsType", 200), "union type 200"),
    "options of another op": (lambda m: setattr(next(op for op in m.subgraphs[0].operators
                                                     if op.builtinOptions is not None), "builtinOptionsType", 1),
                              "it carries Conv2DOptions"),
    "options missing": (lambda m: setattr(next(op for op in m.subgraphs[0].operators
                                               if op.builtinOptions is not None), "builtinOptions", None),
                        "it carries no options"),
    "schema version": (lambda m: setattr(m, "version", 7), "schema version 7"),
    "buffer past the end": (lambda m: _move_weights(m.buffers[_first_const(m).buffer]), "past the end"),
    "no subgraph": (lambda m: setattr(m, "subgraphs", []), "no subgraph"),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damage_is_a_clear_error_naming_file_and_place(written, tmp_path, what):
    edit, words = DAMAGE[what]
    path = _edit(written["onert"], tmp_path / "bad.circle", edit)
    with pytest.raises(CorruptFileError) as err:
        check_file(path)
    message = str(err.value)
    assert str(path) in message and words in message and "not a valid circle file" in message, message


def test_signature_and_composite_indices_are_checked(written, tmp_path):
    def bad_signature(m):
        m.signatureDefs[0].subgraphIndex = 42

    with pytest.raises(CorruptFileError, match="subgraph index 42"):
        check_file(_edit(written["tflite"], tmp_path / "sig.tflite", bad_signature, "tflite"))

    def bad_decomposition(m):
        op = next(op for op in m.subgraphs[0].operators if op.builtinOptions2 is not None)
        op.builtinOptions2.decompositionSubgraphIndex = 99

    with pytest.raises(CorruptFileError, match="DecompositionSubgraphIndex 99"):
        check_file(_edit(written["tflite"], tmp_path / "comp.tflite", bad_decomposition, "tflite"))


def test_ggml_sizes_are_whole_blocks_of_the_last_dimension(tmp_path):
    from circleops.serialize.integrity import check_buffer

    for last, nbytes, words in ((64, 4 * 2 * 18 - 18, "needs 144 bytes"), (48, 4 * 2 * 18, "whole number")):
        good = tmp_path / "good.circle"
        write_model(_ggml_model(), good, "circle")
        schema = get_schema("circle")

        def edit(m, last=last, nbytes=nbytes):
            m.subgraphs[0].tensors[1].shape = [4, last]
            m.buffers[m.subgraphs[0].tensors[1].buffer].data = np.zeros(nbytes, np.uint8)

        data = _edit(good, tmp_path / "q.circle", edit).read_bytes()
        with pytest.raises(CorruptFileError, match=words):
            check_buffer(data, len(data), "q.circle", "circle")
        assert schema.identifier == data[4:8]


def test_header_damage(written, tmp_path):
    data = written["onert"].read_bytes()
    cases = {"short.circle": data[:6], "trunc.circle": data[: len(data) // 2],
             "root.circle": (len(data) + 64).to_bytes(4, "little") + data[4:],
             "ident.circle": data[:4] + b"CIR1" + data[8:]}
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(ModelLoadError):
            check_file(p)


def test_mutated_files_give_only_circleops_errors(written):
    """The fuzz harness's mutations, in process: the verifier raises a CircleOpsError or
    passes; anything else (IndexError, struct.error, RecursionError...) fails."""
    from circleops.serialize.integrity import check_buffer
    from fuzz import mutate

    rng = random.Random(24)
    seeds = [(p.read_bytes(), "tflite" if p.suffix == ".tflite" else "circle") for p in written.values()]
    refused = passed = 0
    for _ in range(600):
        data, fmt = rng.choice(seeds)
        bad, _ = mutate(rng, data)
        try:
            check_buffer(bad, len(bad), "case", fmt)
            passed += 1
        except CircleOpsError:
            refused += 1
    assert refused > 300 and passed > 0, (refused, passed)


def _strided_slice_model(strides="const", begin_len: int = 2, stride_value: int = 1) -> ir.Model:
    """x [4, 8] -> STRIDED_SLICE(begin, end, strides) -> y [2, 8]; ``strides``: "const" (an INT32
    constant of ``stride_value``s) or "input" (a FLOAT32 subgraph input of the same shape, as in
    the fuzz finding where the strides became a float activation)."""
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (4, 8), "FLOAT32"))
    begin = sg.add_tensor(ir.Tensor("begin", (begin_len,), "INT32", np.zeros(begin_len, np.int32)))
    end = sg.add_tensor(ir.Tensor("end", (2,), "INT32", np.array([2, 8], np.int32)))
    if strides == "const":
        st = sg.add_tensor(ir.Tensor("strides", (2,), "INT32", np.full(2, stride_value, np.int32)))
    else:
        st = sg.add_tensor(ir.Tensor("strides", (2,), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("y", (2, 8), "FLOAT32"))
    opts = {"beginMask": 0, "endMask": 0, "ellipsisMask": 0, "newAxisMask": 0, "shrinkAxisMask": 0, "offset": False}
    sg.operators.append(ir.Operator("STRIDED_SLICE", [x, begin, end, st], [y], "StridedSliceOptions", opts))
    sg.inputs, sg.outputs = [x] + ([st] if strides == "input" else []), [y]
    return ir.Model([sg])


@pytest.mark.parametrize("kwargs,words", [
    # the long fuzz run of 2026-12-01: a STRIDED_SLICE's strides index moved onto a float32
    # input; onert read its zeros as stride 0 (SIGSEGV, contained by `circleops run`)
    (dict(strides="input"), "input 3 is FLOAT32; STRIDED_SLICE reads it as integers"),
    (dict(stride_value=0), "strides [0, 0] hold a 0"),
    (dict(begin_len=3), "input 1 has shape [3]; it needs one value per dimension of the rank-2 input"),
])
def test_index_operands_are_integers_of_the_input_rank(tmp_path, kwargs, words):
    good = tmp_path / "good.circle"
    write_model(_strided_slice_model(), good, "circle")
    check_file(good)
    bad = tmp_path / "bad.circle"
    write_model(_strided_slice_model(**kwargs), bad, "circle")
    with pytest.raises(CorruptFileError, match="not a valid circle file") as err:
        check_file(bad)
    assert words in str(err.value) and "operator 0 (STRIDED_SLICE)" in str(err.value), str(err.value)


def test_gather_indices_are_integers(tmp_path):
    sg = ir.Subgraph("main")
    table = sg.add_tensor(ir.Tensor("table", (16, 4), "FLOAT32", np.zeros((16, 4), np.float32)))
    ids = sg.add_tensor(ir.Tensor("ids", (3,), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("y", (3, 4), "FLOAT32"))
    sg.operators.append(ir.Operator("GATHER", [table, ids], [y], "GatherOptions", {"axis": 0, "batchDims": 0}))
    sg.inputs, sg.outputs = [ids], [y]
    path = tmp_path / "gather.circle"
    write_model(ir.Model([sg]), path, "circle")
    with pytest.raises(CorruptFileError, match="input 1 is FLOAT32; GATHER reads it as integers"):
        check_file(path)
