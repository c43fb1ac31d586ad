"""Bounded decoding of an untrusted Circle/TFLite flatbuffer into the schema's object API.

flatbuffers' Python code trusts the bytes: a vector length is read and iterated, tables can
be shared by any number of parents, and the generated ``InitFromPackedBuf`` decodes the
whole tree before anyone can look at it. A 100 KB file whose thousands of subgraph entries
point at one big operator table then decodes millions of operators (minutes, gigabytes).

Here the same ``*T`` objects are built table by table, and every vector, string and table
decoded is charged to a work budget proportional to the file's real size (a file that
shares nothing costs less than its size in bytes: each vector element takes at least one
byte, each table at least four). Vector counts are checked against the bytes left before
anything is iterated. Out-of-budget or out-of-range structure is a ModelLoadError; the
caller turns any other decoding exception into one too.
"""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

from circleops.errors import ModelLoadError
from circleops.serialize.schema import Schema

# Work units allowed per byte of file, plus a floor for tiny files. A file written without
# sharing costs at most ~1 unit per byte; anything beyond 4 comes from shared tables.
WORK_PER_BYTE = 4
WORK_FLOOR = 20_000


class Budget:
    """The decoding work left for one file."""

    def __init__(self, size: int, path: str):
        self.size = size
        self.path = path
        self.left = WORK_PER_BYTE * size + WORK_FLOOR

    def charge(self, units: int, what: str) -> None:
        self.left -= max(int(units), 0)
        if self.left < 0:
            raise ModelLoadError(
                f"{self.path}: decoding {what} needs more work than a {self.size}-byte file can describe "
                "without sharing its tables over and over (an amplification bomb, or a corrupt file); refused")

    def count(self, n: int, what: str, element_bytes: int = 4) -> int:
        """A vector's element count, checked to fit in the file, then charged."""
        n = int(n)
        if n < 0 or n * element_bytes > self.size:
            raise ModelLoadError(f"{self.path}: {what} claims {n} entries, more than the {self.size}-byte file "
                                 "can hold; the file is corrupt")
        self.charge(n, what)
        return n


def cost(value: Any, depth: int = 0) -> int:
    """Roughly how many elements an unpacked object holds (for the budget)."""
    if value is None or isinstance(value, (bool, int, float)):
        return 1
    if isinstance(value, (bytes, str, np.ndarray)):
        return 1 + len(value)
    if depth > 16:
        return 1
    if isinstance(value, list):
        return 1 + sum(cost(v, depth + 1) for v in value)
    if hasattr(value, "__dict__"):
        return 1 + sum(cost(v, depth + 1) for v in vars(value).values())
    return 1


def _unpack(schema: Schema, table: str, obj: Any, budget: Budget, what: str) -> Any:
    if obj is None:
        raise ModelLoadError(f"{budget.path}: {what} is missing (null); the file is corrupt")
    out = schema.cls(table).InitFromObj(obj)
    budget.charge(cost(out), what)
    return out


def decode_model(schema: Schema, buf: Any, size: int, path: str) -> Any:
    """The file's Model as the schema's object API (``ModelT``), decoded within the budget."""
    if size < 8:
        raise ModelLoadError(f"{path}: {size} bytes is too short for a flatbuffer; the file is truncated")
    root_pos = struct.unpack_from("<I", buf, 0)[0]
    if root_pos + 4 > size:
        raise ModelLoadError(f"{path}: the root table offset {root_pos} points past the end of the file "
                             f"({size} bytes); the file is truncated or corrupt")
    budget = Budget(size, path)
    root = schema.reader_cls("Model").GetRootAs(buf, 0)
    m = schema.cls("Model")()
    m.version = root.Version()
    m.description = root.Description()
    budget.charge(cost(m.description), "the description")

    def vector(length: int, get, table: str, what: str) -> list[Any] | None:
        if length == 0:
            return []
        return [_unpack(schema, table, get(i), budget, f"{what} {i}")
                for i in range(budget.count(length, what))]

    m.operatorCodes = vector(root.OperatorCodesLength(), root.OperatorCodes, "OperatorCode", "operator code")
    m.buffers = vector(root.BuffersLength(), root.Buffers, "Buffer", "buffer")
    m.metadata = vector(root.MetadataLength(), root.Metadata, "Metadata", "metadata entry")
    m.signatureDefs = []
    for i in range(budget.count(root.SignatureDefsLength(), "signature")):
        sd = root.SignatureDefs(i)
        budget.count(sd.InputsLength(), f"signature {i} inputs")
        budget.count(sd.OutputsLength(), f"signature {i} outputs")
        m.signatureDefs.append(_unpack(schema, "SignatureDef", sd, budget, f"signature {i}"))
    m.subgraphs = []
    # A subgraph table referenced again is charged its whole cost again, up front, without
    # decoding it twice: a bomb of shared entries is refused after a few hundred cheap steps.
    seen: dict[int, tuple[Any, int]] = {}
    for si in range(budget.count(root.SubgraphsLength(), "subgraph")):
        sg = root.Subgraphs(si)
        pos = sg._tab.Pos if sg is not None else -1
        if pos in seen:
            decoded, units = seen[pos]
            budget.charge(units, f"subgraph {si} (the same table as an earlier subgraph)")
        else:
            before = budget.left
            decoded = _subgraph(schema, sg, budget, si)
            seen[pos] = (decoded, before - budget.left)
        m.subgraphs.append(decoded)
    return m


def _subgraph(schema: Schema, sg: Any, budget: Budget, si: int) -> Any:
    if sg is None:
        raise ModelLoadError(f"{budget.path}: subgraph {si} is missing (null); the file is corrupt")
    out = schema.cls("SubGraph")()
    # Counted (and charged) before any operator or tensor is decoded: shared tables cost
    # their full size again at every reference, so a bomb stops here, early.
    n_tensors = budget.count(sg.TensorsLength(), f"subgraph {si} tensors")
    n_ops = budget.count(sg.OperatorsLength(), f"subgraph {si} operators")
    out.tensors = []
    for i in range(n_tensors):
        t = sg.Tensors(i)
        if t is not None and t.Sparsity() is not None:
            budget.count(t.Sparsity().DimMetadataLength(), f"subgraph {si} tensor {i} sparsity")
        if t is not None:
            budget.count(t.VariantTensorsLength(), f"subgraph {si} tensor {i} variants")
        out.tensors.append(_unpack(schema, "Tensor", t, budget, f"subgraph {si} tensor {i}"))
    out.operators = [_unpack(schema, "Operator", sg.Operators(i), budget, f"subgraph {si} operator {i}")
                     for i in range(n_ops)]
    out.inputs = sg.InputsAsNumpy() if not sg.InputsIsNone() else None
    out.outputs = sg.OutputsAsNumpy() if not sg.OutputsIsNone() else None
    budget.charge(cost(out.inputs) + cost(out.outputs), f"subgraph {si} inputs and outputs")
    out.name = sg.Name()
    budget.charge(cost(out.name), f"subgraph {si} name")
    return out
