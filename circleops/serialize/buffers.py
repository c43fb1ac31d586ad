"""Constant tensor data -> bytes on disk, without copying the weights.

A constant's data (np.ndarray or torch.Tensor) is turned into a flat uint8 *view* of the
same memory (bf16 as its raw 16-bit pattern), so the writer can stream it straight from
the model's parameters to the file. Constants whose bytes are equal are stored once
(tied embeddings, repeated tables): same object, same torch storage + offset + layout, or
byte-identical (found by a cheap fingerprint first and confirmed by a full hash only when
fingerprints collide).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from circleops import ir

# TensorType name -> element size in bytes (the types circleops writes).
ELEMENT_SIZE: dict[str, int] = {
    "FLOAT32": 4, "FLOAT16": 2, "BFLOAT16": 2, "FLOAT64": 8, "INT64": 8, "INT32": 4,
    "INT16": 2, "INT8": 1, "UINT8": 1, "BOOL": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8,
}

# TensorType name -> numpy dtype used when reading (bf16 has no numpy dtype: raw bits).
NUMPY_DTYPE: dict[str, np.dtype] = {
    "FLOAT32": np.dtype("<f4"), "FLOAT16": np.dtype("<f2"), "BFLOAT16": np.dtype("<u2"),
    "FLOAT64": np.dtype("<f8"), "INT64": np.dtype("<i8"), "INT32": np.dtype("<i4"),
    "INT16": np.dtype("<i2"), "INT8": np.dtype("i1"), "UINT8": np.dtype("u1"),
    "BOOL": np.dtype("?"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
}

_FINGERPRINT_SAMPLE = 4096


def data_nbytes(dtype: str, shape: tuple[int, ...], itemsize: int | None = None) -> int:
    """Bytes of a constant of ``shape`` stored as ``dtype``: GGML block types count whole
    blocks (``ir.GGML_BLOCKS``), the rest elements (``itemsize`` for a type not listed)."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype in ir.GGML_BLOCKS:
        per_block, block_bytes = ir.GGML_BLOCKS[dtype]
        return -(-n // per_block) * block_bytes
    if dtype in ir.PACKED_4BIT:
        return (n + 1) // 2
    return n * ELEMENT_SIZE.get(dtype, itemsize or 1)


def check_ggml_shape(dtype: str, shape: tuple[int, ...], name: str) -> None:
    """GGML blocks run along the last dimension: it must be a whole number of blocks."""
    per_block = ir.GGML_BLOCKS[dtype][0]
    if not shape or shape[-1] % per_block:
        raise ValueError(
            f"tensor {name!r}: {dtype} stores blocks of {per_block} along the last dimension, "
            f"but its shape is {list(shape)}; keep this tensor FLOAT32 or pad it")


def pack_4bit(values: Any, dtype: str = "INT4") -> np.ndarray:
    """Two 4-bit values per byte, as Samsung ONE's luci exporter writes INT4 (S4) / UINT4 (U4)
    constants: element 2i in the low nibble, 2i+1 in the high nibble, over the flattened
    tensor (row-major); an odd count leaves the last high nibble 0."""
    v = np.asarray(values.detach().numpy() if isinstance(values, torch.Tensor) else values).reshape(-1)
    lo, hi = ir.PACKED_4BIT[dtype]
    if v.size and (int(v.min()) < lo or int(v.max()) > hi):
        raise ValueError(f"{dtype} values must lie in [{lo}, {hi}], got [{int(v.min())}, {int(v.max())}]")
    nib = (v.astype(np.int16) & 0x0F).astype(np.uint8)
    if nib.size % 2:
        nib = np.concatenate([nib, np.zeros(1, np.uint8)])
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def unpack_4bit(packed: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of :func:`pack_4bit`: int8 (INT4, sign-extended) or uint8 (UINT4) values of ``shape``."""
    b = np.asarray(packed, np.uint8).reshape(-1)
    nib = np.empty(b.size * 2, np.uint8)
    nib[0::2], nib[1::2] = b & 0x0F, b >> 4
    n = int(np.prod(shape, dtype=np.int64))
    nib = nib[:n]
    if dtype == "INT4":
        return (nib.astype(np.int8) << 4 >> 4).astype(np.int8).reshape(shape)  # sign-extend the nibble
    return nib.reshape(shape)


def as_bytes_view(data: Any, dtype: str, shape: tuple[int, ...], name: str = "?") -> np.ndarray:
    """A contiguous 1-D uint8 view of a constant's bytes (copies only non-contiguous data).

    Checks that the byte count matches ``shape`` and ``dtype`` so that a lowering bug
    cannot write a file whose tensors disagree with their buffers.
    """
    if dtype in ir.PACKED_4BIT:  # the IR holds one value per element: packed here (a copy, half the size)
        flat = pack_4bit(data, dtype)
        if flat.nbytes != data_nbytes(dtype, shape):
            raise ValueError(f"constant tensor {name!r}: {np.asarray(data).size} values for shape {list(shape)} "
                             f"of {dtype}; the lowering produced inconsistent data")
        return flat
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        arr = t.numpy()
    else:
        arr = np.asarray(data)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    flat = arr.reshape(-1).view(np.uint8)
    if dtype in ir.GGML_BLOCKS:
        check_ggml_shape(dtype, shape, name)
    expected = data_nbytes(dtype, shape, arr.dtype.itemsize)
    if flat.nbytes != expected:
        raise ValueError(
            f"constant tensor {name!r}: data has {flat.nbytes} bytes but shape {list(shape)} "
            f"of {dtype} needs {expected}; the lowering produced inconsistent data")
    return flat


def _is_contiguous(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return data.is_contiguous() and data.device.type == "cpu"
    return not isinstance(data, np.ndarray) or data.flags.c_contiguous


class LazyBytes:
    """A constant whose bytes need a copy (non-contiguous, off-CPU): made only while used.

    Holding the contiguous copy of every transposed weight until the file is written would
    double the memory for those weights; this makes the copy per tensor, when streamed.
    """

    __slots__ = ("data", "dtype", "shape", "name", "nbytes")

    def __init__(self, data: Any, dtype: str, shape: tuple[int, ...], name: str, nbytes: int):
        self.data, self.dtype, self.shape, self.name, self.nbytes = data, dtype, shape, name, nbytes

    def view(self) -> np.ndarray:
        return as_bytes_view(self.data, self.dtype, self.shape, self.name)


def materialize(entry: "np.ndarray | LazyBytes") -> np.ndarray:
    """The uint8 bytes of a buffer entry (a copy for a LazyBytes; drop it after use)."""
    return entry.view() if isinstance(entry, LazyBytes) else entry


def identity_key(data: Any) -> tuple | None:
    """A key equal for two constants that are views of the same memory with the same layout."""
    if isinstance(data, torch.Tensor):
        try:
            storage = data.untyped_storage()
        except Exception:  # noqa: BLE001 - e.g. tensor subclasses without storage
            return None
        return ("torch", storage.data_ptr(), data.storage_offset(), tuple(data.shape),
                tuple(data.stride()), str(data.dtype))
    if isinstance(data, np.ndarray):
        iface = data.__array_interface__
        return ("numpy", iface["data"][0], data.shape, data.strides, data.dtype.str)
    return None


def _fingerprint(view: np.ndarray) -> bytes:
    """Cheap hash of size + head + tail + a strided sample: differs for almost all weights."""
    n = view.nbytes
    h = hashlib.blake2b(digest_size=16)
    h.update(n.to_bytes(8, "little"))
    h.update(view[:_FINGERPRINT_SAMPLE])
    h.update(view[-_FINGERPRINT_SAMPLE:])
    if n > 4 * _FINGERPRINT_SAMPLE:
        step = max(1, n // _FINGERPRINT_SAMPLE)
        h.update(np.ascontiguousarray(view[::step]))
    return h.digest()


def _full_hash(view: np.ndarray) -> bytes:
    return hashlib.blake2b(view, digest_size=32).digest()


@dataclass
class BufferTable:
    """The model's buffers in order; index 0 is the empty sentinel every runtime expects.

    ``datas[i]`` is the uint8 view for buffer i, or a LazyBytes (None for buffer 0); read
    it through :func:`materialize`.
    """

    datas: list[np.ndarray | LazyBytes | None] = field(default_factory=lambda: [None])
    shared: int = 0  # constants that reused an existing buffer
    _by_identity: dict[tuple, int] = field(default_factory=dict)
    _by_fingerprint: dict[bytes, list[int]] = field(default_factory=dict)
    _full: dict[int, bytes] = field(default_factory=dict)

    def add_raw(self, view: np.ndarray | LazyBytes) -> int:
        """Append a buffer unconditionally (e.g. metadata)."""
        self.datas.append(view)
        return len(self.datas) - 1

    def add(self, data: Any, dtype: str, shape: tuple[int, ...], name: str) -> int:
        """The buffer index holding ``data``: an existing one when the bytes are the same."""
        ident = identity_key(data)
        if ident is not None and ident in self._by_identity:
            self.shared += 1
            return self._by_identity[ident]
        view = as_bytes_view(data, dtype, shape, name)
        fp = _fingerprint(view)
        candidates = self._by_fingerprint.setdefault(fp, [])
        if candidates:
            digest = _full_hash(view)
            for idx in candidates:
                if idx not in self._full:
                    self._full[idx] = _full_hash(materialize(self.datas[idx]))
                if self._full[idx] == digest:
                    self.shared += 1
                    if ident is not None:
                        self._by_identity[ident] = idx
                    return idx
        if not _is_contiguous(data):
            view = LazyBytes(data, dtype, shape, name, view.nbytes)  # the copy is dropped here
        idx = self.add_raw(view)
        candidates.append(idx)
        if ident is not None:
            self._by_identity[ident] = idx
        return idx

    @property
    def data_bytes(self) -> int:
        return sum(d.nbytes for d in self.datas if d is not None)
