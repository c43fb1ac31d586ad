"""A native runtime's Session in a child process, for one-shot commands.

circleops checks every file's integrity before onert or LiteRT reads it (circleops.serialize.integrity),
but a runtime can still fault on a sound file: a kernel of onert reading past a tensor whose
shape it did not expect, an op it half supports. In-process that kills the user's process
with a signal, which no Python code can catch. ``circleops run``, ``convert --verify`` and
``check`` run the runtime in a forked child instead: its death is reported as a
RuntimeCrashError naming the file, the runtime and the signal (exit 2), and the command's
own process survives. ``generate`` and ``chat`` keep in-process sessions: a token's decode
step must not pay a round trip through a pipe.

    session = IsolatedSession("onert", "model.circle")   # the child loads and prepares it
    outputs = session.run([x])                           # arrays go through a pipe
    session.close()
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from typing import Any, Mapping, Sequence

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


def _serve(runtime: str, path: str, signature: str | None, conn: Any, parent_end: Any,
           env: dict[str, str] | None = None) -> None:
    """The child: load the file in ``runtime``, then run what the parent sends until it closes."""
    # the fork copied the parent's end too: closed, so the parent's death is an EOF here
    # (else an orphaned child would wait for itself forever)
    parent_end.close()
    os.environ.update(env or {})
    torch = sys.modules.get("torch")
    if torch is not None:
        # the parent's OpenMP thread pool did not survive the fork: torch code in the child
        # (the test suite's cross-check runs the reference interpreter beside the runtime)
        # would wait forever for its workers; on one thread it never starts them
        torch.set_num_threads(1)
    try:
        session = runtime_module(runtime).Session(path, signature)
        conn.send_bytes(_pack({"kind": "ok", "inputs": _specs(session.inputs), "outputs": _specs(session.outputs)}))
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
        conn.send_bytes(_error(err))
        return
    while True:
        try:
            header, arrays = _unpack(conn.recv_bytes())
        except (EOFError, OSError):  # the parent is gone
            return _quiet_exit()
        if header.get("kind") != "run":
            return _quiet_exit()
        inputs: Any = dict(zip(header["names"], arrays)) if header.get("names") is not None else arrays
        try:
            import numpy as np

            outputs = [np.asarray(o) for o in session.run(inputs)]
            conn.send_bytes(_pack({"kind": "ok", "outputs": _specs(session.outputs)}, outputs))
        except BaseException as err:  # noqa: BLE001
            conn.send_bytes(_error(err))


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


class IsolatedSession:
    """``runtime``'s Session on ``path``, living in a forked child process (same interface:
    ``inputs``, ``outputs``, ``run``). A signal that kills the child raises RuntimeCrashError."""

    def __init__(self, runtime: str, path: str | os.PathLike, signature: str | None = None):
        self.runtime, self.path, self.signature = runtime, str(path), signature
        ctx = multiprocessing.get_context("fork")
        self._conn, child_conn = ctx.Pipe()
        env = {}
        if runtime == "litert":
            env[WEIGHT_CACHE_ENV] = _scratch_dir()
        self._proc = ctx.Process(target=_serve, args=(runtime, self.path, signature, child_conn, self._conn, env),
                                 daemon=True, name=f"circleops-{runtime}")
        self._proc.start()
        child_conn.close()  # only the child's copy stays open: its death ends our recv
        header, _ = self._reply("load")
        self._inputs, self._outputs = _tensor_specs(header["inputs"]), _tensor_specs(header["outputs"])

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    def run(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[Any]:
        """Run in the child on ``inputs`` (as the runtime's Session.run takes them)."""
        import numpy as np

        if self._proc is None:
            raise RuntimeRunError(f"the {self.runtime} session on {self.path} is closed")
        if isinstance(inputs, Mapping):
            message = _pack({"kind": "run", "names": list(inputs)}, [np.asarray(v) for v in inputs.values()])
        else:
            message = _pack({"kind": "run", "names": None}, [np.asarray(v) for v in inputs])
        try:
            self._conn.send_bytes(message)
        except (BrokenPipeError, OSError):
            pass  # the child died: _reply says how
        header, outputs = self._reply("run")
        self._outputs = _tensor_specs(header["outputs"])
        return outputs

    def _reply(self, stage: str) -> Any:
        try:
            data = self._conn.recv_bytes()
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
        proc = self._proc
        proc.join(10)
        code = proc.exitcode
        self.close()
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
        """End the child (idempotent)."""
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None:
            return
        try:
            self._conn.send_bytes(_pack({"kind": "close"}))
        except (BrokenPipeError, OSError):
            pass
        self._conn.close()
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


__all__ = ["IsolatedSession", "can_isolate"]
