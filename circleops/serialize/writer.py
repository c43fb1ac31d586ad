"""ir.Model -> Circle / TFLite file: atomic, deterministic, weights streamed (not copied).

The flatbuffer the Builder packs holds only the graph (tables, shapes, options); the
weights are streamed from the model's own memory to the file after it:

* inline layout (default): every Buffer.data is an ordinary flatbuffer vector placed after
  the packed tables. A uoffset may point anywhere forward, so Buffer.data points past the
  end of what the Builder produced and the file is a plain, valid flatbuffer; only the
  Builder never holds the bytes. Limited to 2 GiB in total (flatbuffer offsets are 32-bit).
* offset layout (past 2 GiB, or ``weights_after=True``): Buffer.offset/size give absolute
  file positions of the data after the flatbuffer (the TFLite/Circle large-model convention).

Data starts are aligned to ``ALIGN`` bytes in the file.
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import flatbuffers
import numpy as np

from circleops import ir
from circleops.errors import OutputError, TargetError, UnsupportedOpError
from circleops.serialize.buffers import BufferTable, identity_key, data_nbytes, materialize
from circleops.serialize.composite import encode_attributes
from circleops.serialize.schema import FormatRules, Schema, get_schema
from circleops import targets

ALIGN = 16
_COMPOSITE_OPTIONS = "StableHLOCompositeOptions"


@dataclass
class WriteInfo:
    """What write_model wrote."""

    path: str
    fmt: str
    layout: str  # "inline" or "offset"
    file_bytes: int
    flatbuffer_bytes: int  # the packed tables, without the streamed weights
    weight_bytes: int  # bytes of buffer data (after sharing)
    buffers: int  # Model.buffers entries, the empty buffer 0 included
    shared_buffers: int  # constants that reused another constant's buffer
    seconds: float


def _rules(fmt: str) -> FormatRules:
    if fmt == "circle":
        from circleops.serialize.circle import RULES
    elif fmt == "tflite":
        from circleops.serialize.tflite import RULES
    else:
        raise TargetError(f"unknown file format {fmt!r}: use 'circle' or 'tflite'")
    return RULES


# ---------------------------------------------------------------------------------------
# ir.Model -> object-API tree
# ---------------------------------------------------------------------------------------

class _Placed:
    """A Buffer table whose data lies after the packed flatbuffer (see module doc)."""

    __slots__ = ("size", "tail_pos", "abs_offset", "layout")

    def __init__(self, size: int | None):
        self.size = size  # None: the empty sentinel / no data
        self.tail_pos = 0  # inline: position of the vector's length prefix past the flatbuffer end
        self.abs_offset = 0  # offset layout: absolute file position of the data
        self.layout = "inline"

    def Pack(self, builder: flatbuffers.Builder) -> int:  # noqa: N802 - object-API protocol
        builder.StartObject(3)
        if self.size is not None:
            if self.layout == "inline":
                # A negative Builder offset = that many bytes past the end of the finished
                # buffer; PrependUOffsetTRelative turns it into the forward distance.
                builder.PrependUOffsetTRelativeSlot(0, -self.tail_pos, 0)
            else:
                builder.PrependUint64Slot(1, self.abs_offset, 0)
                builder.PrependUint64Slot(2, self.size, 0)
        return builder.EndObject()


def _option_value(schema: Schema, options_type: str, name: str, value: Any, default: Any) -> Any:
    if isinstance(value, str) and not (default is None or isinstance(default, str)):
        enum_name = schema.enum_for_field(options_type, name)
        members = schema.enum_members(enum_name) if enum_name else {}
        key = value.upper()
        if key not in members:
            raise ValueError(
                f"{options_type}.{name}={value!r}: not a member of "
                f"{enum_name or 'a known enum'}; give one of {sorted(members) or 'the integer value'}")
        return members[key]
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


# Option fields that name a tensor's dtype: (inputs or outputs, position). Their default
# (0 = FLOAT32) would be wrong for e.g. ARG_MAX (LiteRT fails at prepare) or CAST.
_DTYPE_FIELDS: dict[str, tuple[str, int]] = {
    "inDataType": ("inputs", 0), "outDataType": ("outputs", 0), "outType": ("outputs", 0),
    "outputType": ("outputs", 0), "idxOutType": ("outputs", 1),
}


def _implied_options(op: ir.Operator, sg: ir.Subgraph, options_type: str, schema: Schema) -> dict[str, Any]:
    """Options for an op the IR gave none: defaults, except dtypes the tensors determine."""
    implied = {}
    for name in vars(schema.cls(options_type)()):
        side, pos = _DTYPE_FIELDS.get(name, (None, 0))
        indices = getattr(op, side) if side else []
        if pos < len(indices) and indices[pos] >= 0:
            implied[name] = sg.tensors[indices[pos]].dtype
    return implied


def _options(schema: Schema, options_type: str, options: dict[str, Any], where: str) -> Any:
    cls = schema.cls(options_type)
    if cls is None:
        raise UnsupportedOpError(
            f"{where}: options table {options_type!r} does not exist in the {schema.name} schema")
    obj = cls()
    for name, value in options.items():
        if not hasattr(obj, name):
            fields = sorted(k for k in vars(obj))
            raise ValueError(f"{where}: {options_type} has no field {name!r}; fields: {fields}")
        if options_type == _COMPOSITE_OPTIONS and name == "compositeAttributes":
            value = encode_attributes(value) if isinstance(value, dict) or value is None else value
        setattr(obj, name, _option_value(schema, options_type, name, value, getattr(obj, name)))
    return obj


def _quantization(schema: Schema, t: ir.Tensor, where: str, index: dict[int, int] | None = None) -> Any:
    """ir.QuantParams -> a QuantizationParameters table (scale, zero_point, quantized_dimension;
    per-group scales as the details BlockwiseQuantization, ``index``: tensor id -> index)."""
    q = t.quant
    if q.blockwise is not None:
        return _blockwise(schema, t, where, (index or {}).get(id(q.blockwise.scales)))
    scale = np.ascontiguousarray(q.scale, dtype="<f4").reshape(-1)
    zero_point = np.ascontiguousarray(q.zero_point, dtype="<i8").reshape(-1)
    if t.dtype in ir.GGML_BLOCKS:
        raise TargetError(f"{where}: {t.dtype} carries its scales in its blocks; it takes no "
                          "QuantizationParameters (onert refuses them)")
    if not len(scale) or len(zero_point) not in (len(scale), 0):
        raise TargetError(f"{where}: quantization has {len(scale)} scales and {len(zero_point)} "
                          "zero points; give one zero point per scale")
    if len(scale) > 1:
        dim = q.quantized_dimension
        if not 0 <= dim < len(t.shape) or t.shape[dim] != len(scale):
            raise TargetError(
                f"{where}: {len(scale)} per-channel scales along dimension {dim} do not match "
                f"shape {list(t.shape)}")
    qp = schema.cls("QuantizationParameters")()
    qp.scale = scale
    qp.zeroPoint = zero_point if len(zero_point) else np.zeros(len(scale), dtype="<i8")
    qp.quantizedDimension = int(q.quantized_dimension)
    return qp


def _blockwise(schema: Schema, t: ir.Tensor, where: str, scales_index: int | None) -> Any:
    """QuantizationParameters whose details are a BlockwiseQuantization naming the scales
    tensor (zero_points -1: symmetric); scale / zero_point stay empty (the schema ignores them)."""
    b = t.quant.blockwise
    if "BlockwiseQuantization" not in schema.enum_members("QuantizationDetails"):
        raise TargetError(f"{where}: per-group (blockwise) scales do not exist in the {schema.name} schema; "
                          "write target circle")
    rows_cols = tuple(t.shape)
    s_shape = tuple(b.scales.shape)
    if len(rows_cols) != 2 or b.block_size < 1 or rows_cols[1] % b.block_size \
            or s_shape != (rows_cols[0], rows_cols[1] // b.block_size):
        raise TargetError(f"{where}: blockwise scales of shape {list(s_shape)} with block size {b.block_size} "
                          f"do not fit weight shape {list(rows_cols)} (expected [rows, cols / block size])")
    if scales_index is None:
        raise TargetError(f"{where}: its blockwise scales tensor {b.scales.name!r} is not in the subgraph")
    bq = schema.cls("BlockwiseQuantization")()
    bq.scales = scales_index
    bq.zeroPoints = -1
    bq.blockSize = int(b.block_size)
    qp = schema.cls("QuantizationParameters")()
    qp.detailsType = schema.enum_members("QuantizationDetails")["BlockwiseQuantization"]
    qp.details = bq
    qp.quantizedDimension = int(t.quant.quantized_dimension)
    return qp


def _with_block_scales(sg: ir.Subgraph) -> tuple[list[ir.Tensor], dict[int, int]]:
    """The subgraph's tensors, then the blockwise scales tensors no operator reads (they are
    referenced by index from a weight's quantization); tensor id -> index."""
    tensors = list(sg.tensors)
    index = {id(t): k for k, t in enumerate(tensors)}
    for t in sg.tensors:
        b = t.quant.blockwise if t.quant is not None else None
        if b is not None and id(b.scales) not in index:
            index[id(b.scales)] = len(tensors)
            tensors.append(b.scales)
    return tensors, index


class _OperatorCodes:
    """The model's OperatorCode tables, one per (operator, version, custom code), in first-use order."""

    def __init__(self, schema: Schema, rules: FormatRules):
        self.schema, self.rules = schema, rules
        self.index: dict[tuple[str, int, str | None], int] = {}
        self.tables: list[Any] = []

    def __call__(self, name: str, version: int, where: str, custom_code: str | None = None) -> int:
        """The index of the operator code for ``name`` (added on first use)."""
        key = (name, self.rules.op_version(name, version), custom_code)
        if key not in self.index:
            code = self.schema.opcodes.get(name)
            if code is None:
                raise UnsupportedOpError(
                    f"{where}: operator {name!r} does not exist in the {self.schema.name} schema; "
                    f"choose a target whose lowering writes it differently")
            oc = self.schema.cls("OperatorCode")()
            oc.builtinCode = code
            oc.deprecatedBuiltinCode = self.rules.deprecated_code(code)
            oc.version = key[1]
            oc.customCode = custom_code
            self.index[key] = len(self.tables)
            self.tables.append(oc)
        return self.index[key]


def _build(model: ir.Model, schema: Schema, rules: FormatRules) -> tuple[Any, BufferTable, list[_Placed]]:
    """The object-API ModelT and the buffers whose data the file streams after it."""
    table = BufferTable()
    opcodes = _OperatorCodes(schema, rules)
    subgraphs = [_subgraph(schema, si, sg, table, opcodes) for si, sg in enumerate(model.subgraphs)]
    signatures = [_signature(schema, sig) for sig in model.signatures]
    metadata = []
    for name, blob in model.metadata.items():
        md = schema.cls("Metadata")()
        md.name = name
        md.buffer = table.add_raw(np.frombuffer(bytes(blob), dtype=np.uint8))
        metadata.append(md)

    placed = [_Placed(None if d is None else d.nbytes) for d in table.datas]
    m = schema.cls("Model")()
    m.version = schema.version
    m.operatorCodes = opcodes.tables
    m.subgraphs = subgraphs
    m.description = model.description
    m.buffers = placed
    if metadata:
        m.metadata = metadata
    if signatures:
        m.signatureDefs = signatures
    return m, table, placed


def _subgraph(schema: Schema, si: int, sg: ir.Subgraph, table: BufferTable, opcodes: _OperatorCodes) -> Any:
    """One SubGraph table: its tensors (constants' data added to ``table``) and operators."""
    all_tensors, tensor_index = _with_block_scales(sg)
    s = schema.cls("SubGraph")()
    s.tensors = [_tensor(schema, t, f"subgraph {si}", table, tensor_index) for t in all_tensors]
    s.operators = [_operator(schema, op, f"subgraph {si} ({sg.name}) operator {oi} ({op.opcode})", sg, opcodes)
                   for oi, op in enumerate(sg.operators)]
    s.inputs = [int(i) for i in sg.inputs]
    s.outputs = [int(i) for i in sg.outputs]
    s.name = sg.name
    return s


def _tensor(schema: Schema, t: ir.Tensor, subgraph: str, table: BufferTable, tensor_index: dict[int, int]) -> Any:
    """One Tensor table (a dynamic dimension is 1 in shape, -1 in shapeSignature)."""
    tt = schema.cls("Tensor")()
    shape = [int(d) for d in t.shape]
    tt.shape = [d if d >= 0 else 1 for d in shape]
    if any(d < 0 for d in shape):
        tt.shapeSignature = shape
    if t.dtype not in schema.tensor_types:
        if t.dtype in ir.GGML_BLOCKS:
            raise TargetError(
                f"tensor {t.name!r} ({subgraph}): {t.dtype} block-quantized weights "
                f"exist only in Circle (onert runs them); the {schema.name} schema has no "
                "GGML types: write target circle/onert, or leave out quantize for tflite")
        raise TargetError(
            f"tensor {t.name!r} ({subgraph}): dtype {t.dtype} does not exist in the "
            f"{schema.name} schema")
    tt.type = schema.tensor_types[t.dtype]
    tt.name = t.name
    tt.hasRank = True
    if t.quant is not None:
        tt.quantization = _quantization(schema, t, f"tensor {t.name!r} ({subgraph})", tensor_index)
    if t.data is not None:
        tt.buffer = table.add(t.data, t.dtype, tuple(shape), t.name)
    return tt


def _operator(schema: Schema, op: ir.Operator, where: str, sg: ir.Subgraph, opcodes: _OperatorCodes) -> Any:
    """One Operator table: operands, operator code, options."""
    o = schema.cls("Operator")()
    o.inputs = [int(i) for i in op.inputs]
    o.outputs = [int(i) for i in op.outputs]
    if op.opcode == "CUSTOM":
        # No options table: the custom code names the op, its options are raw bytes.
        o.opcodeIndex = opcodes(op.opcode, op.version, where, op.options.get("customCode"))
        raw = op.options.get("customOptions") or b""
        o.customOptions = np.frombuffer(bytes(raw), dtype=np.uint8) if raw else None
    else:
        o.opcodeIndex = opcodes(op.opcode, op.version, where)
    options_type = op.options_type or schema.default_options_type(op.opcode)
    if options_type:
        try:
            attr, tag = schema.union_of(options_type)
        except KeyError:
            raise UnsupportedOpError(
                f"{where}: options {options_type!r} are not in the {schema.name} "
                f"schema's BuiltinOptions unions") from None
        options = op.options if op.options_type else _implied_options(op, sg, options_type, schema)
        setattr(o, attr, _options(schema, options_type, options, where))
        setattr(o, attr + "Type", tag)
    return o


def _signature(schema: Schema, sig: ir.Signature) -> Any:
    """One SignatureDef table: its key, subgraph and input/output tensor maps."""
    sd = schema.cls("SignatureDef")()
    sd.signatureKey = sig.key
    sd.subgraphIndex = sig.subgraph_index
    maps = []
    for group in (sig.inputs, sig.outputs):
        entries = []
        for name, index in group.items():
            tm = schema.cls("TensorMap")()
            tm.name = name
            tm.tensorIndex = int(index)
            entries.append(tm)
        maps.append(entries)
    sd.inputs, sd.outputs = maps
    return sd


# ---------------------------------------------------------------------------------------
# layout and packing
# ---------------------------------------------------------------------------------------

def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def _pack(m: Any, identifier: bytes) -> bytearray:
    builder = flatbuffers.Builder(4096)
    # minalign = ALIGN makes the packed size a multiple of ALIGN, so the tail's alignment
    # relative to the end of the flatbuffer is also its alignment in the file.
    builder.Prep(ALIGN, 0)
    root = m.Pack(builder)
    builder.Finish(root, file_identifier=identifier)
    return builder.Output()


def _layout_inline(placed: list[_Placed]) -> int:
    """Tail positions for inline vectors; returns the tail's length."""
    pos = 0
    for p in placed:
        if p.size is None:
            continue
        p.layout = "inline"
        # length prefix (4 bytes) right before ALIGN-aligned data
        data_start = _align(pos + 4)
        p.tail_pos = data_start - 4
        pos = data_start + p.size
    return pos


def _layout_offset(placed: list[_Placed], data_start: int) -> int:
    pos = data_start
    for p in placed:
        if p.size is None:
            continue
        p.layout = "offset"
        pos = _align(pos)
        p.abs_offset = pos
        pos += p.size
    return pos


@dataclass
class _FileLayout:
    """Where the weights go (inline, or after the flatbuffer) and the packed flatbuffer for it."""

    head: bytes  # the packed flatbuffer
    layout: str
    file_bytes: int


def _plan(m: Any, placed: list[_Placed], schema: Schema, weights_after: bool | None,
          too_large: Callable[[int], str] | None = None) -> _FileLayout:
    if not weights_after:
        tail = _layout_inline(placed)
        # Past the limit the inline offsets would not even fit 32 bits: do not pack them.
        head = bytes(_pack(m, schema.identifier)) if tail <= targets.FLATBUFFER_LIMIT else b""
        total = _align(len(head) + tail)
        if total <= targets.FLATBUFFER_LIMIT or weights_after is False:
            if total > targets.FLATBUFFER_LIMIT:
                if too_large is not None:
                    raise TargetError(too_large(total))
                raise TargetError(
                    f"the model needs {total} bytes, past the 2 GiB flatbuffer limit, "
                    "and weights_after=False forbids storing the weights after the flatbuffer; "
                    "leave weights_after unset")
            return _FileLayout(head, "inline", total)
    # Two passes: the first fixes the flatbuffer's size (offset values do not change it:
    # the uint64 fields are present either way), the second writes the real offsets.
    _layout_offset(placed, 2 * ALIGN)
    size = len(_pack(m, schema.identifier))
    end = _layout_offset(placed, _align(size))
    head = bytes(_pack(m, schema.identifier))
    assert len(head) == size, "flatbuffer size changed between layout passes"
    if len(head) > targets.FLATBUFFER_LIMIT:
        raise TargetError(f"the graph alone takes {len(head)} bytes, past the 2 GiB flatbuffer limit")
    return _FileLayout(head, "offset", end)


def _stream(f: BinaryIO, plan: _FileLayout, placed: list[_Placed], table: BufferTable) -> None:
    f.write(plan.head)
    pos = len(plan.head)
    for p, data in zip(placed, table.datas):
        if p.size is None:
            continue
        if plan.layout == "inline":
            target = len(plan.head) + p.tail_pos
            f.write(b"\0" * (target - pos))
            f.write(p.size.to_bytes(4, "little"))
            pos = target + 4
        else:
            f.write(b"\0" * (p.abs_offset - pos))
            pos = p.abs_offset
        f.write(memoryview(materialize(data)))  # a LazyBytes copy lives only for this write
        pos += p.size
    # A tail pad keeps the file size a multiple of ALIGN (mmap-friendly, deterministic).
    f.write(b"\0" * (_align(pos) - pos))


# ---------------------------------------------------------------------------------------
# atomic file write
# ---------------------------------------------------------------------------------------

def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would race with other threads)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 minus the process umask."""
    return 0o666 & ~_umask()


def default_dir_mode() -> int:
    """The mode ``mkdir`` gives a new directory: 0o777 minus the process umask."""
    return 0o777 & ~_umask()


def temp_prefix(path: Path) -> str:
    """Temporaries of ``path`` are ``.NAME.<pid>-<random>.tmp`` beside it: the pid says
    whether their writer still runs, so a later run can remove those a kill left behind."""
    return f".{path.name}.{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove ``.NAME.<pid>-*.tmp`` files and directories beside ``path`` whose writer is
    dead (killed with SIGKILL, or a power loss); those of running writers stay."""
    removed = []
    prefix = f".{path.name}."
    try:
        entries = list(os.scandir(path.parent if str(path.parent) else "."))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                import shutil

                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _open_temp(path: Path) -> tuple[BinaryIO, str]:
    directory = path.parent
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a directory; give a file name")
    if not directory.is_dir():
        raise OutputError(f"cannot write {path}: directory {directory} does not exist; create it first")
    remove_stale_temporaries(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=directory)
    except OSError as err:
        raise OutputError(
            f"cannot write {path}: {err.strerror or err}; choose a writable directory") from None
    # mkstemp makes the file 0600 and the mode survives the rename: give the file the mode
    # a plain open() would (umask), or keep the mode of the file it replaces.
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = default_file_mode()
    try:
        os.fchmod(fd, mode)
    except OSError:
        pass
    return os.fdopen(fd, "wb"), tmp


def _atomic_write(path: Path, write, check: Callable[[Path], None] | None = None) -> None:
    f, tmp = _open_temp(path)
    try:
        with f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if check is not None:  # e.g. verify: only a file that passed replaces the old one
            check(Path(tmp))
        os.replace(tmp, path)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise OutputError(f"cannot write {path}: {err.strerror or err}") from err
        raise
    try:  # make the rename durable; not possible on every file system
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _memory_key(data: Any, nbytes: int) -> tuple | None:
    """(address, bytes) of a contiguous constant: views of one memory in another shape count
    once (a linear's weight [N, K] and its 1x1 CONV_2D filter [N, 1, 1, K] in the graphs of
    one file: the writer stores those bytes once). None for a strided view."""
    if isinstance(data, np.ndarray) and data.flags.c_contiguous:
        return ("memory", data.__array_interface__["data"][0], nbytes)
    torch = sys.modules.get("torch")  # a torch tensor exists only where torch is imported
    if torch is not None and isinstance(data, torch.Tensor) and data.is_contiguous():
        try:
            return ("memory", data.untyped_storage().data_ptr() + data.storage_offset() * data.element_size(), nbytes)
        except Exception:  # noqa: BLE001 - tensor subclasses without storage
            return None
    return None


def constant_bytes(model: ir.Model) -> int:
    """The bytes the model's weights take in a file, from the IR alone: each constant once
    per memory it views (tied weights count once), aligned, plus the metadata.

    Nothing is hashed, copied or packed, so a size rule (target onert: at most 2 GiB) can
    refuse a multi-GB model before the writer touches its weights. Byte-identical copies
    in different memory count twice here though the writer stores them once: an upper
    bound, short of the graph tables (kilobytes).
    """
    seen: set[tuple] = set()
    total = 0
    for sg in model.subgraphs:
        for t in sg.tensors:
            if t.data is None:
                continue
            n = data_nbytes(t.dtype, tuple(t.shape))
            key = _memory_key(t.data, n) or identity_key(t.data) or ("object", id(t.data))
            if key in seen:
                continue
            seen.add(key)
            total += _align(4 + n)
    return total + sum(_align(4 + len(bytes(blob))) for blob in model.metadata.values())


def write_model(model: ir.Model, path: str | os.PathLike, fmt: str = "circle", *,
                weights_after: bool | None = None, too_large: Callable[[int], str] | None = None,
                check: Callable[[Path], None] | None = None) -> WriteInfo:
    """Write ``model`` as a Circle ("circle", identifier CIR0) or TFLite ("tflite", TFL3) file.

    weights_after: None (default) stores the weights inline unless the file would pass
    2 GiB; True always stores them after the flatbuffer (Buffer.offset/size); False never
    (a model past 2 GiB is then a TargetError, raised before anything is written, whose
    message is ``too_large(bytes needed)`` when given: the caller knows why the layout is
    forbidden and what the user can do).

    The write is atomic (a temp file in the same directory, fsync, rename): on failure no
    file is left at ``path``, and a file it replaces is untouched. ``check(temp_path)``, when
    given, runs on the complete temporary file before the rename (verify): if it raises, the
    temporary is removed and ``path`` keeps its previous content. The file gets the mode a
    plain ``open()`` would give (umask), or the mode of the file it replaces. The same IR
    always gives the same bytes.
    """
    t0 = time.perf_counter()
    rules = _rules(fmt)
    schema = get_schema(rules.schema_name)
    path = Path(path)
    m, table, placed = _build(model, schema, rules)
    plan = _plan(m, placed, schema, weights_after, too_large)
    if plan.layout == "offset" and not rules.reads_offset_buffers:
        raise TargetError(rules.offset_refusal)
    _atomic_write(path, lambda f: _stream(f, plan, placed, table), check)
    return WriteInfo(
        path=str(path), fmt=fmt, layout=plan.layout, file_bytes=os.path.getsize(path),
        flatbuffer_bytes=len(plan.head), weight_bytes=table.data_bytes,
        buffers=len(table.datas), shared_buffers=table.shared,
        seconds=time.perf_counter() - t0)
