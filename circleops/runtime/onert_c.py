"""onert's C API through ctypes: a file's signatures run from one prepared session.

onert 0.1.0 runs subgraph 0 of a file only, so target onert writes one file per generation
graph, each holding every weight (a 1B q4_0 model: 3 x 0.97 GB on disk and in memory).
onert 0.2.0.dev250922's ``libonert.so`` (in the wheel, ``onert/native``) exports
``nnfw_set_signature_run`` (nnfw.h): one session loads and prepares a multi-signature file
once, and every run first selects its signature; the subgraphs share the file's weight
buffers, which onert loads once per buffer (FACTS.md). Its Python ``infer()`` cannot do this
(it returned zeros on such a file), hence ctypes against the wheel's own library.

    if available():
        prefill = SignatureSession("model.circle", "prefill")
        decode = SignatureSession("model.circle", "decode")   # the same native session
        logits, *rows = decode.run([ids, pos, *caches])

The sessions of one file share one native session (:func:`_shared`), so the file is loaded
once; a run sets the inputs and outputs of its signature each time. onert loads it with its
constants left in the mapped file (:func:`weights_mapped`), not copied to the heap. Runs of one
native session are serialized by a lock. The thread count (``NUM_THREADS``) is read when the
first session of a file prepares it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from circleops.errors import RuntimeRunError
from circleops.runtime import TensorSpec

SIGNATURE_SYMBOL = "nnfw_set_signature_run"
MAPPED_ENV = "USE_MMAPED_DATA"  # onert's config key (read from the environment by its loader)
MAX_RANK = 6  # NNFW_MAX_RANK
# NNFW_TYPE (nnfw.h) -> numpy dtype
_NNFW_TYPES = {0: np.float32, 1: np.int32, 2: np.uint8, 3: np.bool_, 4: np.uint8, 5: np.int64, 6: np.int8,
               7: np.int16}
_TYPE_CODES = {np.dtype(v): k for k, v in _NNFW_TYPES.items() if k not in (2, 6, 7)}


class _TensorInfo(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("rank", ctypes.c_int32), ("dims", ctypes.c_int32 * MAX_RANK)]


_LIB: Any = None
_LOCK = threading.Lock()


def library_path() -> Path | None:
    """The installed onert wheel's ``native/libonert.so`` (None: no onert installed)."""
    import importlib.util

    spec = importlib.util.find_spec("onert")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "native" / "libonert.so"
    return path if path.is_file() else None


def _library() -> Any:
    """The loaded libonert.so with the prototypes set; RuntimeRunError when it is missing."""
    global _LIB
    with _LOCK:
        if _LIB is None:
            path = library_path()
            if path is None:
                raise RuntimeRunError("onert is not installed (no onert/native/libonert.so): pip install onert.")
            lib = ctypes.CDLL(str(path))
            p, u32, cp = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p
            protos = {
                "nnfw_create_session": [ctypes.POINTER(p)], "nnfw_close_session": [p],
                "nnfw_load_model_from_file": [p, cp], "nnfw_set_available_backends": [p, cp],
                "nnfw_prepare": [p], "nnfw_run": [p], "nnfw_input_size": [p, ctypes.POINTER(u32)],
                "nnfw_output_size": [p, ctypes.POINTER(u32)],
                "nnfw_input_tensorinfo": [p, u32, ctypes.POINTER(_TensorInfo)],
                "nnfw_output_tensorinfo": [p, u32, ctypes.POINTER(_TensorInfo)],
                "nnfw_set_input": [p, u32, ctypes.c_int, p, ctypes.c_size_t],
                "nnfw_set_output": [p, u32, ctypes.c_int, p, ctypes.c_size_t],
            }
            if hasattr(lib, SIGNATURE_SYMBOL):
                protos[SIGNATURE_SYMBOL] = [p, cp]
            for name, args in protos.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _LIB = lib
        return _LIB


def available() -> bool:
    """Whether the installed onert selects signatures through its C API (0.2.0.dev and later;
    0.1.0's libonert.so has no ``nnfw_set_signature_run``)."""
    try:
        return hasattr(_library(), SIGNATURE_SYMBOL)
    except (RuntimeRunError, OSError):
        return False


def _call(what: str, path: str, fn: Any, *args: Any) -> None:
    """Call an nnfw function; RuntimeRunError with onert's own stderr words on a failure."""
    from circleops.runtime.stderr import captured_stderr

    with captured_stderr() as text:
        status = fn(*args)
    if status != 0:
        words = text[0] if text and text[0] else f"NNFW_STATUS {status}"
        raise RuntimeRunError(f"onert could not {what} {path}: {words}.")


@contextlib.contextmanager
def weights_mapped() -> Iterator[None]:
    """While onert loads (and prepares) a file: its loader keeps each constant as a view of
    the mapped file (onert's ``USE_MMAPED_DATA``; 0.1.0 and 0.2.0.dev both read it) instead of
    copying it to the heap. The weights are then clean file pages, shared with the page cache
    and with every other process that maps the same file (a verify's child, a second
    generate), and the kernel can drop them under memory pressure instead of killing a
    process; heap memory holds only activations and caches (the 1B shape's fp32 split:
    4.96 GB of heap for 4.94 GB of weights before, bench/results/48). The file must not change
    while the session lives: circleops writes by rename, so a new convert gets a new inode.
    A ``USE_MMAPED_DATA`` set by the user wins (0: the copy, as before)."""
    if MAPPED_ENV in os.environ:
        yield
        return
    os.environ[MAPPED_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(MAPPED_ENV, None)


class _Native:
    """One nnfw session on one file: created, loaded and prepared once."""

    def __init__(self, path: str, load_path: str, backends: str):
        self.lib = _library()
        self.path = path
        self.handle = ctypes.c_void_p()
        self.lock = threading.Lock()
        self.users = 0
        self.selected: str | None = None  # the signature the session runs now
        _call("create a session for", path, self.lib.nnfw_create_session, ctypes.byref(self.handle))
        try:
            with weights_mapped():
                _call("load", path, self.lib.nnfw_load_model_from_file, self.handle, load_path.encode())
                _call("set the backends of", path, self.lib.nnfw_set_available_backends, self.handle,
                      backends.encode())
                _call("prepare", path, self.lib.nnfw_prepare, self.handle)
        except RuntimeRunError:
            self.close()
            raise

    def select(self, signature: str) -> None:
        if signature == self.selected:
            return  # a decode loop runs one signature: no switch per step
        self.selected = None
        _call(f"select signature {signature!r} of", self.path, getattr(self.lib, SIGNATURE_SYMBOL), self.handle,
              signature.encode())
        self.selected = signature

    def specs(self, output: bool) -> list[TensorSpec]:
        count = ctypes.c_uint32()
        size_fn = self.lib.nnfw_output_size if output else self.lib.nnfw_input_size
        info_fn = self.lib.nnfw_output_tensorinfo if output else self.lib.nnfw_input_tensorinfo
        _call("read the inputs and outputs of", self.path, size_fn, self.handle, ctypes.byref(count))
        specs = []
        for i in range(count.value):
            info = _TensorInfo()
            _call("read the inputs and outputs of", self.path, info_fn, self.handle, i, ctypes.byref(info))
            dtype = _NNFW_TYPES.get(info.dtype)
            if dtype is None:
                raise RuntimeRunError(f"onert reports tensor type {info.dtype} in {self.path}, which circleops does "
                                      f"not know.")
            specs.append(TensorSpec("", tuple(int(d) for d in info.dims[:info.rank]), np.dtype(dtype).name))
        return specs

    def close(self) -> None:
        if self.handle:
            self.lib.nnfw_close_session(self.handle)
            self.handle = ctypes.c_void_p()


_SHARED: dict[str, _Native] = {}


def _shared(path: str, load_path: str, backends: str) -> _Native:
    """The native session of ``path`` (one per file and process: its weights once in memory)."""
    key = os.path.realpath(path)
    with _LOCK:
        native = _SHARED.get(key)
    if native is None:
        native = _Native(path, load_path, backends)
        with _LOCK:
            native = _SHARED.setdefault(key, native)
    native.users += 1
    return native


class SignatureSession:
    """One signature of a Circle file on onert's C API; the file's other signatures (other
    SignatureSessions on the same path) share its native session and weights. The session
    protocol of circleops.runtime: ``inputs``, ``outputs``, ``run(arrays) -> arrays``."""

    def __init__(self, path: str | os.PathLike, signature: str, *, load_path: str | None = None,
                 backends: str = "cpu"):
        self.path = str(path)
        self.signature = signature
        if not available():
            raise RuntimeRunError(f"onert cannot select signature {signature!r} of {self.path}: the installed onert has "
                                  f"no {SIGNATURE_SYMBOL} (onert 0.1.0). Install onert 0.2.0.dev250922 or later "
                                  f"(pip install circleops[onert-signatures]), or run with --runtime reference.")
        self._native = _shared(self.path, load_path or self.path, backends)
        self._closed = False
        with self._native.lock:
            self._native.select(signature)
            self._inputs = self._native.specs(False)
            self._outputs = self._native.specs(True)
        self._names = _signature_names(self.path, signature)
        self._bound: Sequence[np.ndarray] = ()

    @property
    def inputs(self) -> list[TensorSpec]:
        names = self._names[0]
        return [TensorSpec(names[i] if i < len(names) else "", s.shape, s.dtype) for i, s in enumerate(self._inputs)]

    @property
    def outputs(self) -> list[TensorSpec]:
        names = self._names[1]
        return [TensorSpec(names[i] if i < len(names) else "", s.shape, s.dtype) for i, s in enumerate(self._outputs)]

    def run(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        """Run this signature on ``inputs`` (in its input order); fresh output arrays."""
        from circleops.runtime.inputs import check_inputs

        arrays = [np.asarray(a) for a in inputs]
        check_inputs(self.inputs, arrays, self.path)
        arrays = [np.ascontiguousarray(a.reshape(s.shape)) for s, a in zip(self._inputs, arrays)]
        outputs = [np.empty(s.shape, dtype=s.dtype) for s in self._outputs]
        native, lib = self._native, self._native.lib
        with native.lock:
            native.select(self.signature)
            for i, a in enumerate(arrays):
                _call("set an input of", self.path, lib.nnfw_set_input, native.handle, i,
                      _TYPE_CODES[a.dtype], a.ctypes.data, a.nbytes)
            for i, o in enumerate(outputs):
                _call("set an output of", self.path, lib.nnfw_set_output, native.handle, i,
                      _TYPE_CODES[o.dtype], o.ctypes.data, o.nbytes)
            self._bound = arrays  # onert keeps only the pointers until the run
            _call(f"run signature {self.signature!r} of", self.path, lib.nnfw_run, native.handle)
        return outputs


def _signature_names(path: str, signature: str) -> tuple[list[str], list[str]]:
    """The input and output names of ``signature`` in the file, in its subgraph's order."""
    try:
        from circleops.serialize import read_model

        model = read_model(path)
        sig = next(s for s in model.signatures if s.key == signature)
        sub = model.subgraphs[sig.subgraph_index]
        return [sub.tensors[i].name for i in sub.inputs], [sub.tensors[i].name for i in sub.outputs]
    except Exception:  # noqa: BLE001 - names are cosmetic (check_inputs reports by index then)
        return [], []
