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
``run`` plus one :func:`register_runtime` entry (its facts: formats, label, signatures,
thread variable); tests/runtime/test_runtime_registry.py adds one that exists only there.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, Sequence

@dataclass(frozen=True)
class Runtime:
    """One runtime's facts, asked wherever a runtime is chosen or opened (convert --verify,
    --graphs, generate, the quantization report, ``circleops run``)."""

    name: str
    formats: tuple[str, ...]  # the file formats it reads
    module: str  # the module with Session(path, signature=None) and run(path, inputs)
    label: str  # how messages name it
    selects_signatures: bool  # can run a signature other than subgraph 0 of a file
    threads_env: str | None  # the environment variable its thread count is read from
    # its native code reads the file in this process: one-shot commands (run, --verify, check)
    # open it in a child process (circleops.runtime.isolated), so a crash is an error, not fatal
    native: bool = False


_REGISTRY: dict[str, Runtime] = {}


class _Formats(Mapping):
    """RUNTIMES: runtime -> the file formats it reads, a live view of the registry."""

    def __getitem__(self, name: str) -> tuple[str, ...]:
        return _REGISTRY[name].formats

    def __iter__(self) -> Iterator[str]:
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


# runtime -> the file formats it reads (the order of the CLI's --runtime choices)
RUNTIMES: Mapping[str, tuple[str, ...]] = _Formats()


def register_runtime(runtime: Runtime) -> Runtime:
    """Add a runtime (its module provides ``Session`` and ``run``); a taken name raises."""
    if runtime.name in _REGISTRY:
        raise ValueError(f"runtime {runtime.name!r} is already registered")
    _REGISTRY[runtime.name] = runtime
    return runtime


def unregister_runtime(name: str) -> None:
    """Remove a runtime (tests that register their own)."""
    _REGISTRY.pop(name, None)


def runtime_info(name: str) -> Runtime:
    """The registry entry of ``name``; RuntimeRunError for an unknown runtime."""
    from circleops.errors import RuntimeRunError

    if name not in _REGISTRY:
        raise RuntimeRunError(f"unknown runtime {name!r}: choose one of {', '.join(_REGISTRY)}.")
    return _REGISTRY[name]


register_runtime(Runtime("onert", ("circle",), "circleops.runtime.onert", "onert", selects_signatures=False,
                         threads_env="NUM_THREADS", native=True))
register_runtime(Runtime("litert", ("tflite",), "circleops.runtime.litert", "LiteRT", selects_signatures=True,
                         threads_env="NUM_THREADS", native=True))
register_runtime(Runtime("reference", ("circle", "tflite"), "circleops.runtime.reference",
                         "circleops' reference interpreter", selects_signatures=True, threads_env=None))


def selects_signatures(name: str) -> bool:
    """Whether runtime ``name`` as installed can run a signature other than subgraph 0: its
    registry entry says so, or (onert) the installed onert has the C API that selects one
    (0.2.0.dev: circleops.runtime.onert_c; 0.1.0 has none)."""
    if runtime_info(name).selects_signatures:
        return True
    if name == "onert":
        from circleops.runtime import onert_c

        return onert_c.available()
    return False


def choose_runtime(requested: bool | str | None, target: Any, quantize: str | None = None,
                   doing: str = "verify") -> tuple[str, str | None]:
    """The one runtime choice: the runtime for ``target``'s files quantized as ``quantize``
    on this machine, and a note when it is not the one asked for by default.

    ``requested``: True or None (the target profile's own runtime) or a runtime's name.
    A default runtime this CPU cannot run the format on (its host requirements,
    circleops.quantize.formats, e.g. AVX-512 for GGML weights on onert) gives way to the
    reference interpreter with a note; one named explicitly raises HostCPUError.
    TargetError for an unknown runtime or one that cannot read the target's files.
    ``doing``: "verify" or "run", for the words of the note."""
    from circleops.errors import TargetError
    from circleops.runtime import host
    from circleops.targets import profile

    p = profile(target)
    default = requested is True or requested is None
    runtime = p.runtime if default else str(requested)
    if runtime not in _REGISTRY:
        raise TargetError(f"unknown runtime {runtime!r}: choose one of {', '.join(_REGISTRY)}.")
    chosen, note = host.runtime_for_host(runtime, default, quantize, doing)
    if p.format not in _REGISTRY[chosen].formats:
        raise TargetError(f"{_REGISTRY[chosen].label} runs {' and '.join(_REGISTRY[chosen].formats)} files; target "
                          f"{p.name} writes {p.format}. Use one of "
                          f"{', '.join(n for n, r in _REGISTRY.items() if p.format in r.formats)}.")
    return chosen, note


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

    info = runtime_info(runtime)
    try:
        return importlib.import_module(info.module)
    except ImportError as err:
        raise RuntimeRunError(f"runtime {runtime!r} is not available ({err}); install circleops[{runtime}] "
                              "or use --runtime reference") from None


def open_session(runtime: str, path: str | os.PathLike, signature: str | None = None, *,
                 isolated: bool = False) -> Session:
    """A prepared session of ``runtime`` on the file at ``path`` (``signature``: run that
    signature instead of the main subgraph). Every runtime checks the file's integrity first
    (circleops.serialize.integrity). ``isolated``: run a native runtime (onert, LiteRT) in a
    child process, so that a crash inside it becomes a RuntimeCrashError instead of killing
    this process (one-shot commands; generation keeps in-process sessions for speed)."""
    from circleops.errors import RuntimeRunError

    module = runtime_module(runtime)
    try:
        if isolated and runtime_info(runtime).native:
            from circleops.runtime.isolated import IsolatedSession, can_isolate

            if can_isolate():
                return IsolatedSession(runtime, path, signature)
        return module.Session(path, signature)
    except ImportError as err:  # the runtime's native package, imported on first use
        raise RuntimeRunError(f"runtime {runtime!r} is not available ({err}); install circleops[{runtime}] "
                              "or use --runtime reference") from None


__all__ = ["RUNTIMES", "Runtime", "Session", "TensorSpec", "choose_runtime", "open_session", "register_runtime",
           "runtime_info", "runtime_module", "selects_signatures", "unregister_runtime"]
