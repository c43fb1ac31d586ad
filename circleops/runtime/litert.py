"""Run a .tflite file with LiteRT (ai_edge_litert.interpreter.Interpreter; NUM_THREADS threads,
2 when it is not set, as onert reads it).

    session = Session("model.tflite", signature="decode")  # loaded once
    outputs = session.run([ids, pos, *caches])             # as often as needed
    outputs = run("model.tflite", [ids])                   # one run
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from circleops.errors import RuntimeRunError
from circleops.inputs.user_files import positive_whole_number
from circleops.runtime import TensorSpec
from circleops.runtime.inputs import check_inputs, check_one, in_order
from circleops.runtime.isolated import WEIGHT_CACHE_ENV, note_in_process
from circleops.serialize.integrity import check_file

NUM_THREADS = 2  # when the NUM_THREADS environment variable is not set


def num_threads() -> int:
    """LiteRT's thread count: the NUM_THREADS environment variable, as onert reads it (and as
    ``circleops generate`` sets it from a manifest's num_threads), else :data:`NUM_THREADS`."""
    text = os.environ.get("NUM_THREADS", "").strip()
    value = positive_whole_number(text, NUM_THREADS)
    if value is None:
        raise RuntimeRunError(f"NUM_THREADS={text!r}: give LiteRT's thread count as a whole number of 1 or more "
                              f"(or unset it for {NUM_THREADS}).")
    return value

DELEGATE_BANNER = "Created TensorFlow Lite XNNPACK delegate"


# What LiteRT's CompiledModel logs on fd 2 while it sets up its environment (the accelerators
# and vendor compiler plugins it looks for and does not find on a CPU): hidden like the banner
_SETUP_LOG = ("INFO: [", "WARNING: [npu_registry", "WARNING: [compiler_plugin", "\u2514", "Could not load shared library")


@contextlib.contextmanager
def delegate_banner_hidden(noise: tuple[str, ...] = ()):
    """Hide the line LiteRT's C++ prints on fd 2 when it applies its XNNPACK delegate
    ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU."): it landed in the middle of
    the text `circleops generate` streams. Anything else written to fd 2 meanwhile is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (embedded interpreters): nothing to hide
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = "".join(line for line in tmp.read().decode(errors="replace").splitlines(True)
                           if DELEGATE_BANNER not in line and not line.lstrip().startswith(noise or ("\0",)))
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


# (file identity, threads) -> the Interpreter / CompiledModel its signature sessions share:
# one Interpreter per signature held the file's XNNPACK-packed weights once each (SmolLM2
# w8's five generation graphs: 4.2 GB resident and 5.6 s of CPU to load; one shared: 0.9 GB
# and 1.1 s)
_SHARED: "weakref.WeakValueDictionary[tuple, Any]" = weakref.WeakValueDictionary()

# Even one shared Interpreter packs the weights once per subgraph (its XNNPACK delegate has no
# weight cache and the Python Interpreter cannot give it one): a 1 GB fp32 file of five
# generation graphs took 6.0 GB resident (issue 32). LiteRT's CompiledModel takes an XNNPACK
# weight cache file (CpuOptions.xnnpack_weight_cache_path): every subgraph's packed weights
# are stored once there, memory-mapped, and a later load maps them without packing again
# (the same file: 0.37 GB resident running its decode graph, outputs bit-identical to the
# Interpreter's). Signature sessions use it; WEIGHT_CACHE_ENV names the cache's directory
# (default cache_dir()/xnnpack; a one-shot child gets a scratch one, circleops.runtime.isolated).


def weight_cache_dir() -> Path:
    """Where XNNPACK weight caches go: $CIRCLEOPS_XNNPACK_CACHE, else circleops' cache/xnnpack."""
    from circleops.system.cache_dir import cache_dir

    env = os.environ.get(WEIGHT_CACHE_ENV)
    return Path(env) if env else cache_dir() / "xnnpack"


def weight_cache_path(path: str, st: os.stat_result) -> Path:
    """The weight cache file of the model file ``path`` as it is now (``st``): named by its
    path and its identity, so a rewritten file never meets the packing of its predecessor;
    the caches of earlier versions of the same path are removed."""
    import hashlib

    where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:16]
    ident = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = weight_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(f"{where}.*.xnnpack"):
        if old.name != f"{where}.{ident}.xnnpack":
            with contextlib.suppress(OSError):
                old.unlink()
    return root / f"{where}.{ident}.xnnpack"


def _silent_teardown() -> None:
    """fd 2 to /dev/null once the program is done (atexit, registered before any later
    handler, so it runs after them): LiteRT logs its environment's teardown as INFO lines
    when the last CompiledModel goes, and the Python API cannot set its log level."""
    try:
        sys.stderr.flush()
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
    except (OSError, ValueError):
        pass


# The process's one LiteRT Environment (:func:`_environment`)
_ENVIRONMENT: Any = None


def _environment() -> Any:
    """One LiteRT Environment for every CompiledModel of the process, kept until the
    interpreter's teardown. CompiledModel.from_file made one per model, and an Environment
    logs its accelerators' teardown on fd 2 (three "INFO: ... DestroyAccelerator" lines)
    when the last object holding it goes: the input arrays of the in-place KV caches held
    their TensorBuffers (and so it) past the sessions, so the lines came after every
    `circleops generate` on LiteRT, wherever the generator happened to be dropped. Held here,
    it goes after :func:`_silent_teardown` has sent fd 2 to /dev/null. None where this
    ai-edge-litert has no Environment to share (each model then makes its own)."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        try:
            from ai_edge_litert import compiled_model as cm

            with delegate_banner_hidden(_SETUP_LOG):
                _ENVIRONMENT = cm.Environment.create(
                    options=cm.EnvironmentOptions(runtime_path=os.path.dirname(os.path.abspath(cm.__file__))))
        except (ImportError, AttributeError, TypeError, RuntimeError):
            return None
    return _ENVIRONMENT


def _compiled_model(path: str, threads: int, cache: Path) -> Any:
    """LiteRT's CompiledModel on ``path`` (CPU, XNNPACK with the weight cache ``cache``), in
    the process's one Environment (:func:`_environment`)."""
    import atexit

    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.options import CpuOptions, Options

    if not _SHARED:
        atexit.unregister(_silent_teardown)
        atexit.register(_silent_teardown)

    options = Options(cpu_options=CpuOptions(num_threads=threads, xnnpack_weight_cache_path=str(cache)))
    environment = _environment()
    with delegate_banner_hidden(_SETUP_LOG):
        return CompiledModel.from_file(path, options=options, environment=environment)


def _quietly_drop(obj: Any, *names: str) -> None:
    """Release ``obj``'s LiteRT objects with their teardown log hidden (LiteRT logs each
    accelerator it destroys at INFO, and the Python API cannot lower its log level)."""
    try:
        with delegate_banner_hidden(_SETUP_LOG):
            for name in names:
                setattr(obj, name, None)
    except Exception:  # noqa: BLE001 - interpreter teardown: nothing left to hide it with
        pass


class _Compiled:
    """A CompiledModel shared by a file's signature sessions (and their lock)."""

    def __init__(self, path: str, threads: int, cache: Path):
        self.model = _compiled_model(path, threads, cache)
        self.cache = cache
        self.circleops_lock = threading.Lock()
        # its weights now live packed in the cache: the file's pages that packing read go back
        # (a GATHER's table rows are read again from the file as needed)
        from circleops.system.memory import page_out

        real = os.path.realpath(path)
        page_out(lambda mapped: mapped == real)

    def __del__(self) -> None:
        _quietly_drop(self, "model")


def _mapped_cache_model(path: str, threads: int, cache: Path) -> _Compiled:
    """A :class:`_Compiled` on ``path`` that maps its finished weight cache ``cache``. The
    model that packs a new cache keeps XNNPACK's packing buffers for as long as it lives
    (a tiny Gemma3's 0.28 GB file: 0.43 GB of heap after building its cache, 0.17 GB when
    loaded over the finished one; at the Gemma-3-1B shape the packed weights' largest block
    is 256 MiB), so once it has built the cache it is dropped and the file loaded again,
    which maps the cache without packing anything."""
    from circleops.system.huge_pages import huge_page_cache

    built = not cache.exists()
    if not built:
        # the packed weights in 2 MiB pages: a decode step streams them all, and in 4 KiB
        # pages took ~25 000 TLB misses a step (SmolLM2 int4: 6.66 -> 5.43 ms of CPU per token)
        huge_page_cache(cache)
    model = _Compiled(path, threads, cache)
    if built and cache.exists():
        del model  # its packing scratch goes with it; the cache file stays
        huge_page_cache(cache)
        model = _Compiled(path, threads, cache)
    return model


def _interpreter(path: str, threads: int, shared: bool) -> Any:
    """A new Interpreter on ``path``, or (``shared``) the one the signature sessions of the
    same unchanged file at the same thread count already use: a :class:`_Compiled` with its
    weight cache where LiteRT's CompiledModel loads the file, else an Interpreter."""
    from ai_edge_litert.interpreter import Interpreter

    key = None
    if shared:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, threads)
        it = _SHARED.get(key)
        if it is not None:
            return it
        try:
            it = _mapped_cache_model(path, threads, weight_cache_path(path, st))
        except (ImportError, OSError, ValueError, RuntimeError):
            it = None  # no CompiledModel (or cache) here: the Interpreter, one packing per subgraph
        if it is not None:
            _SHARED[key] = it
            return it
    # the tensors are allocated here, once: that is when LiteRT applies its delegate
    # and prints about it (delegate_banner_hidden)
    with delegate_banner_hidden():
        it = Interpreter(model_path=path, num_threads=threads)
        it.allocate_tensors()
    # the sessions sharing it run one at a time: a run writes its inputs, invokes and copies
    # its outputs out of buffers another thread's run would overwrite
    it.circleops_lock = threading.Lock()
    if key is not None:
        _SHARED[key] = it
    return it


# LiteRT's C API for a TensorBuffer's host memory: the Python TensorBuffer only copies in
# (write) and out (read). A generation's decode step wrote its whole cache window into the
# input buffers every step (60 windows for SmolLM2, store_caches/window copies beside
# CompiledModel.run_by_index in every step's profile, issue 34); with the buffers' memory as
# numpy arrays the generator writes only a step's new rows there (circleops.generation.caches.
# WindowStore). The symbols are those of the wheel's own libLiteRt.so (same build as its
# Python wrappers, whose LiteRtTensorBuffer objects they read); absent ones mean no views.
_HOST_MEMORY_TYPE = 1  # kLiteRtTensorBufferTypeHostMemory
_C_API: list[Any] = []  # [the ctypes library, or None where it cannot be loaded]; filled once


def _c_api() -> Any:
    """The wheel's libLiteRt.so through ctypes with the three buffer functions typed, or None
    (no such file, or it lacks a symbol: the Python API's copies are used then)."""
    if not _C_API:
        import ctypes

        lib = None
        try:
            import ai_edge_litert

            lib = ctypes.CDLL(str(Path(ai_edge_litert.__file__).parent / "libLiteRt.so"))
            for name, out in (("LiteRtGetTensorBufferType", ctypes.c_int), ("LiteRtGetTensorBufferSize", ctypes.c_size_t),
                              ("LiteRtGetTensorBufferHostMemory", ctypes.c_void_p)):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.POINTER(out)], ctypes.c_int
            get = ctypes.pythonapi.PyCapsule_GetPointer
            get.argtypes, get.restype = [ctypes.py_object, ctypes.c_char_p], ctypes.c_void_p
        except (ImportError, OSError, AttributeError):
            lib = None
        _C_API.append(lib)
    return _C_API[0]


def host_view(buffer: Any, dtype: Any, shape: Sequence[int], owner: Any = None) -> np.ndarray | None:
    """The host memory of the LiteRT TensorBuffer ``buffer`` as a writable numpy array of
    ``dtype`` and ``shape`` (what a run reads from, or wrote to, that buffer), or None where
    it cannot be had: no C API symbol, a buffer that is not plain host memory (a GPU or NPU
    buffer), or one whose size is not the array's. ``owner`` is kept alive by the array (the
    object whose buffers these are: their memory goes with it)."""
    import ctypes

    lib = _c_api()
    if lib is None:
        return None
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        handle = ctypes.pythonapi.PyCapsule_GetPointer(buffer.capsule, b"LiteRtTensorBuffer")
    except (AttributeError, ValueError):  # another wrapper, or a destroyed buffer
        return None
    kind, size, addr = ctypes.c_int(-1), ctypes.c_size_t(0), ctypes.c_void_p()
    if (lib.LiteRtGetTensorBufferType(handle, ctypes.byref(kind)) != 0 or kind.value != _HOST_MEMORY_TYPE
            or lib.LiteRtGetTensorBufferSize(handle, ctypes.byref(size)) != 0 or size.value != nbytes
            or lib.LiteRtGetTensorBufferHostMemory(handle, ctypes.byref(addr)) != 0 or not addr.value):
        return None
    memory = (ctypes.c_byte * nbytes).from_address(addr.value)
    memory.circleops_owner = (buffer, owner)  # the array's base holds the buffer (and its runner)
    return np.frombuffer(memory, dtype=dtype).reshape(tuple(shape))


class _SignatureRunner:
    """One signature of a :class:`_Compiled` model: its input and output TensorBuffers,
    written and read by name. TensorBuffers take no int64: those go in as int32 pairs."""

    def __init__(self, compiled: _Compiled, signature: str, names: Sequence[str], out_names: Sequence[str]):
        cm = compiled.model
        self._cm, self._index = cm, cm.get_signature_index(signature)
        if self._index < 0:
            raise RuntimeRunError(f"LiteRT finds no signature {signature!r}")
        order = cm.get_signature_list()[signature]
        ins, outs = cm.get_input_tensor_details(signature), cm.get_output_tensor_details(signature)
        self._in_buffers = dict(zip(order["inputs"], cm.create_input_buffers(self._index)))
        self._out_buffers = dict(zip(order["outputs"], cm.create_output_buffers(self._index)))
        missing = [n for n in names if n not in ins] + [n for n in out_names if n not in outs]
        if missing:
            raise RuntimeRunError(f"signature {signature!r} names tensors {missing!r} that LiteRT does not find")
        self.in_details = [dict(ins[n], shape_signature=ins[n]["shape"]) for n in names]
        self.out_details = [outs[n] for n in out_names]
        self._in_order, self._ins, self._outs = list(order["inputs"]), list(names), list(out_names)
        self._first = True
        # what each run needs, made once: a decode step writes and reads ~120 tensors (SmolLM2's
        # caches), and per-tensor Python work was a quarter of an int4 step (bench/results/26-*)
        self._in_list = [self._in_buffers[n] for n in self._in_order]
        self._out_list = list(self._out_buffers.values())
        self._writes = [(self._in_buffers[n], np.dtype(d["dtype"])) for n, d in zip(self._ins, self.in_details)]
        self._reads = [_read_plan(self._out_buffers[n], d) for n, d in zip(self._outs, self.out_details)]
        self._views: list[Any] = [None] * len(self._ins)  # input_views(), once asked for
        self._out_views: list[np.ndarray] | None = None  # outputs_in_place(): run returns these
        # the capsules RunByIndex takes, made once (CompiledModel.run_by_index builds both
        # lists every run: 120 property reads per SmolLM2 step)
        self._in_caps = [b.capsule for b in self._in_list]
        self._out_caps = [b.capsule for b in self._out_list]
        native = getattr(cm, "_model", None)
        self._run_native = getattr(native, "RunByIndex", None)

    def input_views(self) -> list[np.ndarray] | None:
        """The host memory of this signature's input buffers as arrays (:func:`host_view`), in
        the order of its inputs; None unless every input has one. An input given to :meth:`run`
        as the very array returned here is not copied: it is already where the run reads it."""
        with delegate_banner_hidden(_SETUP_LOG):  # a buffer's first use may set up LiteRT's environment
            # each array keeps its TensorBuffer alive (not this runner: the runner holds the
            # arrays, and a cycle would keep the buffers past the session until a gc pass)
            views = [host_view(self._in_buffers[n], d["dtype"], d["shape"]) for n, d in zip(self._ins, self.in_details)]
        if any(v is None for v in views):
            return None
        self._views = views
        return list(views)

    def outputs_in_place(self) -> bool:
        """Make :meth:`run` return arrays over its output buffers' own memory (no read: ~60
        TensorBuffer.read calls per decode step, ~3 % of an int4 step, issue 34); True where
        every output has a host view (:func:`host_view`), else False and runs keep copying."""
        if self._out_views is None:
            with delegate_banner_hidden(_SETUP_LOG):
                views = [host_view(self._out_buffers[n], d["dtype"], d["shape"])
                         for n, d in zip(self._outs, self.out_details)]
            self._out_views = [] if any(v is None for v in views) else views
        return bool(self._out_views)

    def __del__(self) -> None:
        _quietly_drop(self, "_in_buffers", "_out_buffers", "_cm")

    def run(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        if self._first:  # a TensorBuffer's first write sets up a LiteRT environment, and logs it
            self._first = False
            with delegate_banner_hidden(_SETUP_LOG):
                return self.run(arrays)
        for (buffer, dtype), x, view in zip(self._writes, arrays, self._views):
            if x is view:  # the buffer's own memory, written by the caller (input_views)
                continue
            if view is not None:  # a plain copy into that memory (TensorBuffer.write: ~15 us each)
                view[...] = x
                continue
            x = np.asarray(x, dtype=dtype)
            buffer.write(x.view(np.int32) if dtype == np.int64 else x)
        if self._run_native is not None:
            self._run_native(self._index, self._in_caps, self._out_caps)
        else:
            self._cm.run_by_index(self._index, self._in_list, self._out_list)
        if self._out_views:  # the buffers' memory itself, until the next run
            return list(self._out_views)
        return [buffer.read(n, dtype).view(view).reshape(shape) for buffer, n, dtype, view, shape in self._reads]


def _read_plan(buffer: Any, detail: dict) -> tuple[Any, int, Any, Any, tuple[int, ...]]:
    """(buffer, elements to read, their dtype, the array's dtype, its shape) of an output:
    int64 is read as int32 pairs."""
    dtype, shape = np.dtype(detail["dtype"]), tuple(int(d) for d in detail["shape"])
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.int64:
        return buffer, 2 * n, np.dtype(np.int32), dtype, shape
    return buffer, n, dtype, dtype, shape


class Session:
    """A LiteRT interpreter on one file: its main subgraph (inputs and outputs in subgraph
    order), or the signature ``signature`` (in the SignatureDef's order). Signature sessions
    of one file at one thread count share an Interpreter (each runs its own subgraph)."""

    def __init__(self, path: str | os.PathLike, signature: str | None = None):
        self.path = str(Path(path))
        self.signature = signature
        if not Path(path).is_file():
            raise RuntimeRunError(f"{path}: no such file")
        check_file(self.path)  # before any native code reads the file (issue 24)
        note_in_process("litert")  # later isolated sessions must not fork from here
        self.num_threads = num_threads()
        try:
            self._it = _interpreter(self.path, self.num_threads, shared=signature is not None)
        except (ValueError, RuntimeError) as err:
            raise RuntimeRunError(f"LiteRT cannot load {path}: {err}") from None
        self._runner = self._compiled = None
        if signature is None:
            self._it.allocate_tensors()
            self._in_details = self._it.get_input_details()
            self._out_details = self._it.get_output_details()
            self._names = [d["name"] for d in self._in_details]
            self._out_names = [d["name"] for d in self._out_details]
        else:
            from circleops.serialize.reader import read_signatures

            sigs = {s.key: s for s in read_signatures(path)}
            if signature not in sigs:
                raise RuntimeRunError(f"{path} has no signature {signature!r}; it has {sorted(sigs)}")
            self._names, self._out_names = list(sigs[signature].inputs), list(sigs[signature].outputs)
            if isinstance(self._it, _Compiled):
                try:
                    with delegate_banner_hidden(_SETUP_LOG):
                        self._compiled = _SignatureRunner(self._it, signature, self._names, self._out_names)
                except (ValueError, RuntimeError) as err:
                    raise RuntimeRunError(f"LiteRT: {path}: {err}") from None
                self._in_details, self._out_details = self._compiled.in_details, self._compiled.out_details
                return
            try:
                self._runner = self._it.get_signature_runner(signature)
            except ValueError as err:
                raise RuntimeRunError(f"LiteRT: {path} has no signature {signature!r}: {err}") from None
            by_name, out_by_name = self._runner.get_input_details(), self._runner.get_output_details()
            missing = [n for n in self._names if n not in by_name] + [n for n in self._out_names if n not in out_by_name]
            if missing:  # the file's SignatureDef and LiteRT's view of it disagree: a damaged file
                raise RuntimeRunError(f"LiteRT: signature {signature!r} of {path} names tensors {missing!r} that "
                                      f"LiteRT does not find in it; the file is damaged. Convert it again.")
            self._in_details = [by_name[n] for n in self._names]
            self._out_details = [out_by_name[n] for n in self._out_names]
            self._sub = self._runner._subgraph_index
            with delegate_banner_hidden():  # the delegate is applied to this subgraph now
                self._it._interpreter.AllocateTensors(self._sub)

    @property
    def inputs(self) -> list[TensorSpec]:
        if getattr(self, "_inputs", None) is None:  # made once: a generation step reads them every run
            self._inputs = [_spec(n, d) for n, d in zip(self._names, self._in_details)]
            self._signature_specs = [_spec(n, d, "shape_signature") for n, d in zip(self._names, self._in_details)]
            self._shapes = [tuple(int(n) for n in d["shape"]) for d in self._in_details]
            self._dtypes = [np.dtype(d["dtype"]) for d in self._in_details]
        return list(self._inputs)

    def input_views(self) -> list[np.ndarray] | None:
        """Writable arrays over the memory LiteRT's run reads each input from (in
        :attr:`inputs` order), or None where LiteRT gives none (an Interpreter session, or a
        buffer that is not host memory: :func:`host_view`). Data written into them is what the
        next :meth:`run` reads; passing one of them to :meth:`run` as that input skips its copy.
        Made once per session; the caller owns their contents between runs."""
        if self._compiled is None:
            return None
        if getattr(self, "_views", None) is None:
            self._views = self._compiled.input_views() or []
        return list(self._views) or None

    @property
    def outputs(self) -> list[TensorSpec]:
        return [_spec(n, d) for n, d in zip(self._out_names, self._out_details)]

    def outputs_in_place(self) -> bool:
        """From now on :meth:`run` returns arrays over the memory LiteRT writes each output to,
        not copies: the next run of this session overwrites them, so the caller reads (or
        copies) them before it. True where LiteRT gives host views of every output (a
        signature session on a compiled model: :func:`host_view`); False, and runs keep
        returning copies, where it does not."""
        return self._compiled is not None and self._compiled.outputs_in_place()

    def run(self, inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run on ``inputs`` (in :attr:`inputs` order, or a dict by name); returns the outputs
        in :attr:`outputs` order. Only a dimension the file declares dynamic (-1 in its
        shape signature) may differ from :attr:`inputs`' shapes: the input is resized to it."""
        views = getattr(self, "_views", None)
        if views and isinstance(inputs, list) and len(inputs) == len(views):
            # a generation step: most inputs are this session's own input memory (input_views),
            # made from its specs; only the others are checked and copied (the generic path's
            # per-input work was ~0.1 ms of a SmolLM2 int4 step's 62 inputs, issue 34)
            odd = [i for i, (x, v) in enumerate(zip(inputs, views)) if x is not v]
            if len(odd) < len(views):
                return self._run_own(inputs, odd)
        where = self._where()
        arrays = [np.asarray(x) for x in in_order(self.inputs, inputs, where)]
        # against the shape signature: only a dynamic (-1) dimension may be resized, any other
        # difference ends in an XNNPACK error or outputs of another shape
        check_inputs(self._signature_specs, arrays, where, getattr(self, "_views", None) or ())
        # a 0-d input passes for [1] (check_inputs); not np.ascontiguousarray: it would turn
        # a 0-d input into shape (1,) silently
        arrays = [x.reshape(1) if x.ndim == 0 and shape == (1,) else x for x, shape in zip(arrays, self._shapes)]
        try:
            if self._compiled is not None:
                if any(x.shape != shape for x, shape in zip(arrays, self._shapes)):
                    raise RuntimeRunError(f"{where}: inputs of shapes {[list(x.shape) for x in arrays]} where the "
                                          f"file takes {[list(s) for s in self._shapes]}")
                with self._it.circleops_lock:
                    return self._compiled.run(arrays)
            if self._runner is not None:
                with self._it.circleops_lock:
                    if all(x.shape == shape for x, shape in zip(arrays, self._shapes)):
                        return self._run_in_place(arrays)
                    arrays = [x if x.flags.c_contiguous else np.array(x, order="C") for x in arrays]
                    outs = self._runner(**dict(zip(self._names, arrays)))
                    return [np.asarray(outs[n]) for n in self._out_names]  # get_tensor copies
            arrays = [x if x.flags.c_contiguous else np.array(x, order="C") for x in arrays]
            return self._run_main(arrays)
        except RuntimeRunError:
            raise
        except (ValueError, RuntimeError) as err:
            raise RuntimeRunError(f"LiteRT failed to run {self.path}: {err}") from None

    def _where(self) -> str:
        return self.path if self.signature is None else f"{self.path} (signature {self.signature!r})"

    def _run_own(self, inputs: list[Any], odd: list[int]) -> list[np.ndarray]:
        """:meth:`run` where every input but those at ``odd`` is the session's own input memory."""
        arrays = list(inputs)
        if getattr(self, "_inputs", None) is None:
            self.inputs  # noqa: B018 (makes the specs and shapes)
        for i in odd:
            x = np.asarray(arrays[i])
            if x.dtype != self._dtypes[i] or x.shape != self._shapes[i]:  # (dtype.name is slow)
                check_one(self._signature_specs[i], x, i, self._where())
            arrays[i] = x.reshape(1) if x.ndim == 0 and self._shapes[i] == (1,) else x
            if arrays[i].shape != self._shapes[i]:
                raise RuntimeRunError(f"{self._where()}: input #{i} has shape {list(arrays[i].shape)} where the file "
                                      f"takes {list(self._shapes[i])}")
        try:
            with self._it.circleops_lock:
                return self._compiled.run(arrays)
        except (ValueError, RuntimeError) as err:
            raise RuntimeRunError(f"LiteRT failed to run {self.path}: {err}") from None

    def _run_in_place(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """A signature's run with inputs of its allocated shapes: each input copied once,
        straight into the interpreter's own buffer (a strided view too: a Generator's cache
        window), where the signature runner would resize, allocate and copy a contiguous
        copy of it again (SmolLM2's 60 caches: 36 ms of CPU per 300-token prompt on LiteRT,
        bench/results/18-*.yaml)."""
        w, sub = self._it._interpreter, self._sub
        for x, d in zip(arrays, self._in_details):
            # the view lives only for this copy: LiteRT may move its buffers on allocation
            w.tensor(w, d["index"], sub)[...] = x
        w.Invoke(sub)
        return [w.GetTensor(d["index"], sub) for d in self._out_details]  # copies

    def _run_main(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        it = self._it
        details = it.get_input_details()
        if any(tuple(d["shape"]) != x.shape for d, x in zip(details, arrays)):
            for d, x in zip(details, arrays):
                if tuple(d["shape"]) != x.shape:
                    it.resize_tensor_input(d["index"], list(x.shape))
            it.allocate_tensors()
            details = it.get_input_details()
        for d, x in zip(details, arrays):
            it.set_tensor(d["index"], x)
        it.invoke()
        return [it.get_tensor(d["index"]) for d in it.get_output_details()]  # get_tensor copies


def _spec(name: str, detail: dict, shape_key: str = "shape") -> TensorSpec:
    shape = detail.get(shape_key)
    if shape is None or len(shape) != len(detail["shape"]):  # no signature: the static shape
        shape = detail["shape"]
    return TensorSpec(name, tuple(int(d) for d in shape), np.dtype(detail["dtype"]).name)


def run(path: str | os.PathLike, inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray],
        signature: str | None = None) -> list[np.ndarray]:
    """Run ``path`` on ``inputs`` once and return its outputs, in order.

    Without ``signature`` the main subgraph runs with inputs and outputs in subgraph order.
    With it, the named signature runs; ``inputs`` are then in the SignatureDef's order (or
    a dict by name) and outputs come back in its order. Only dimensions the file declares
    dynamic (-1) may differ from the file's shapes.
    """
    return Session(path, signature).run(inputs)


__all__ = ["NUM_THREADS", "Session", "num_threads", "run"]
