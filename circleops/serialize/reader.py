"""Circle / TFLite file -> ir.Model (for inspect, the reference interpreter and round trips).

Reads any file with the CIR0 or TFL3 identifier, whoever wrote it: weights inline or after
the flatbuffer (Buffer.offset/size), extended Circle ops, composites (attributes decoded
from their flexbuffer), signatures, metadata. The file is memory-mapped and constant data
are read-only numpy views of the map: reading a multi-GB model copies no weights.
"""
from __future__ import annotations

import mmap
import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from circleops import ir
from circleops.errors import ModelLoadError
from circleops.serialize.buffers import NUMPY_DTYPE, data_nbytes, unpack_4bit
from circleops.serialize.composite import decode_attributes
from circleops.serialize.decode import Budget, decode_model
from circleops.serialize.schema import Schema, get_schema

IDENTIFIERS = {b"CIR0": "circle", b"TFL3": "tflite"}


def detect_format(path: str | os.PathLike) -> str:
    """"circle" or "tflite" from the file identifier; a clear error for anything else."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file; give the path of a .circle or .tflite file")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory; give the path of a .circle or .tflite file")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror or err}") from None
    fmt = IDENTIFIERS.get(head[4:8])
    if fmt is None:
        raise ModelLoadError(
            f"{path} is not a Circle or TFLite flatbuffer (file identifier {head[4:8]!r}, "
            "expected b'CIR0' or b'TFL3'); give a file written by circleops, tico, ONE or the "
            "TFLite converter")
    return fmt


def _str(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return _str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):  # nested option tables
        return {k: _plain(v) for k, v in vars(value).items()}
    return value


def _options(options_obj: Any, options_type: str) -> dict[str, Any]:
    out = {}
    for name, value in vars(options_obj).items():
        if options_type == "StableHLOCompositeOptions" and name == "compositeAttributes":
            out[name] = decode_attributes(value)
        else:
            out[name] = _plain(value)
    return out


def opcode_name(schema: Schema, oc: Any) -> str:
    """The BuiltinOperator name of an OperatorCode, Circle extended (negative) ops included."""
    builtin, deprecated = int(oc.builtinCode), int(oc.deprecatedBuiltinCode)
    if builtin < 0:
        code = builtin
    elif deprecated < 0:
        code = deprecated
    else:  # TFLite's rule: older files fill only the int8 field
        code = max(builtin, deprecated)
    return schema.opnames.get(code, f"UNKNOWN_{code}")


# The live read-only mappings, by the file's identity (device, inode, size, mtime): a second
# read of a file while the first's constants are alive maps it no second time. The reference
# interpreter opens a Session per graph of one signature file (convert --verify, generate): each
# mapping of the 1B shape's 2.47 GB fp16 file was resident on its own, 7.02 GB of RSS for 5.43
# GB of Pss (bench/results/37). circleops' writer replaces a file (a new inode), never edits it.
_MAPPINGS: "weakref.WeakValueDictionary[tuple[int, int, int, int], mmap.mmap]" = weakref.WeakValueDictionary()


def _mapped(path: str | os.PathLike) -> tuple[str, Any, Any, int]:
    """(format, schema, the file mapped read-only, its size): what every reader starts from;
    the mapping is shared with the readers of the same file still alive."""
    fmt = detect_format(path)
    schema = get_schema(fmt)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        if not size:
            return fmt, schema, b"", size
        key = (st.st_dev, st.st_ino, size, st.st_mtime_ns)
        buf = _MAPPINGS.get(key)
        if buf is None:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            _MAPPINGS[key] = buf
    return fmt, schema, buf, size


def read_model(path: str | os.PathLike) -> ir.Model:
    """Read a Circle or TFLite file into an ir.Model (constants as read-only mmap views)."""
    fmt, schema, buf, size = _mapped(path)
    try:
        m = decode_model(schema, buf, size, str(path))
        return _to_ir(m, schema, buf, size, str(path))
    except ModelLoadError:
        raise
    except (Exception, RecursionError) as err:  # noqa: BLE001 - any decoding failure means a broken file
        raise ModelLoadError(f"{path}: the {fmt} flatbuffer cannot be decoded ({type(err).__name__}: "
                             f"{_short(err)}); the file is truncated or corrupt") from None


def tensor_types(path: str | os.PathLike) -> set[str]:
    """The TensorType names of every tensor in the file, read through the zero-copy
    accessors (milliseconds on a 500 MB model, where read_model decodes every table)."""
    fmt, schema, buf, size = _mapped(path)
    names = schema.tensor_type_names
    try:
        m = schema.reader_cls("Model").GetRootAs(buf, 0)
        types: set[int] = set()
        for i in range(m.SubgraphsLength()):
            sg = m.Subgraphs(i)
            types.update(sg.Tensors(j).Type() for j in range(sg.TensorsLength()))
    except (Exception, RecursionError) as err:  # noqa: BLE001 - a broken file
        raise ModelLoadError(f"{path}: the {fmt} flatbuffer cannot be decoded ({type(err).__name__}: "
                             f"{_short(err)}); the file is truncated or corrupt") from None
    return {names.get(t, f"UNKNOWN_{t}") for t in types}


def io_names(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Subgraph 0's input and output tensor names, through the zero-copy accessors (a
    runtime that knows no names asks; read_model would decode every table for them)."""
    fmt, schema, buf, size = _mapped(path)
    try:
        sg = schema.reader_cls("Model").GetRootAs(buf, 0).Subgraphs(0)

        def name(i: int) -> str:
            raw = sg.Tensors(i).Name()
            return raw.decode("utf-8", "replace") if raw is not None else ""

        return ([name(sg.Inputs(j)) for j in range(sg.InputsLength())],
                [name(sg.Outputs(j)) for j in range(sg.OutputsLength())])
    except (Exception, RecursionError) as err:  # noqa: BLE001 - a broken file
        raise ModelLoadError(f"{path}: the {fmt} flatbuffer cannot be decoded ({type(err).__name__}: "
                             f"{_short(err)}); the file is truncated or corrupt") from None


def _short(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _buffer_data(m: Any, buf: Any, size: int, path: str) -> list[np.ndarray | None]:
    datas: list[np.ndarray | None] = []
    for i, b in enumerate(m.buffers or []):
        if b is None:
            datas.append(None)
        elif b.data is not None and len(b.data):
            datas.append(np.asarray(b.data, dtype=np.uint8))
        elif b.offset > 1 and b.size > 0:
            if b.offset + b.size > size:
                raise ModelLoadError(
                    f"{path}: buffer {i} points to bytes {b.offset}..{b.offset + b.size} past the end "
                    f"of the file ({size} bytes); the file is truncated")
            datas.append(np.frombuffer(buf, dtype=np.uint8, count=b.size, offset=b.offset))
        else:
            datas.append(None)
    return datas


def _quant(qp: Any) -> ir.QuantParams | None:
    """A QuantizationParameters table -> ir.QuantParams; None when it carries no scale
    (converters write empty tables, or min/max only, on float tensors)."""
    if qp is None or qp.scale is None or not len(qp.scale):
        return None
    scale = np.array(qp.scale, dtype=np.float32).reshape(-1)
    zp = (np.array(qp.zeroPoint, dtype=np.int64).reshape(-1) if qp.zeroPoint is not None
          and len(qp.zeroPoint) else np.zeros(len(scale), dtype=np.int64))
    return ir.QuantParams(scale, zp, int(qp.quantizedDimension))


def _blockwise(qp: Any, tensors: list[ir.Tensor], ti: int, si: int, path: str) -> None:
    """A BlockwiseQuantization detail (per-group scales in another tensor of the subgraph):
    tensor ``ti`` gets QuantParams whose ``blockwise`` holds that scales tensor, and whose
    scale is the scales tensor's per-row scale (circleops writes the group scales as UINT8
    multipliers of it; ir.Blockwise)."""
    if qp is None or qp.details is None or type(qp.details).__name__ != "BlockwiseQuantizationT":
        return
    d = qp.details
    where = f"tensor {ti} of subgraph {si}"
    k = _index(d.scales, len(tensors), f"the blockwise scales index of {where}", path)
    w, scales = tensors[ti], tensors[k]
    if len(w.shape) != 2 or int(d.blockSize) < 1 or w.shape[1] % int(d.blockSize) \
            or tuple(scales.shape) != (w.shape[0], w.shape[1] // int(d.blockSize)):
        raise ModelLoadError(f"{path}: {where} has blockwise scales of shape {list(scales.shape)}, block size "
                             f"{int(d.blockSize)}, for a weight of shape {list(w.shape)}; the file is corrupt")
    row = scales.quant.scale if scales.quant is not None else np.ones(w.shape[0], np.float32)
    w.quant = ir.QuantParams(np.asarray(row, np.float32), np.zeros(len(row), np.int64), int(qp.quantizedDimension),
                             ir.Blockwise(int(d.blockSize), scales))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:  # Python ints: no int64 overflow on absurd dims
        n *= d
    return n


def _index(value: Any, count: int, what: str, path: str, *, optional: bool = False) -> int:
    """An index read from the file, checked: negative indices must not wrap around."""
    i = int(value)
    if optional and i == -1:
        return i
    if not 0 <= i < count:
        raise ModelLoadError(f"{path}: {what} is {i}, out of range (0..{count - 1}); the file is corrupt")
    return i


def _tensor(t: Any, si: int, ti: int, schema: Schema, const: Any, *, nbuffers: int, path: str) -> ir.Tensor:
    dtype = schema.tensor_type_names.get(int(t.type), f"TYPE_{t.type}")
    name = _str(t.name) or ""
    where = f"tensor {ti} {name!r} of subgraph {si}"
    static = tuple(int(d) for d in (t.shape if t.shape is not None else []))
    shape = tuple(int(d) for d in t.shapeSignature) if t.shapeSignature is not None else static
    if any(d < -1 for d in shape) or any(d < -1 for d in static):
        raise ModelLoadError(f"{path}: {where} has shape {list(static)} (signature {list(shape)}): dimensions "
                             "below -1 are invalid; the file is corrupt")
    buffer = int(t.buffer)
    if buffer < 0 or (buffer >= nbuffers and buffer != 0):
        raise ModelLoadError(f"{path}: {where} names buffer {buffer}, but the file has {nbuffers} buffers; "
                             "the file is corrupt")
    data = const(t, dtype, static)
    if data is not None:
        if any(d < 0 for d in static):
            raise ModelLoadError(f"{path}: {where} is a constant with unknown dimensions {list(static)}; "
                                 "the file is corrupt")
        want = None
        if dtype in ir.GGML_BLOCKS:
            per_block, block_bytes = ir.GGML_BLOCKS[dtype]
            want = -(-_numel(static) // per_block) * block_bytes
        elif dtype in ir.PACKED_4BIT:
            want = (_numel(static) + 1) // 2
        elif dtype in NUMPY_DTYPE:
            want = _numel(static) * NUMPY_DTYPE[dtype].itemsize
        if want is not None and data.nbytes != want:
            raise ModelLoadError(
                f"{path}: {where} is {dtype} {list(static)} ({want} bytes) but its buffer {buffer} holds "
                f"{data.nbytes} bytes; the file is corrupt")
        if dtype in ir.PACKED_4BIT:  # the IR holds one value per element
            data = unpack_4bit(data, dtype, static)
    return ir.Tensor(name, shape, dtype, data, _quant(t.quantization))


def _to_ir(m: Any, schema: Schema, buf: Any, size: int, path: str) -> ir.Model:
    datas = _buffer_data(m, buf, size, path)
    union_names = {attr: schema.union_names(u) for attr, u in
                   (("builtinOptions", "BuiltinOptions"), ("builtinOptions2", "BuiltinOptions2"))}
    # One array object per buffer, so shared buffers stay shared when written again.
    typed: dict[tuple[int, str, tuple], np.ndarray] = {}

    def const(tensor: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        data = datas[tensor.buffer] if 0 <= tensor.buffer < len(datas) else None
        if data is None:
            return None
        key = (tensor.buffer, dtype, shape)
        if key not in typed:
            np_dtype = NUMPY_DTYPE.get(dtype)
            if np_dtype is None or data.nbytes % np_dtype.itemsize:
                typed[key] = data  # unknown element type (or a size checked by the caller): raw bytes
            else:
                arr = data.view(np_dtype)
                typed[key] = arr.reshape(shape) if arr.size == _numel(shape) else arr
        return typed[key]

    opcodes = []
    for k, oc in enumerate(m.operatorCodes or []):
        if oc is None:
            raise ModelLoadError(f"{path}: operator code {k} is missing (null); the file is corrupt")
        opcodes.append((opcode_name(schema, oc), _str(oc.customCode), int(oc.version)))

    subgraphs = []
    for si, sg in enumerate(m.subgraphs or []):
        out = ir.Subgraph(_str(sg.name) or f"subgraph_{si}")
        for ti, t in enumerate(sg.tensors or []):
            out.tensors.append(_tensor(t, si, ti, schema, const, nbuffers=len(datas), path=path))
        n = len(out.tensors)
        for ti, t in enumerate(sg.tensors or []):
            _blockwise(t.quantization, out.tensors, ti, si, path)
        for k, op in enumerate(sg.operators or []):
            where = f"operator {k} of subgraph {si}"
            name, custom_code, version = opcodes[_index(op.opcodeIndex, len(opcodes), f"the opcode index of {where}",
                                                        path)]
            options_type, options = None, {}
            for attr in ("builtinOptions", "builtinOptions2"):
                tag = getattr(op, attr + "Type", 0)
                if tag and getattr(op, attr) is not None:
                    options_type = union_names[attr].get(int(tag))
                    options = _options(getattr(op, attr), options_type)
            if name == "CUSTOM":
                options = {"customCode": custom_code,
                           "customOptions": bytes(np.asarray(op.customOptions, dtype=np.uint8))
                           if op.customOptions is not None else b""}
            inputs = [_index(i, n, f"input {p} of {where} ({name})", path, optional=True)
                      for p, i in enumerate(op.inputs if op.inputs is not None else [])]
            outputs = [_index(i, n, f"output {p} of {where} ({name})", path)
                       for p, i in enumerate(op.outputs if op.outputs is not None else [])]
            out.operators.append(ir.Operator(name, inputs, outputs, options_type, options, version))
        out.inputs = [_index(i, n, f"input {p} of subgraph {si}", path)
                      for p, i in enumerate(sg.inputs if sg.inputs is not None else [])]
        out.outputs = [_index(i, n, f"output {p} of subgraph {si}", path)
                       for p, i in enumerate(sg.outputs if sg.outputs is not None else [])]
        subgraphs.append(out)

    signatures = []
    for k, sd in enumerate(m.signatureDefs or []):
        si = _index(sd.subgraphIndex, len(subgraphs), f"the subgraph index of signature {k}", path)
        n = len(subgraphs[si].tensors)
        maps = []
        for kind, tms in (("input", sd.inputs), ("output", sd.outputs)):
            maps.append({(_str(tm.name) or f"{kind}_{p}"): _index(tm.tensorIndex, n, f"{kind} {p} of signature {k}", path)
                         for p, tm in enumerate(tms or [])})
        signatures.append(ir.Signature(_str(sd.signatureKey) or "", si, *maps))

    metadata = {}
    for k, md in enumerate(m.metadata or []):
        b = _index(md.buffer, len(datas), f"the buffer of metadata entry {k} {_str(md.name)!r}", path)
        data = datas[b]
        metadata[_str(md.name) or f"metadata_{k}"] = bytes(data) if data is not None else b""

    return ir.Model(subgraphs=subgraphs, signatures=signatures,
                    description=_str(m.description) or "", metadata=metadata)


def read_signatures(path: str | os.PathLike) -> list[ir.Signature]:
    """Only the signatures, in file order, without decoding the rest (fast on big files)."""
    fmt, schema, buf, size = _mapped(path)
    try:
        budget = Budget(size, str(path))
        root = schema.reader_cls("Model").GetRootAs(buf, 0)
        out = []
        for i in range(budget.count(root.SignatureDefsLength(), "signature")):
            sd = root.SignatureDefs(i)
            maps = []
            for length, get in ((sd.InputsLength, sd.Inputs), (sd.OutputsLength, sd.Outputs)):
                maps.append({_str(get(j).Name()): int(get(j).TensorIndex())
                             for j in range(budget.count(length(), f"signature {i} tensors"))})
            out.append(ir.Signature(_str(sd.SignatureKey()) or "", int(sd.SubgraphIndex()), *maps))
        return out
    except ModelLoadError:
        raise
    except (Exception, RecursionError) as err:  # noqa: BLE001 - a broken file
        raise ModelLoadError(f"{path}: the {fmt} flatbuffer's signatures cannot be decoded ({type(err).__name__}: "
                             f"{_short(err)}); the file is truncated or corrupt") from None
