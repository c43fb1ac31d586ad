"""Run a Circle file with onert (the ONE runtime's CPU backend).

onert's Python errors say only ``NNFW_STATUS_ERROR``; the real reason ("Unsupported
operation: MIRROR_PAD", "KernelGenerator: NYI for operation 'InstanceNorm'", ...) is
printed by its C++ core on file descriptor 2. ``run`` captures fd 2 around session
creation and inference and raises RuntimeRunError with that text.

fd 2 is process-wide: do not call ``run`` from several threads at once.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from circleops.errors import RuntimeRunError


@contextlib.contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Redirect fd 2 (C++ writes included) to a temp file; yields a list that receives the text."""
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode("utf-8", "replace").strip())


def _scalars_as_one(sess, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """onert takes no rank-0 inputs: target onert writes a 0-d input as [1] (lowering.program)."""
    infos = sess.get_inputs_tensorinfo()
    return [a.reshape(1) if a.ndim == 0 and i < len(infos) and info_shape(infos[i]) == (1,) else a
            for i, a in enumerate(inputs)]


def info_shape(info) -> tuple[int, ...]:
    return tuple(int(d) for d in info.dims[:info.rank])


def _check_inputs(path: str, sess, inputs: Sequence[np.ndarray]) -> None:
    infos = sess.get_inputs_tensorinfo()
    if len(infos) != len(inputs):
        raise RuntimeRunError(f"{path} takes {len(infos)} input(s), but {len(inputs)} were given")
    for i, (info, arr) in enumerate(zip(infos, inputs)):
        want = tuple(int(d) for d in info.dims[:info.rank])
        if tuple(arr.shape) != want or np.dtype(arr.dtype) != np.dtype(info.dtype):
            raise RuntimeRunError(
                f"{path}: input {i} must be {info.dtype}{list(want)}, got {arr.dtype}{list(arr.shape)}")


def run(path: str | os.PathLike, inputs: Sequence[np.ndarray], backends: str = "cpu") -> list[np.ndarray]:
    """Run the Circle file at ``path`` on ``inputs``; returns the outputs (copies)."""
    import onert  # heavy native library: loaded on first use

    path = str(Path(path))
    if not os.path.isfile(path):
        raise RuntimeRunError(f"cannot run {path}: no such file")
    if Path(path).suffix not in (".circle", ".tflite"):
        # onert picks its loader by the file extension ("Failed to open onert loader")
        with tempfile.TemporaryDirectory() as tmp:
            link = os.path.join(tmp, Path(path).name + ".circle")
            os.symlink(os.path.abspath(path), link)
            return run(link, inputs, backends)
    inputs = [np.ascontiguousarray(a) for a in inputs]
    failure: Exception | None = None
    outputs: list[np.ndarray] = []
    stage = "load"
    with captured_stderr() as text:
        try:
            sess = onert.infer.session(path, backends)
            inputs = _scalars_as_one(sess, inputs)
            _check_inputs(path, sess, inputs)
            stage = "prepare and run"
            outputs = [np.array(o, copy=True) for o in sess.infer(inputs)]
        except RuntimeRunError:
            raise
        except Exception as err:  # noqa: BLE001 - onert raises its own OnertError types
            failure = err
    message = text[0] if text else ""
    if failure is not None:
        reason = message or str(failure)
        raise RuntimeRunError(
            f"onert could not {stage} {path}: {reason} ({failure}). If an operator is "
            f"unsupported, convert with target='onert', which writes only what onert runs.") from failure
    if message:
        print(message, file=sys.stderr)  # onert's warnings on success are not swallowed
    return outputs
