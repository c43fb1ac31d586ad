"""The integrity check of a Circle / TFLite file before a native runtime reads it (structural:
offsets, tables, indices and sizes; the numeric comparison with torch is ``--verify``).

onert loads a Circle file with flatbuffers' C++ accessors and no verifier: an offset, a vector
length or a tensor index that points outside the file makes it read out of bounds in the
user's process (SIGSEGV / SIGBUS, issue 24). :func:`check_file` checks, over the raw bytes
of the memory-mapped file (no weight is copied or even read):

* the root offset, the file identifier (``CIR0`` / ``TFL3``) and the schema version;
* every table reachable from the root (Model, subgraphs, tensors, operators and their
  options, buffers, signatures, quantization, sparsity...): its vtable and every field in
  bounds; every string, vector and nested table in bounds and aligned;
* subgraph, tensor, buffer and opcode indices in range (``-1`` only where it means an
  optional operator input), operator codes and tensor types the schema knows;
* every constant buffer's byte size = shape x element size (GGML block types by whole blocks
  of the last dimension), and weights stored after the flatbuffer (Buffer.offset/size)
  inside the file.

The table layouts are not written here: they are read once from the generated bindings
(circle_schema, ai_edge_litert.schema_py_generated), whose accessor of each field says its
vtable slot and its kind (scalar of a type, string, table, union, vector of scalars / tables
/ strings). Each table is visited once (a table shared by several parents is not walked
again), and flatbuffer offsets only point forward, so the walk ends, in time proportional
to the file's structure: ~20 ms for SmolLM2's 540 MB decode graph (bench/README.md).

    from circleops.serialize.integrity import check_file
    check_file("model.circle")          # CorruptFileError naming the file and what is wrong
"""
from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circleops import ir
from circleops.errors import CorruptFileError, ModelLoadError
from circleops.serialize.buffers import ELEMENT_SIZE
from circleops.serialize.reader import detect_format
from circleops.serialize.schema import Schema, get_schema

# field kinds
SCALAR, STRING, TABLE, UNION, VEC_SCALAR, VEC_TABLE, VEC_STRING = range(7)

# flatbuffers.number_types.<X>Flags -> struct format
_FLAGS = {"Bool": "?", "Int8": "b", "Uint8": "B", "Int16": "h", "Uint16": "H", "Int32": "i", "Uint32": "I",
          "Int64": "q", "Uint64": "Q", "Float32": "f", "Float64": "d"}
# bytes per element of a constant, beyond buffers.ELEMENT_SIZE (types circleops does not write)
_MORE_ELEMENT_SIZES = {"COMPLEX64": 8, "COMPLEX128": 16, "FLOAT8_E4M3FN": 1, "FLOAT8_E5M2": 1}

# option fields that must be >= 1 (onert divides by them: a stride of -2 killed it)
_POSITIVE_OPTIONS = ("Stride", "Dilation", "Filter")

# operator -> input positions the runtimes read as integer vectors (indices, shapes, axes,
# begin/end/strides...): a float tensor there is read as int32 bits (a STRIDED_SLICE whose
# strides were a float32 activation killed onert: zeros read as stride 0)
_INTEGER_OPERANDS = {"STRIDED_SLICE": (1, 2, 3), "SLICE": (1, 2), "RESHAPE": (1,), "TRANSPOSE": (1,), "GATHER": (1,),
                     "GATHER_ND": (1,), "PAD": (1,), "PADV2": (1,), "MIRROR_PAD": (1,), "MEAN": (1,), "SUM": (1,),
                     "REDUCE_MAX": (1,), "REDUCE_MIN": (1,), "REDUCE_PROD": (1,), "REDUCE_ANY": (1,),
                     "EXPAND_DIMS": (1,), "TILE": (1,), "BROADCAST_TO": (1,)}
_INDEX_TYPES = ("INT32", "INT64")
# operator -> input positions onert reads when it prepares the kernel, so they must be
# constants in a Circle file: a reduction whose axes were a runtime input (a graph input or
# another op's output) killed onert 0.1.0 (SIGSEGV: MEAN, SUM and REDUCE_MAX measured on
# one-op files; LiteRT reads them at run time, so .tflite files may compute them)
_CONSTANT_OPERANDS = {"MEAN": (1,), "SUM": (1,), "REDUCE_MAX": (1,), "REDUCE_MIN": (1,), "REDUCE_PROD": (1,),
                      "REDUCE_ANY": (1,)}

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_HH = struct.Struct("<HH")


@dataclass(frozen=True)
class Field:
    """One field of a table, as its generated accessor reads it."""

    name: str  # the accessor's name (e.g. "OpcodeIndex")
    slot: int  # index in the vtable
    kind: int
    size: int  # bytes of a scalar / of one vector element
    fmt: str  # struct format of a scalar / vector element ("" for offsets)
    default: Any  # value when absent (scalars); None otherwise
    target: str | None  # the table (TABLE, VEC_TABLE) or union enum (UNION) it points to


@dataclass(frozen=True)
class TablePlan:
    """What the integrity check checks in one table type."""

    name: str
    fields: tuple[Field, ...]
    struct: struct.Struct | None = None  # unused placeholder for symmetry (kept for clarity)


# ----------------------------------------------------------------------------------- plans

_METHOD = re.compile(r"\n    def (\w+)\(self(?:, j)?\):\n(.*?)(?=\n    (?:def |@)|\Z)", re.S)
_SLOT = re.compile(r"self\._tab\.Offset\((\d+)\)")
_GET = re.compile(r"number_types\.(\w+)Flags, (o|a) \+")
_OBJ = re.compile(r"obj = (\w+)\(\)")
_RETURN = re.compile(r"\n\s+return (.+)")
_CREATOR = re.compile(r"(\w+)Creator\(self\.\w+Type, \w+\.(\w+)\(\)\)")


@functools.lru_cache(maxsize=None)
def _module_text(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _top_level_block(text: str, header: str) -> str:
    """The lines of ``text`` from ``header`` (a top-level statement) to the next one."""
    start = text.find("\n" + header)
    if start < 0:
        return ""
    nxt = re.compile(r"\n(?=\S)").search(text, start + 1 + len(header))
    return text[start:nxt.start() if nxt else len(text)]


def _class_source(schema: Schema, table: str) -> tuple[str, str]:
    """The source of the reader class ``table`` and of its object-API class ``tableT``, read
    from the generated module's file (inspect.getsource tokenizes: 10x slower, and this runs
    on every first check of a process)."""
    module = schema.module_for("Model")
    if module.__name__.endswith(".Model"):  # circle_schema: one module per table, side by side
        path = os.path.join(os.path.dirname(module.__file__), f"{table}.py")
        if not os.path.isfile(path):
            raise LookupError(f"the {schema.name} schema has no table {table}")
    else:
        path = module.__file__
    text = _module_text(path)
    src = _top_level_block(text, f"class {table}(object):")
    if not src:
        raise LookupError(f"the {schema.name} schema has no table {table}")
    return src, _top_level_block(text, f"class {table}T(object):")


def _default(text: str) -> Any:
    text = text.strip()
    if text in ("True", "False"):
        return text == "True"
    try:
        return float(text) if any(c in text for c in ".eEn") and text not in ("None",) else int(text)
    except ValueError:
        return None


def _parse_plan(schema: Schema, table: str) -> TablePlan:
    """The fields of ``table`` from its generated accessors (one per vtable slot)."""
    src, obj_src = _class_source(schema, table)
    unions = {method: enum for enum, method in _CREATOR.findall(obj_src)}
    fields: dict[int, Field] = {}
    for name, body in _METHOD.findall(src):
        slot_m = _SLOT.search(body)
        if slot_m is None or name.endswith(("AsNumpy", "Length", "IsNone")) or "VectorLen" in body \
                or "GetVectorAsNumpy" in body or "return o == 0" in body:
            continue  # Init/GetRootAs, or a helper of a field parsed from its main accessor
        slot = (int(slot_m.group(1)) - 4) // 2
        if "self._tab.Union(" in body:
            if name not in unions:
                raise LookupError(f"{schema.name}.{table}.{name}: a union without its Creator in {table}T")
            fields[slot] = Field(name, slot, UNION, 4, "", None, unions[name])
        elif "self._tab.Vector(o)" in body:
            obj = _OBJ.search(body)
            get = _GET.search(body)
            if "Indirect(x)" in body and obj:
                fields[slot] = Field(name, slot, VEC_TABLE, 4, "", None, obj.group(1))
            elif "self._tab.String(a" in body:
                fields[slot] = Field(name, slot, VEC_STRING, 4, "", None, None)
            elif get and get.group(2) == "a":
                fmt = _FLAGS[get.group(1)]
                fields[slot] = Field(name, slot, VEC_SCALAR, struct.calcsize(fmt), fmt, None, None)
            else:  # a vector of structs: neither schema has one today
                raise LookupError(f"{schema.name}.{table}.{name}: a field kind the integrity check does not know")
        elif "self._tab.String(o" in body:
            fields[slot] = Field(name, slot, STRING, 4, "", None, None)
        elif "Indirect(o" in body:
            obj = _OBJ.search(body)
            if obj is None:
                raise LookupError(f"{schema.name}.{table}.{name}: a table field without its class")
            fields[slot] = Field(name, slot, TABLE, 4, "", None, obj.group(1))
        else:
            get = _GET.search(body)
            if get is None or get.group(2) != "o":
                raise LookupError(f"{schema.name}.{table}.{name}: a field kind the integrity check does not know")
            fmt = _FLAGS[get.group(1)]
            returns = _RETURN.findall(body)  # the last one is the value when absent
            fields[slot] = Field(name, slot, SCALAR, struct.calcsize(fmt), "<" + fmt,
                                 _default(returns[-1]) if returns else 0, None)
    return TablePlan(table, tuple(fields[s] for s in sorted(fields)))


@functools.lru_cache(maxsize=None)
def table_plan(fmt: str, table: str) -> TablePlan:
    """The integrity check's plan of ``table`` in schema ``fmt`` (read from the bindings once)."""
    return _parse_plan(get_schema(fmt), table)


@functools.lru_cache(maxsize=None)
def union_members(fmt: str, union: str) -> dict[int, str]:
    """Union tag -> the table it holds (tag 0, NONE, is absent)."""
    schema = get_schema(fmt)
    return {tag: name for name, tag in schema.enum_members(union).items() if tag != 0}


# ----------------------------------------------------------------------------------- the walk

class _Where:
    """Where in the file a table is, built into words only when an error is reported."""

    __slots__ = ("parent", "label")

    def __init__(self, parent: "_Where | None", label: str):
        self.parent, self.label = parent, label

    def __str__(self) -> str:
        parts = []
        node: _Where | None = self
        while node is not None:
            parts.append(node.label)
            node = node.parent
        return " > ".join(reversed(parts))


class _Walker:
    """Checks every table reachable from the root; records each table's field values
    (scalars decoded, vectors as (start, count), tables as their records)."""

    def __init__(self, fmt: str, buf: Any, size: int, path: str):
        self.fmt, self.buf, self.size, self.path = fmt, buf, size, path
        self.seen: dict[tuple[int, str], dict[str, Any]] = {}
        self.layouts: dict[tuple[int, str], tuple[int, dict[str, Any], tuple]] = {}

    def fail(self, where: _Where | str, what: str) -> CorruptFileError:
        return CorruptFileError(f"{self.path} is not a valid {self.fmt} file: {where}: {what}. The file is damaged or "
                                f"was not written by a Circle/TFLite writer; onert and LiteRT would read outside it, "
                                f"so circleops refuses to load it. Convert or download it again.")

    def offset(self, fp: int, where: _Where, name: str) -> int:
        """The position an offset field at ``fp`` points to, checked to hold at least 4 bytes."""
        if fp & 3:
            raise self.fail(where, f"field {name} is a misaligned offset (at byte {fp})")
        target = fp + _U32.unpack_from(self.buf, fp)[0]
        if target & 3 or target + 4 > self.size:
            raise self.fail(where, f"field {name} points to byte {target}, outside the {self.size}-byte file "
                                   f"or misaligned")
        return target

    def vector(self, target: int, elem: int, where: _Where, name: str) -> int:
        n = _U32.unpack_from(self.buf, target)[0]
        if target + 4 + n * elem > self.size:
            raise self.fail(where, f"vector {name} claims {n} entries of {elem} bytes at byte {target}, past the end "
                                   f"of the {self.size}-byte file")
        return n

    def string(self, target: int, where: _Where, name: str) -> int:
        n = _U32.unpack_from(self.buf, target)[0]
        end = target + 4 + n
        if end + 1 > self.size or self.buf[end] != 0:
            raise self.fail(where, f"string {name} at byte {target} ({n} bytes) runs past the end of the file or "
                                   f"is not terminated")
        return n

    def layout(self, vt: int, table: str, pos: int, where: _Where) -> tuple[int, dict[str, Any], tuple]:
        """The checked layout of one vtable for ``table`` (computed once per vtable: writers share
        vtables, so SmolLM2's 5,000 tables have 17): the table size, the absent fields'
        defaults and the present fields (name, kind, offset in the table, struct, target)."""
        key = (vt, table)
        found = self.layouts.get(key)
        if found is not None:
            return found
        buf, size = self.buf, self.size
        if vt < 0 or vt & 1 or vt + 4 > size:
            raise self.fail(where, f"the {table} table at byte {pos} has its vtable at byte {vt}, outside the file")
        vtsize, tblsize = _HH.unpack_from(buf, vt)
        if vtsize < 4 or vtsize & 1 or vt + vtsize > size or tblsize < 4:
            raise self.fail(where, f"the {table} table at byte {pos} has a broken vtable (vtable {vtsize} bytes, "
                                   f"table {tblsize} bytes)")
        nslots = (vtsize - 4) >> 1
        voffs = struct.unpack_from(f"<{nslots}H", buf, vt + 4) if nslots else ()
        defaults: dict[str, Any] = {}
        present = []
        for f in table_plan(self.fmt, table).fields:
            vo = voffs[f.slot] if f.slot < nslots else 0
            if not vo:
                defaults[f.name] = f.default
                continue
            if vo < 4 or vo + (f.size if f.kind == SCALAR else 4) > tblsize:
                raise self.fail(where, f"field {f.name} of the {table} table lies outside the table")
            present.append((f.name, f.kind, vo, struct.Struct(f.fmt) if f.kind == SCALAR else None,
                            f.target, f.size))
        found = self.layouts[key] = (tblsize, defaults, tuple(present))
        return found

    def table(self, pos: int, table: str, where: _Where) -> dict[str, Any]:
        key = (pos, table)
        rec = self.seen.get(key)
        if rec is not None:
            return rec
        buf = self.buf
        if pos & 3 or pos + 4 > self.size:
            raise self.fail(where, f"the {table} table at byte {pos} is outside the file or misaligned")
        tblsize, defaults, present = self.layout(pos - _I32.unpack_from(buf, pos)[0], table, pos, where)
        if pos + tblsize > self.size:
            raise self.fail(where, f"the {table} table at byte {pos} ({tblsize} bytes) runs past the end of the file")
        rec = dict(defaults)
        self.seen[key] = rec
        for name, kind, vo, st, target, elem in present:
            fp = pos + vo
            if kind == SCALAR:
                rec[name] = st.unpack_from(buf, fp)[0]
                continue
            dest = self.offset(fp, where, name)
            if kind == VEC_SCALAR:
                rec[name] = (dest + 4, self.vector(dest, elem, where, name))
            elif kind == TABLE:
                rec[name] = self.table(dest, target, _Where(where, name))
            elif kind == VEC_TABLE:
                n = self.vector(dest, 4, where, name)
                rec[name] = [self.table(self.offset(dest + 4 + 4 * i, where, f"{name}[{i}]"), target,
                                        _Where(where, f"{name}[{i}]")) for i in range(n)]
            elif kind == STRING:
                rec[name] = (dest + 4, self.string(dest, where, name))
            elif kind == VEC_STRING:
                n = self.vector(dest, 4, where, name)
                for i in range(n):
                    self.string(self.offset(dest + 4 + 4 * i, where, f"{name}[{i}]"), where, f"{name}[{i}]")
                rec[name] = (dest + 4, n)
            else:  # UNION: its type tag is the field before
                tag = rec.get(name + "Type") or 0
                if not tag:  # NONE: readers ignore the value
                    rec[name] = None
                    continue
                member = union_members(self.fmt, target).get(tag)
                if member is None:
                    raise self.fail(where, f"field {name} has union type {tag}, which {target} does not define")
                rec[name] = self.table(dest, member, _Where(where, name))
                rec[name + "Table"] = member
        return rec


# ----------------------------------------------------------------------------------- semantics

def _element_bytes(dtype: str) -> int | None:
    return ELEMENT_SIZE.get(dtype) or _MORE_ELEMENT_SIZES.get(dtype)


def _ints(buf: Any, vec: tuple[int, int] | None) -> tuple[int, ...]:
    if vec is None:
        return ()
    start, n = vec
    return struct.unpack_from(f"<{n}i", buf, start) if n else ()


@dataclass(frozen=True)
class CheckedFile:
    """What the integrity check learnt on the way (runtimes use it for their own refusals)."""

    path: str
    fmt: str  # "circle" or "tflite"
    size: int  # bytes
    tensor_types: frozenset[str]  # TensorType names of every tensor
    offset_buffers: int  # buffers whose bytes follow the flatbuffer (Buffer.offset/size)
    tables: int  # tables walked


@dataclass
class _ModelFacts:
    """What the checks of each subgraph need of the whole model (read once per file)."""

    w: _Walker
    schema: Schema
    names: list[str]  # opcode index -> operator name
    first_optional: list[int]  # opcode index -> the first input position that may be -1
    expected_options: dict[int, str]  # opcode index -> the options table the op must carry
    extents: list[tuple[int, int] | None]  # buffer index -> (bytes, where they start) of its constant
    nsub: int

    def fail(self, where: str, what: str) -> CorruptFileError:
        return self.w.fail(where, what)


def _check_model(w: _Walker, model: dict[str, Any], schema: Schema) -> tuple[frozenset[str], int]:
    if model["Version"] != schema.version:
        raise w.fail("the model", f"schema version {model['Version']}, where {schema.name} files have version "
                                  f"{schema.version}")
    subgraphs = model["Subgraphs"] or []
    if not subgraphs:
        raise w.fail("the model", "it has no subgraph")
    names = _opcode_names(w, model["OperatorCodes"] or [], schema)
    extents, offset_buffers = _buffer_extents(w, model["Buffers"] or [])
    facts = _ModelFacts(w, schema, names, _first_optional(names), _expected_options(names, schema), extents,
                        len(subgraphs))
    types: set[str] = set()
    for si, sg in enumerate(subgraphs):
        types |= _check_subgraph(facts, si, sg)
    _check_signatures(w, model, subgraphs)
    nbuf = len(extents)
    for k, md in enumerate(model.get("Metadata") or []):
        if md["Buffer"] >= nbuf:
            raise w.fail(f"metadata {k}", f"buffer index {md['Buffer']} is out of range (the file has {nbuf} buffers)")
    return frozenset(types), offset_buffers


def _opcode_names(w: _Walker, opcodes: list[dict[str, Any]], schema: Schema) -> list[str]:
    """The operator name of each operator code, its two code fields checked to agree."""
    opnames = schema.opnames
    names = []
    for k, oc in enumerate(opcodes):
        builtin, deprecated = oc["BuiltinCode"], oc["DeprecatedBuiltinCode"]
        # the two fields must name one operator: readers differ in which they trust (onert
        # takes the deprecated one below 127, so SOFTMAX with deprecated code 0 or a Circle
        # extended op whose deprecated code is not its negative code becomes ADD, with options
        # of the wrong type: SIGSEGV)
        if builtin < 0 or deprecated < 0:
            consistent = builtin == deprecated
        else:  # TFLite's rule; files older than builtin_code fill only the deprecated field
            consistent = not builtin or deprecated == min(builtin, 127)
        if not consistent:
            raise w.fail(f"operator code {k}", f"builtin code {builtin} and deprecated builtin code {deprecated} name "
                                               f"different operators")
        code = builtin if builtin < 0 else max(builtin, deprecated)
        if code not in opnames:
            raise w.fail(f"operator code {k}", f"builtin code {code} is not an operator of the {schema.name} schema")
        names.append(opnames[code])
    return names


def _first_optional(names: list[str]) -> list[int]:
    """opcode index -> the first input position that may be -1 (omitted): never an op's data
    or weights (LiteRT's FULLY_CONNECTED without weights is a SIGSEGV); the recurrent ops
    omit gates from input 1 on."""
    return [1 if "LSTM" in name or "RNN" in name else 2 for name in names]


def _expected_options(names: list[str], schema: Schema) -> dict[int, str]:
    """opcode index -> the options table the op must carry. Circle only: onert dereferences an
    op's options without a null or type check (a MUL without MulOptions, or with AddOptions,
    is a SIGSEGV); LiteRT checks, and TFLite converters omit options tables."""
    expected: dict[int, str] = {}
    if schema.name == "circle":
        for k, name in enumerate(names):
            table = schema.default_options_type(name)
            if table is not None:
                expected[k] = table
    return expected


def _buffer_extents(w: _Walker, buffers: list[dict[str, Any]]) -> tuple[list[tuple[int, int] | None], int]:
    """buffer index -> (bytes, where they start) of the constant it holds (None: no data), and
    how many buffers hold their bytes after the flatbuffer (checked to lie inside the file)."""
    extents: list[tuple[int, int] | None] = []
    offset_buffers = 0
    for b, rec in enumerate(buffers):
        data, offset, nbytes = rec["Data"], rec.get("Offset") or 0, rec.get("Size") or 0
        if data is not None and data[1]:
            extents.append((data[1], data[0]))
        elif offset > 1:
            if offset + nbytes > w.size:
                raise w.fail(f"buffer {b}", f"its weights at bytes {offset}..{offset + nbytes} lie past the end of the "
                                            f"{w.size}-byte file (truncated?)")
            extents.append((nbytes, offset))
            offset_buffers += 1
        else:
            extents.append(None)
    return extents, offset_buffers


def _check_subgraph(facts: _ModelFacts, si: int, sg: dict[str, Any]) -> set[str]:
    """One subgraph's tensors, operators and dataflow; the tensor types it holds."""
    buf = facts.w.buf
    tensors = sg["Tensors"] or []
    nt = len(tensors)
    types, ready, variables = _check_tensors(facts, si, tensors)
    for label, vec in (("input", sg["Inputs"]), ("output", sg["Outputs"])):
        for p, i in enumerate(_ints(buf, vec)):
            if not 0 <= i < nt:
                raise facts.fail(f"subgraph {si}", f"{label} {p} is tensor {i}, out of range (0..{nt - 1})")
    if si == 0 and not _ints(buf, sg["Outputs"]):  # (a CALL_ONCE init subgraph has none)
        raise facts.fail(f"subgraph {si}", "it has no output")
    # dataflow: an operator reads only what exists when it runs (an input, a constant, a
    # variable, or an earlier operator's output); onert runs a tensor nobody wrote as
    # unallocated memory (SIGSEGV)
    ready.update(_ints(buf, sg["Inputs"]))
    for k, op in enumerate(sg["Operators"] or []):
        _check_operator(facts, f"subgraph {si} operator {k}", op, tensors, (ready, variables))
    for p, i in enumerate(_ints(buf, sg["Outputs"])):
        if i not in ready:
            raise facts.fail(f"subgraph {si}", f"output {p} is tensor {i}, which no operator writes and which is not "
                                               f"an input or a constant")
    return types


def _check_tensors(facts: _ModelFacts, si: int, tensors: list[dict[str, Any]]) -> tuple[set[str], set[int], set[int]]:
    """Each tensor's name, type, buffer, shape, constant size and quantization; (the tensor
    types, the tensors that hold a value before the first operator runs, the variables)."""
    w, schema, buf, extents = facts.w, facts.schema, facts.w.buf, facts.extents
    nbuf = len(extents)
    types: set[str] = set()
    ready: set[int] = set()
    variables: set[int] = set()
    for ti, t in enumerate(tensors):
        where = f"subgraph {si} tensor {ti}"
        if schema.name == "circle" and t.get("Name") is None:  # (TFLite readers check)
            raise w.fail(where, "it has no name; onert reads tensor names without a check (SIGSEGV while loading)")
        tag = t["Type"]
        dtype = schema.tensor_type_names.get(tag)
        if dtype is None:
            raise w.fail(where, f"tensor type {tag} is not a {schema.name} TensorType")
        types.add(dtype)
        bi = t["Buffer"]
        if bi >= nbuf and not (bi == 0 and nbuf == 0):
            raise w.fail(where, f"buffer index {bi} is out of range (the file has {nbuf} buffers)")
        shape = _ints(buf, t["Shape"])
        if any(d < -1 for d in shape) or any(d < -1 for d in _ints(buf, t["ShapeSignature"])):
            raise w.fail(where, f"shape {list(shape)} has a dimension below -1")
        extent = extents[bi] if bi < nbuf else None
        if extent is not None:
            _check_constant(w, f"{where} (buffer {bi})", dtype, shape, extent[0])
            ready.add(ti)
        elif t["IsVariable"]:
            ready.add(ti)
            variables.add(ti)
        elif shape and 0 in shape:  # a constant of no elements has no bytes to store
            ready.add(ti)
        q = t["Quantization"]
        if q is not None:
            _check_quant(w, where, q, shape)
    return types, ready, variables


def _check_operator(facts: _ModelFacts, where: str, op: dict[str, Any], tensors: list[dict[str, Any]],
                    dataflow: tuple[set[int], set[int]]) -> None:
    """One operator: its opcode, operands, integer operands, outputs and options.
    ``dataflow``: (the tensors holding a value so far, updated with its outputs; the variables)."""
    ready, variables = dataflow
    buf, nt = facts.w.buf, len(tensors)
    oi = op["OpcodeIndex"]
    if oi >= len(facts.names):
        raise facts.fail(where, f"opcode index {oi} is out of range (the file has {len(facts.names)} operator codes)")
    name = facts.names[oi]
    where = f"{where} ({name})"
    for label, vec, low in (("input", op["Inputs"], -1), ("output", op["Outputs"], 0)):
        for p, i in enumerate(_ints(buf, vec)):
            if not low <= i < nt:
                raise facts.fail(where, f"{label} {p} is tensor {i}, out of range ({low}..{nt - 1})")
            if i < 0 and p < facts.first_optional[oi]:
                raise facts.fail(where, f"input {p} is missing (-1); only later inputs (a bias...) may be omitted")
            if low < 0 and i >= 0 and i not in ready:
                raise facts.fail(where, f"input {p} is tensor {i}, which is not a subgraph input, a constant or the "
                                        f"output of an earlier operator")
    _check_integer_operands(facts.w, where, name, _ints(buf, op["Inputs"]), tensors=tensors,
                            type_names=facts.schema.tensor_type_names, extents=facts.extents)
    for p, i in enumerate(_ints(buf, op["Outputs"])):
        # each tensor gets one value: an operator writing a subgraph input, a
        # constant or another operator's output (or one output twice) makes onert
        # plan two owners for one buffer (SIGSEGV); variables are written in place
        if i in ready and i not in variables:
            raise facts.fail(where, f"output {p} is tensor {i}, which already holds a value (a subgraph input, a "
                                    f"constant or an earlier output)")
        ready.add(i)
    _check_options(facts, where, op, oi)


def _check_options(facts: _ModelFacts, where: str, op: dict[str, Any], oi: int) -> None:
    """The operator carries the options table its operator reads; strides, dilations and
    filter sizes are at least 1; a subgraph index option names a subgraph."""
    name = facts.names[oi]
    expected = facts.expected_options.get(oi)
    if expected is not None:
        carried = op.get("BuiltinOptionsTable") or op.get("BuiltinOptions2Table")
        # an empty options table (ExpOptions...) is nothing to read: writers may omit it
        if carried != expected and (carried is not None or table_plan(facts.w.fmt, expected).fields):
            raise facts.fail(where, f"it carries {carried or 'no options'} where {name} has {expected} (onert reads "
                                    f"them without a check)")
    for attr in ("BuiltinOptions", "BuiltinOptions2"):
        options = op.get(attr)
        if not options:
            continue
        for field, value in options.items():
            if field.startswith(_POSITIVE_OPTIONS) and isinstance(value, int) and value < 1:
                raise facts.fail(where, f"{field} is {value}; strides, dilations and filter sizes are at least 1")
            if field.endswith("SubgraphIndex") and isinstance(value, int) and not 0 <= value < facts.nsub:
                raise facts.fail(where, f"{field} {value} is out of range (the file has {facts.nsub} subgraphs)")


def _check_signatures(w: _Walker, model: dict[str, Any], subgraphs: list[dict[str, Any]]) -> None:
    nsub = len(subgraphs)
    for k, sd in enumerate(model.get("SignatureDefs") or []):
        si = sd["SubgraphIndex"]
        if not 0 <= si < nsub:
            raise w.fail(f"signature {k}", f"subgraph index {si} is out of range (the file has {nsub} subgraphs)")
        nt = len(subgraphs[si]["Tensors"] or [])
        for tm in (sd["Inputs"] or []) + (sd["Outputs"] or []):
            if not 0 <= tm["TensorIndex"] < nt:
                raise w.fail(f"signature {k}", f"tensor index {tm['TensorIndex']} is out of range (0..{nt - 1})")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_constant(w: _Walker, where: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    if any(d < 0 for d in shape):
        raise w.fail(where, f"a constant of shape {list(shape)} (unknown dimensions)")
    if dtype in ir.GGML_BLOCKS:
        per_block, block_bytes = ir.GGML_BLOCKS[dtype]
        if not shape or shape[-1] % per_block:
            raise w.fail(where, f"{dtype} {list(shape)}: the last dimension is not a whole number of "
                                f"{per_block}-value blocks")
        want = _numel(shape) // per_block * block_bytes
    else:
        elem = _element_bytes(dtype)
        if elem is None:
            return  # strings, resources, packed 4-bit types: sized by their own rules
        want = _numel(shape) * elem
    if nbytes != want:
        raise w.fail(where, f"a {dtype} constant of shape {list(shape)} needs {want} bytes, but its buffer holds "
                            f"{nbytes}")


def _check_integer_operands(w: _Walker, where: str, name: str, inputs: tuple[int, ...], *, tensors: list,
                            type_names: dict, extents: list) -> None:
    """An op's index/shape/axis inputs are INT32 or INT64; STRIDED_SLICE's and SLICE's begin,
    end (size) and strides are vectors, in a Circle file with one value per dimension of the
    input (onert reads that many; LiteRT reads the vector's own length, and TFLite's ellipsis
    and new-axis masks make it differ from the rank); a constant stride is not 0."""
    positions = _INTEGER_OPERANDS.get(name, ())
    for p in positions:
        if p >= len(inputs) or inputs[p] < 0:
            continue
        t = tensors[inputs[p]]
        if w.fmt == "circle" and p in _CONSTANT_OPERANDS.get(name, ()):
            bi = t["Buffer"]
            if not (0 < bi < len(extents) and extents[bi] is not None and extents[bi][0] > 0):
                raise w.fail(where, f"input {p} (the axes) is not a constant; onert reads a {name}'s axes when it "
                                    f"loads the file and needs them in it")
        dtype = type_names.get(t["Type"])
        allowed = _INDEX_TYPES + (("INT16",) if name.startswith("GATHER") else ())  # TFLite's int16 positions
        if dtype not in allowed:
            raise w.fail(where, f"input {p} is {dtype}; {name} reads it as integers ({' or '.join(allowed)})")
        if name not in ("STRIDED_SLICE", "SLICE") or inputs[0] < 0:
            continue
        rank, shape = len(_ints(w.buf, tensors[inputs[0]]["Shape"])), _ints(w.buf, t["Shape"])
        if rank and shape and (len(shape) != 1 or (shape[0] != rank and w.fmt == "circle")):
            raise w.fail(where, f"input {p} has shape {list(shape)}; it needs one value per dimension of the "
                                f"rank-{rank} input ([{rank}])")
        bi = t["Buffer"]
        extent = extents[bi] if bi < len(extents) else None
        if name == "STRIDED_SLICE" and p == 3 and extent is not None:
            width = 4 if dtype == "INT32" else 8
            strides = struct.unpack_from(f"<{extent[0] // width}{'i' if width == 4 else 'q'}", w.buf, extent[1])
            if 0 in strides:
                raise w.fail(where, f"strides {list(strides)} hold a 0; a stride is at least 1 in magnitude")


def _check_quant(w: _Walker, where: str, q: dict[str, Any], shape: tuple[int, ...]) -> None:
    scales = q["Scale"][1] if q["Scale"] is not None else 0
    zeros = q["ZeroPoint"][1] if q["ZeroPoint"] is not None else 0
    if zeros and scales and zeros != scales:
        raise w.fail(where, f"quantization with {scales} scales and {zeros} zero points")
    if scales > 1:
        qd = q["QuantizedDimension"]
        if not 0 <= qd < len(shape) or shape[qd] != scales:
            raise w.fail(where, f"{scales} per-channel scales along dimension {qd} of shape {list(shape)}")


# ----------------------------------------------------------------------------------- entry point

def check_buffer(buf: Any, size: int, path: str, fmt: str) -> CheckedFile:
    """Check the integrity of the ``size`` bytes of ``buf`` (bytes, mmap or memoryview) as a ``fmt`` file.
    CorruptFileError when anything is out of place."""
    schema = get_schema(fmt)
    w = _Walker(fmt, buf, size, path)
    if size < 8:
        raise w.fail("the header", f"{size} bytes is too short for a flatbuffer (truncated)")
    if bytes(buf[4:8]) != schema.identifier:
        raise w.fail("the header", f"file identifier {bytes(buf[4:8])!r}, expected {schema.identifier!r}")
    root = _U32.unpack_from(buf, 0)[0]
    if root < 8:
        raise w.fail("the header", f"root table offset {root} points into the header")
    try:
        model = w.table(root, "Model", _Where(None, "the model"))
        types, offset_buffers = _check_model(w, model, schema)
    except RecursionError:
        raise w.fail("the model", "tables nested too deep") from None
    return CheckedFile(path, fmt, size, types, offset_buffers, len(w.seen))


def check_file(path: str | os.PathLike) -> CheckedFile:
    """Check that the Circle or TFLite file at ``path`` is structurally sound, so that a native
    runtime can read it without reading out of bounds. Raises CorruptFileError (a
    ModelLoadError) naming the file and what is wrong; a ModelLoadError when it cannot be read
    or is no Circle/TFLite file at all."""
    fmt = detect_format(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    try:
        return check_buffer(buf, size, str(Path(path)), fmt)
    finally:
        if isinstance(buf, mmap.mmap):
            buf.close()


__all__ = ["CheckedFile", "check_buffer", "check_file", "table_plan", "union_members"]
