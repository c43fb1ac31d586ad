"""Running a written file: one module per runtime (``onert``, ``litert``, ``reference``).

Each runtime module has the same two entry points:

* ``Session(path, signature=None)``: the file loaded and prepared once; ``session.inputs``
  and ``session.outputs`` are :class:`TensorSpec` lists (name, shape, dtype), and
  ``session.run(inputs) -> outputs`` runs it on numpy arrays as often as needed
  (generation runs the decode graph once per token on one session).
* ``run(path, inputs, ...) -> outputs``: one run, ``Session(path).run(inputs)``.

    from circleops.runtime import open_session
    session = open_session("onert", "model.circle")
    logits, = session.run([ids])

Runtime modules are imported on use so that no runtime loads unless needed; this module
imports only the standard library. Adding a runtime is a module with ``Session`` and
``run`` plus a line in :data:`RUNTIMES`.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, Sequence

# runtime -> the file formats it reads (the order of the CLI's --runtime choices)
RUNTIMES: dict[str, tuple[str, ...]] = {
    "onert": ("circle",),
    "litert": ("tflite",),
    "reference": ("circle", "tflite"),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a session: its name, shape and numpy dtype name ("float32")."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class Session(Protocol):
    """What every runtime's ``Session`` provides."""

    path: str
    signature: str | None

    @property
    def inputs(self) -> list[TensorSpec]: ...

    @property
    def outputs(self) -> list[TensorSpec]: ...

    def run(self, inputs: Sequence[Any]) -> list[Any]: ...


def runtime_module(runtime: str) -> ModuleType:
    """The module of ``runtime`` (imported now); RuntimeRunError when it is unknown or its
    package is not installed."""
    from circleops.errors import RuntimeRunError

    if runtime not in RUNTIMES:
        raise RuntimeRunError(f"unknown runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    try:
        return importlib.import_module(f"circleops.runtime.{runtime}")
    except ImportError as err:
        raise RuntimeRunError(f"runtime {runtime!r} is not available ({err}); install circleops[{runtime}] "
                              "or use --runtime reference") from None


# runtimes whose native code reads the file in-process: one-shot commands isolate them
NATIVE_RUNTIMES: tuple[str, ...] = ("onert", "litert")


def open_session(runtime: str, path: str | os.PathLike, signature: str | None = None, *,
                 isolated: bool = False) -> Session:
    """A prepared session of ``runtime`` on the file at ``path`` (``signature``: run that
    signature instead of the main subgraph). Every runtime verifies the file first
    (circleops.serialize.verify). ``isolated``: run a native runtime (onert, LiteRT) in a
    child process, so that a crash inside it becomes a RuntimeCrashError instead of killing
    this process (one-shot commands; generation keeps in-process sessions for speed)."""
    from circleops.errors import RuntimeRunError

    module = runtime_module(runtime)
    try:
        if isolated and runtime in NATIVE_RUNTIMES:
            from circleops.runtime.isolated import IsolatedSession, can_isolate

            if can_isolate():
                return IsolatedSession(runtime, path, signature)
        return module.Session(path, signature)
    except ImportError as err:  # the runtime's native package, imported on first use
        raise RuntimeRunError(f"runtime {runtime!r} is not available ({err}); install circleops[{runtime}] "
                              "or use --runtime reference") from None


__all__ = ["NATIVE_RUNTIMES", "RUNTIMES", "Session", "TensorSpec", "open_session", "runtime_module"]
