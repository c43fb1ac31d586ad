"""A native runtime's Session in a child process, for one-shot commands.

circleops checks every file's integrity before onert or LiteRT reads it (circleops.serialize.integrity),
but a runtime can still fault on a sound file: a kernel of onert reading past a tensor whose
shape it did not expect, an op it half supports. In-process that kills the user's process
with a signal, which no Python code can catch. ``circleops run``, ``convert --verify`` and
``check`` run the runtime in a child process instead (forked; for a file of
FRESH_FROM_BYTES or more a fresh interpreter, which holds none of the parent's memory;
inside :func:`sharing_children` one child serves every signature of a LiteRT file): its death is reported as a
RuntimeCrashError naming the file, the runtime and the signal (exit 2), and the command's
own process survives. ``generate`` and ``chat`` keep in-process sessions: a token's decode
step must not pay a round trip through a pipe.

    session = IsolatedSession("onert", "model.circle")   # the child loads and prepares it
    outputs = session.run([x])                           # arrays go through a pipe
    session.close()
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from typing import Any, Iterator, Mapping, Sequence

from circleops.errors import RuntimeCrashError, RuntimeRunError
from circleops.runtime import TensorSpec, runtime_module


# Runtimes whose native code has run in this process (an in-process Session: generate, a
# test). Their libraries keep thread pools and locks a fork does not carry over: a child
# forked after that can wait forever inside the runtime (measured: onert's run in a child
# forked from a pytest worker that had run onert never returned, and the suite hung). Such a
# process runs later sessions in-process, as generate does; a one-shot command (run,
# --verify, check) starts fresh and forks its child before any native code ran.
_NATIVE_USED: set[str] = set()


def note_in_process(runtime: str) -> None:
    """Record that ``runtime``'s native code runs in this process (its Session's constructor
    calls this): from then on this process cannot fork a sound child for it."""
    _NATIVE_USED.add(runtime)


def can_isolate() -> bool:
    """Whether a sound child can be forked here: fork exists (Linux, macOS; a forked child
    inherits the loaded modules, so it starts in milliseconds where a spawned interpreter
    re-imports torch), and no native runtime has run in this process yet."""
    return "fork" in multiprocessing.get_all_start_methods() and not _NATIVE_USED


# The pipe carries no pickles: the child reads a file from outside, and a runtime it
# runs might be subverted by that file, so what comes back is data only: a JSON header and
# arrays in .npy format (np.load with allow_pickle=False).

def _pack(header: dict[str, Any], arrays: Sequence[Any] = ()) -> bytes:
    import io
    import json

    import numpy as np

    out = io.BytesIO()
    head = json.dumps({**header, "arrays": len(arrays)}).encode()
    out.write(len(head).to_bytes(8, "little"))
    out.write(head)
    for a in arrays:
        np.lib.format.write_array(out, np.asarray(a), allow_pickle=False)
    return out.getvalue()


def _unpack(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    import io
    import json

    import numpy as np

    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n].decode())
    stream = io.BytesIO(data[8 + n:])
    return header, [np.load(stream, allow_pickle=False) for _ in range(int(header["arrays"]))]


def _specs(specs: Sequence[TensorSpec]) -> list[list[Any]]:
    return [[s.name, list(s.shape), s.dtype] for s in specs]


def _tensor_specs(rows: Sequence[Sequence[Any]]) -> list[TensorSpec]:
    return [TensorSpec(str(name), tuple(int(d) for d in shape), str(dtype)) for name, shape, dtype in rows]


def _error(err: BaseException) -> bytes:
    return _pack({"kind": "error", "type": type(err).__name__, "message": str(err)})


def _raise(header: dict[str, Any]) -> None:
    """The child's exception again: a circleops error by its class name (only those), an
    AssertionError as itself (the test suite's cross-check), anything else as a
    RuntimeRunError with the child's words."""
    import circleops.errors as errors

    name, message = str(header.get("type")), str(header.get("message"))
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.CircleOpsError):
        raise cls(message)
    if name == "AssertionError":
        raise AssertionError(message)
    raise RuntimeRunError(f"{name}: {message}")


# One scratch directory per process for the XNNPACK weight caches of its LiteRT children
# (circleops.runtime.litert): the children of one verify share it (the decode graph's child
# packs the file's weights once, the prefill graphs' children map them), and it goes when
# the process ends: a one-shot command leaves no cache behind.
_SCRATCH: list[str] = []
WEIGHT_CACHE_ENV = "CIRCLEOPS_XNNPACK_CACHE"  # the directory circleops.runtime.litert keeps them in


def _scratch_dir() -> str:
    if not _SCRATCH:
        import atexit
        import shutil
        import tempfile

        _SCRATCH.append(tempfile.mkdtemp(prefix="circleops-xnnpack-"))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return _SCRATCH[0]


def _quiet_exit() -> None:
    """fd 2 to /dev/null: the child is done and its answers went through the pipe; what the
    runtime logs while its objects are torn down (LiteRT's accelerators, at INFO) would land
    in the middle of the parent's output."""
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
    except OSError:
        pass


def serve(conn: Any, parent_end: Any = None, env: dict[str, str] | None = None) -> None:
    """The child's loop (a forked child's target, a fresh one's main: circleops.runtime.fresh_child):
    open the sessions the parent asks for (one file's signatures share what the runtime loaded
    of it) and run what it sends, until it closes the connection."""
    # a forked child got the parent's end too: closed, so the parent's death is an EOF here
    # (else an orphaned child would wait for itself forever)
    if parent_end is not None:
        parent_end.close()
    os.environ.update(env or {})
    torch = sys.modules.get("torch")
    if torch is not None:
        # the parent's OpenMP thread pool did not survive a fork: torch code in the child
        # (the test suite's cross-check runs the reference interpreter beside the runtime)
        # would wait forever for its workers; on one thread it never starts them
        torch.set_num_threads(1)
    sessions: dict[int, Any] = {}
    # what a dropped session loaded stays while the child lives (LiteRT: the file's
    # CompiledModel, which its signature sessions share through a weak reference): the next
    # signature of the same file must not load and compile it again
    loaded: list[Any] = []
    while True:
        try:
            header, arrays = _unpack(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            return _quiet_exit()
        kind, sid = header.get("kind"), header.get("session")
        if kind == "open":
            try:
                _set_env(header.get("env") or {})
                session = runtime_module(header["runtime"]).Session(header["path"], header.get("signature"))
                sessions[int(sid)] = session
                loaded.append(getattr(session, "_it", None))
                conn.send_bytes(_pack({"kind": "ok", "inputs": _specs(session.inputs),
                                       "outputs": _specs(session.outputs)}))
            except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
                conn.send_bytes(_error(err))
        elif kind == "run":
            inputs: Any = dict(zip(header["names"], arrays)) if header.get("names") is not None else arrays
            try:
                import numpy as np

                session = sessions[int(sid)]
                outputs = [np.asarray(o) for o in session.run(inputs)]
                conn.send_bytes(_pack({"kind": "ok", "outputs": _specs(session.outputs)}, outputs))
                del outputs
            except BaseException as err:  # noqa: BLE001
                conn.send_bytes(_error(err))
        elif kind == "drop":  # no reply: the parent does not wait for it
            sessions.pop(int(sid), None)
        elif kind == "memory":  # this process's resident bytes as /proc says (tests, benchmarks)
            conn.send_bytes(_pack({"kind": "ok", "pid": os.getpid(), "status": _own_status()}))
        else:
            return _quiet_exit()


def _set_env(values: dict[str, Any]) -> None:
    """The parent's values of the variables a runtime reads when a session is created
    (NUM_THREADS), at the time it asked for this session; None unsets one."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)


def _own_status() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process in bytes ({} without /proc)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _killed_message(runtime: str, path: str, doing: str) -> str:
    """A child killed by SIGKILL: the out-of-memory killer's doing, with the peak resident
    memory of this process's children (getrusage: the largest of those that ended) and the
    machine's memory."""
    import resource

    from circleops.system.memory import machine_memory

    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    total, available = machine_memory()
    machine = f" of this machine's {total / 1e9:.1f} GB ({available / 1e9:.1f} GB available now)" if total else ""
    return (f"{runtime} was killed by SIGKILL while {doing} {path}: out of memory (the kernel's OOM killer ends a "
            f"process so), not a fault in the file. The runtime's process peaked at {peak / 1e9:.1f} GB "
            f"resident{machine}. Free memory (other programs, a smaller --max-cache-len), convert without "
            f"--verify, or run on a machine with more memory.")


# A file from this size up is run in a fresh interpreter, not a fork. A forked child's resident
# set counts every page of the parent it shares (copy-on-write): at verify the convert of the
# Gemma-3-1B shape held 1.15 GB (torch, the references), and its LiteRT child peaked at 5.41 GB
# of which those were 1.15 (issue 32). A fresh interpreter pays its imports once (one child
# serves every signature of a file, :func:`sharing_children`) and holds only what it loads.
FRESH_FROM_BYTES = 256 * 2**20

# Runtimes whose sessions on one file share what the runtime loaded (LiteRT: one
# CompiledModel, its weights packed once). Only those share a child: onert's sessions each
# load the weights, and one child at a time must hold them once.
_SHARES_LOADED = frozenset({"litert"})

# (runtime, path) -> the child serving that file's sessions, while a sharing_children() scope is open
_SCOPES: list[dict[tuple[str, str], "_Child"]] = []


@contextlib.contextmanager
def sharing_children() -> Iterator[None]:
    """Inside, the isolated sessions of one file on a runtime that shares a loaded file
    between sessions (LiteRT) are served by one child: it loads and compiles the file once
    for every signature (convert --verify runs eleven graphs of one file) instead of once per
    graph; the children end when the scope closes."""
    scope: dict[tuple[str, str], _Child] = {}
    _SCOPES.append(scope)
    try:
        yield
    finally:
        _SCOPES.remove(scope)
        for child in scope.values():
            child.close()


def _fresh(path: str, fresh: bool | None) -> bool:
    """Whether the child for ``path`` starts as a fresh interpreter (``fresh`` None: from
    :data:`FRESH_FROM_BYTES` of file up, or where no sound child can be forked)."""
    if fresh is not None:
        return fresh
    if not can_isolate():
        return True
    try:
        return os.path.getsize(path) >= FRESH_FROM_BYTES
    except OSError:
        return False


def _start_fresh(conn: Any, env: dict[str, str]) -> Any:
    """A fresh interpreter serving ``conn`` (``python -m circleops.runtime.fresh_child FD``; a
    multiprocessing Connection end passed by its descriptor, the caller closes its own copy),
    with ``env`` over this process's environment and this process's import path (so it runs
    the same circleops): a subprocess.Popen."""
    import subprocess

    path = [p for p in sys.path if p]
    child_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(path)}
    fd = conn.fileno()
    return subprocess.Popen([sys.executable, "-m", "circleops.runtime.fresh_child", str(fd)], env=child_env,
                            pass_fds=(fd,), stdin=subprocess.DEVNULL)


class _Child:
    """A child process serving runtime sessions over a pipe: forked (it starts in
    milliseconds with the parent's modules) or a fresh interpreter (circleops.runtime.fresh_child:
    none of the parent's memory)."""

    def __init__(self, runtime: str, fresh: bool):
        self.runtime, self.fresh = runtime, fresh
        env = {}
        if runtime == "litert":
            env[WEIGHT_CACHE_ENV] = _scratch_dir()
        ctx = multiprocessing.get_context("fork")
        self.conn, child_conn = ctx.Pipe()
        self._next = 0
        if fresh:
            self.proc: Any = _start_fresh(child_conn, env)
            self.pid = self.proc.pid
        else:
            self.proc = ctx.Process(target=serve, args=(child_conn, self.conn, env), daemon=True,
                                    name=f"circleops-{runtime}")
            self.proc.start()
            self.pid = self.proc.pid
        child_conn.close()  # only the child's copy stays open: its death ends our recv

    def new_id(self) -> int:
        self._next += 1
        return self._next

    def send(self, message: bytes) -> None:
        try:
            self.conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            pass  # the child died: the reply's absence says how

    def recv(self) -> bytes:
        return self.conn.recv_bytes()

    def exitcode(self, timeout: float) -> int | None:
        """The child's exit status once it ended (negative: the signal that ended it)."""
        if self.fresh:
            import subprocess

            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return None
        self.proc.join(timeout)
        return self.proc.exitcode

    def alive(self) -> bool:
        return self.proc.poll() is None if self.fresh else self.proc.is_alive()

    def close(self) -> None:
        """End the child (idempotent)."""
        if self.proc is None:
            return
        self.send(_pack({"kind": "close"}))
        self.conn.close()
        if self.exitcode(5) is None:
            self.proc.kill()
            self.exitcode(30)
        self.proc = None


class IsolatedSession:
    """``runtime``'s Session on ``path``, living in a child process (same interface:
    ``inputs``, ``outputs``, ``run``). A signal that kills the child raises RuntimeCrashError.
    ``fresh``: the child is a fresh interpreter (True), a fork (False) or, None, a fresh one
    for a file of :data:`FRESH_FROM_BYTES` or more; inside :func:`sharing_children` the
    sessions of one LiteRT file share their child."""

    def __init__(self, runtime: str, path: str | os.PathLike, signature: str | None = None, *,
                 fresh: bool | None = None):
        self.runtime, self.path, self.signature = runtime, str(path), signature
        key = (runtime, os.path.realpath(self.path))
        scope = _SCOPES[-1] if _SCOPES and runtime in _SHARES_LOADED else None
        child = scope.get(key) if scope is not None else None
        if child is not None and child.proc is None:  # it crashed serving an earlier session
            child = None
        self._owned = child is None
        if child is None:
            child = _Child(runtime, _fresh(self.path, fresh))
            if scope is not None:
                scope[key] = child
                self._owned = False  # the scope ends it
        self._child, self._id = child, child.new_id()
        threads = {k: os.environ.get(k) for k in ("NUM_THREADS",)}  # read by the runtime as the session opens
        child.send(_pack({"kind": "open", "session": self._id, "runtime": runtime, "path": self.path,
                          "signature": signature, "env": threads}))
        header, _ = self._reply("load")
        self._inputs, self._outputs = _tensor_specs(header["inputs"]), _tensor_specs(header["outputs"])

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def child_pid(self) -> int | None:
        """The process id of the child serving this session (None once closed)."""
        return self._child.pid if self._child is not None else None

    def child_memory(self) -> dict[str, int]:
        """The child's VmRSS / RssAnon / RssFile in bytes, as its /proc/self/status says."""
        self._request(_pack({"kind": "memory", "session": self._id}))
        header, _ = self._reply("run")
        return {k: int(v) for k, v in header["status"].items()}

    def run(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        """Run in the child on ``inputs`` (as the runtime's Session.run takes them)."""
        import numpy as np

        if isinstance(inputs, Mapping):
            message = _pack({"kind": "run", "session": self._id, "names": list(inputs)},
                            [np.asarray(v) for v in inputs.values()])
        else:
            message = _pack({"kind": "run", "session": self._id, "names": None}, [np.asarray(v) for v in inputs])
        self._request(message)
        header, outputs = self._reply("run")
        self._outputs = _tensor_specs(header["outputs"])
        return outputs

    def _request(self, message: bytes) -> None:
        if self._child is None or self._child.proc is None:
            raise RuntimeRunError(f"the {self.runtime} session on {self.path} is closed")
        self._child.send(message)

    def _reply(self, stage: str) -> Any:
        try:
            data = self._child.recv()
        except (EOFError, OSError):
            raise self._crash(stage) from None
        try:
            header, arrays = _unpack(data)
        except Exception as err:  # noqa: BLE001 - a child that sends garbage is a broken child
            raise RuntimeRunError(f"the {self.runtime} child process on {self.path} answered garbage ({err})") from None
        if header.get("kind") == "error":
            _raise(header)
        return header, arrays

    def _crash(self, stage: str) -> RuntimeCrashError:
        child = self._child
        code = child.exitcode(10)
        child.close()
        self._child = None
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        doing = "loading" if stage == "load" else "running"
        if code == -signal.SIGKILL:  # nothing in the runtime sends itself SIGKILL: the kernel's OOM killer does
            return RuntimeCrashError(_killed_message(self.runtime, self.path, doing))
        return RuntimeCrashError(
            f"{self.runtime} crashed while {doing} {self.path}: its process {how}. The file passed circleops' "
            f"integrity check, so this is a fault inside {self.runtime} on this file (an operator or "
            f"shape it does not handle); circleops ran it in a child process, so nothing else was affected. "
            f"Run the file with --runtime reference to check it, or convert it again for --target "
            f"{'onert' if self.runtime == 'onert' else 'tflite'}.")

    def close(self) -> None:
        """End this session: its child too unless a :func:`sharing_children` scope serves
        other sessions from it (idempotent)."""
        child, self._child = getattr(self, "_child", None), None
        if child is None:
            return
        if self._owned:
            child.close()
        elif child.proc is not None:
            child.send(_pack({"kind": "drop", "session": self._id}))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


__all__ = ["FRESH_FROM_BYTES", "IsolatedSession", "can_isolate", "sharing_children"]
