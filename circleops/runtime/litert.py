"""Run a .tflite file with LiteRT (ai_edge_litert.interpreter.Interpreter, 2 threads)."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from circleops.errors import RuntimeRunError

NUM_THREADS = 2


DELEGATE_BANNER = "Created TensorFlow Lite XNNPACK delegate"


@contextlib.contextmanager
def delegate_banner_hidden():
    """Hide the line LiteRT's C++ prints on fd 2 when it applies its XNNPACK delegate
    ("INFO: Created TensorFlow Lite XNNPACK delegate for CPU."): it lands in the middle of
    text `circleops generate` streams. Anything else written to fd 2 meanwhile is passed on."""
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
                           if DELEGATE_BANNER not in line)
            if rest:
                sys.stderr.write(rest)
                sys.stderr.flush()


def _interpreter(path: Path):
    """A LiteRT interpreter, its tensors allocated once here (that is when LiteRT applies
    its delegate and prints about it: see delegate_banner_hidden)."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        with delegate_banner_hidden():
            it = Interpreter(model_path=str(path), num_threads=NUM_THREADS)
            it.allocate_tensors()
        return it
    except (ValueError, RuntimeError) as err:
        raise RuntimeRunError(f"LiteRT cannot load {path}: {err}") from None


def _check(name: str, value: np.ndarray, detail: dict) -> np.ndarray:
    want = np.dtype(detail["dtype"])
    if value.dtype != want:
        raise RuntimeRunError(
            f"input {name!r}: got {value.dtype}, the model expects {want}; cast the input "
            f"(e.g. x.astype(np.{want.name}))")
    # not np.ascontiguousarray: it turns a 0-d (scalar) input into shape (1,)
    return value if value.flags.c_contiguous else np.array(value, order="C")


def run(path: str | os.PathLike, inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray],
        signature: str | None = None) -> list[np.ndarray]:
    """Run ``path`` on ``inputs`` and return its outputs, in order.

    Without ``signature`` the main subgraph runs with inputs and outputs in subgraph order.
    With it, the named signature runs; ``inputs`` are then in the SignatureDef's order (or
    a dict by name) and outputs come back in its order. An input whose shape differs from
    the file's is resized (the model must allow it).
    """
    path = Path(path)
    if not path.is_file():
        raise RuntimeRunError(f"{path}: no such file")
    it = _interpreter(path)
    try:
        if signature is None:
            return _run_main(it, inputs)
        return _run_signature(path, it, inputs, signature)
    except RuntimeRunError:
        raise
    except (ValueError, RuntimeError) as err:
        raise RuntimeRunError(f"LiteRT failed to run {path}: {err}") from None


def _run_main(it, inputs) -> list[np.ndarray]:
    details = it.get_input_details()
    if isinstance(inputs, Mapping):
        missing = [d["name"] for d in details if d["name"] not in inputs]
        if missing:
            raise RuntimeRunError(f"missing inputs {missing}; the model takes {[d['name'] for d in details]}")
        inputs = [inputs[d["name"]] for d in details]
    if len(inputs) != len(details):
        raise RuntimeRunError(
            f"the model takes {len(details)} inputs ({[d['name'] for d in details]}), got {len(inputs)}")
    arrays = [_check(d["name"], np.asarray(x), d) for d, x in zip(details, inputs)]
    resized = False
    for d, x in zip(details, arrays):
        if tuple(d["shape"]) != x.shape:
            it.resize_tensor_input(d["index"], list(x.shape))
            resized = True
    it.allocate_tensors()
    if resized:
        details = it.get_input_details()
    for d, x in zip(details, arrays):
        it.set_tensor(d["index"], x)
    it.invoke()
    return [it.get_tensor(d["index"]).copy() for d in it.get_output_details()]


def _run_signature(path: Path, it, inputs, signature: str) -> list[np.ndarray]:
    from circleops.serialize.reader import read_signatures

    sigs = {s.key: s for s in read_signatures(path)}
    if signature not in sigs:
        raise RuntimeRunError(f"{path} has no signature {signature!r}; it has {sorted(sigs)}")
    sig = sigs[signature]
    names = list(sig.inputs)
    if not isinstance(inputs, Mapping):
        if len(inputs) != len(names):
            raise RuntimeRunError(
                f"signature {signature!r} takes {len(names)} inputs ({names}), got {len(inputs)}")
        inputs = dict(zip(names, inputs))
    runner = it.get_signature_runner(signature)
    details = runner.get_input_details()
    feed = {n: _check(n, np.asarray(inputs[n]), details[n]) for n in names}
    outs = runner(**feed)
    return [np.asarray(outs[n]).copy() for n in sig.outputs]
