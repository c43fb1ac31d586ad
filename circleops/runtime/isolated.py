"""A native runtime's Session in a child process, for one-shot commands.

circleops verifies every file before onert or LiteRT reads it (circleops.serialize.verify),
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


def _serve(runtime: str, path: str, signature: str | None, conn: Any, parent_end: Any) -> None:
    """The child: load the file in ``runtime``, then run what the parent sends until it closes."""
    # the fork copied the parent's end too: closed, so the parent's death is an EOF here
    # (else an orphaned child would wait for itself forever)
    parent_end.close()
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
            return
        if header.get("kind") != "run":
            return
        inputs: Any = dict(zip(header["names"], arrays)) if header.get("names") is not None else arrays
        try:
            import numpy as np

            outputs = [np.asarray(o) for o in session.run(inputs)]
            conn.send_bytes(_pack({"kind": "ok", "outputs": _specs(session.outputs)}, outputs))
        except BaseException as err:  # noqa: BLE001
            conn.send_bytes(_error(err))


class IsolatedSession:
    """``runtime``'s Session on ``path``, living in a forked child process (same interface:
    ``inputs``, ``outputs``, ``run``). A signal that kills the child raises RuntimeCrashError."""

    def __init__(self, runtime: str, path: str | os.PathLike, signature: str | None = None):
        self.runtime, self.path, self.signature = runtime, str(path), signature
        ctx = multiprocessing.get_context("fork")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(runtime, self.path, signature, child_conn, self._conn), daemon=True,
                                 name=f"circleops-{runtime}")
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
        return RuntimeCrashError(
            f"{self.runtime} crashed while {doing} {self.path}: its process {how}. The file passed circleops' "
            f"structural verification, so this is a fault inside {self.runtime} on this file (an operator or "
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
