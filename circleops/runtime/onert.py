"""Run a Circle file with onert (the ONE runtime's CPU backend).

    session = Session("model.circle")     # loaded and prepared once
    logits, = session.run([ids])          # as often as needed
    outputs = run("model.circle", [ids])  # one run

onert's Python errors say only ``NNFW_STATUS_ERROR``; the real reason ("Unsupported
operation: MIRROR_PAD", "KernelGenerator: NYI for operation 'InstanceNorm'", ...) is
printed by its C++ core on file descriptor 2. A session captures fd 2 around preparing
and running and raises RuntimeRunError with that text.

fd 2 is process-wide: do not run sessions from several threads at once.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from circleops.errors import RuntimeRunError
from circleops.runtime import TensorSpec
from circleops.runtime.inputs import check_inputs
from circleops.runtime.isolated import note_in_process
from circleops.serialize.integrity import check_file


from circleops.runtime.stderr import captured_stderr  # noqa: E402 - re-exported: onert's words on fd 2


_HINT = "If an operator is unsupported, convert with target='onert', which writes only what onert runs."


class Session:
    """One onert session on a Circle file, prepared once and run many times.

    onert's Python API runs subgraph 0 of a file and cannot select a signature: a
    ``signature`` is run through onert's C API where the installed onert has it (0.2.0.dev:
    circleops.runtime.onert_c.SignatureSession, which this returns then), and refused on
    0.1.0. nnfw's set_input binds the array's memory (no copy), so the
    bound inputs are kept alive until the next run; each output is a fresh array (onert
    allocates its outputs), which the caller may pass straight back in as the next input.
    """

    def __new__(cls, path: str | os.PathLike, signature: str | None = None, backends: str = "cpu") -> Any:
        if signature is None:
            return super().__new__(cls)
        from circleops.runtime import onert_c

        if not onert_c.available():
            raise RuntimeRunError(f"onert cannot select signature {signature!r} of {path}: onert 0.1.0 runs only "
                                  f"subgraph 0 of a file (onert 0.2.0.dev's C API can: pip install "
                                  f"circleops[onert-signatures]). Convert with --target onert for one file per graph, "
                                  f"or run the signature with --runtime reference.")
        _checked(str(Path(path)))
        if Path(path).suffix != ".circle":
            raise RuntimeRunError(f"onert picks its loader by the file extension: {path} must end in .circle.")
        return onert_c.SignatureSession(str(Path(path)), signature, backends=backends)

    def __init__(self, path: str | os.PathLike, signature: str | None = None, backends: str = "cpu"):
        self.path = str(Path(path))
        self.signature = signature
        _checked(self.path)
        self._link_dir: tempfile.TemporaryDirectory | None = None  # removed with the session
        load_path = self.path
        if Path(self.path).suffix not in (".circle", ".tflite"):
            # onert picks its loader by the file extension ("Failed to open onert loader")
            self._link_dir = tempfile.TemporaryDirectory()
            load_path = os.path.join(self._link_dir.name, Path(self.path).name + ".circle")
            os.symlink(os.path.abspath(self.path), load_path)
        from onert.native.libnnfw_api_pybind import infer, prepare_config  # heavy: loaded on first use

        failure: Exception | None = None
        with captured_stderr() as text:
            try:
                from circleops.runtime.onert_c import weights_mapped

                with weights_mapped():  # the weights stay pages of the file, not a heap copy
                    self._session = infer.nnfw_session(load_path, backends)
                    self._session.set_prepare_config(prepare_config.ENABLE_INTERNAL_OUTPUT_ALLOC)
                    self._session.prepare()
            except Exception as err:  # noqa: BLE001 - onert raises its own OnertError types
                failure = err
        _raise_or_echo(failure, text, "load", self.path)
        self._inputs = [_spec(self._session.input_tensorinfo(i)) for i in range(self._session.input_size())]
        self._n_outputs = self._session.output_size()
        self._names: tuple[list[str], list[str]] | None = None
        self._bound: Sequence[np.ndarray] = ()

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._named(self._inputs, 0)

    @property
    def outputs(self) -> list[TensorSpec]:
        specs = [_spec(self._session.output_tensorinfo(i)) for i in range(self._n_outputs)]
        return self._named(specs, 1)

    def _named(self, specs: list[TensorSpec], which: int) -> list[TensorSpec]:
        if self._names is None:  # onert does not know tensor names: the file does
            self._names = _io_names(self.path)
        names = self._names[which]
        return [TensorSpec(names[i] if i < len(names) else s.name, s.shape, s.dtype) for i, s in enumerate(specs)]

    def run(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run on ``inputs`` (numpy arrays in the file's input order, dtype and shape as
        :attr:`inputs` says); returns the outputs in the file's order."""
        arrays = [np.asarray(a) for a in inputs]
        try:
            check_inputs(self._inputs, arrays, self.path)
        except RuntimeRunError:  # again with the names, which cost a read of the file
            check_inputs(self.inputs, arrays, self.path)
            raise
        # onert takes no rank-0 inputs (target onert writes a 0-d input as [1]); not
        # np.ascontiguousarray: it would turn a 0-d input into shape (1,) silently
        arrays = [a.reshape(spec.shape) if a.ndim == 0 else a if a.flags.c_contiguous else np.array(a, order="C")
                  for spec, a in zip(self._inputs, arrays)]
        failure: Exception | None = None
        outputs: list[np.ndarray] = []
        with captured_stderr() as text:
            try:
                for i, arr in enumerate(arrays):
                    self._session.set_input(i, arr)
                self._bound = arrays  # set_input keeps only a pointer
                self._session.run()
                outputs = [self._session.get_output(i) for i in range(self._n_outputs)]
            except Exception as err:  # noqa: BLE001
                failure = err
        _raise_or_echo(failure, text, "run", self.path)
        return outputs


def _checked(path: str) -> None:
    """The checks before onert reads ``path``: it exists, it is a well-formed flatbuffer (onert
    reads it unchecked: a damaged or hostile file would make it read out of bounds in
    this process, issue 24), this CPU runs its weights, and no weight follows the flatbuffer."""
    if not os.path.isfile(path):
        raise RuntimeRunError(f"cannot run {path}: no such file")
    checked = check_file(path)
    note_in_process("onert")  # later isolated sessions must not fork from here
    _check_host(path, checked.tensor_types)
    if checked.offset_buffers:
        raise RuntimeRunError(
            f"onert cannot load {path}: {checked.offset_buffers} of its buffers keep their weights after the "
            f"flatbuffer (Buffer.offset/size), and onert 0.1.0 crashes (SIGSEGV) on such files. Run it with "
            f"--runtime reference, or convert it again with circleops (--target onert writes weights inline).")


def _check_host(path: str, types: frozenset[str]) -> None:
    """HostCPUError before onert loads a file whose GGML weights this CPU cannot run: onert
    would kill the process with SIGILL at the first run (circleops.runtime.host)."""
    from circleops import ir
    from circleops.errors import HostCPUError
    from circleops.runtime.host import onert_ggml_refusal

    refusal = onert_ggml_refusal(path, {t for t in types if t in ir.GGML_BLOCKS})
    if refusal:
        raise HostCPUError(refusal)
    refusal = integer_refusal(path, types)
    if refusal:
        raise RuntimeRunError(refusal)


# what onert 0.1.0 does not run in an integer graph (measured, bench/onert_quantized.py)
ONERT_INTEGER_TYPES = frozenset({"UINT8", "INT8", "INT32"})
ONERT_NO_UINT8_KERNEL = frozenset({"RMS_NORM", "BATCH_MATMUL", "STRIDED_SLICE", "ATTENTION"})


# A quantized tensor has one of these types (its int32 biases come with them): a file with
# none of them is float (or GGML) and needs no full read to be cleared.
_QUANTIZED_TYPES = frozenset({"UINT8", "INT8", "INT16", "INT4", "UINT4"})


def integer_refusal(path: str, types: frozenset[str] | None = None) -> str | None:
    """Why onert 0.1.0 cannot run the integer graph in ``path`` (int16 / int4 tensors, a
    quantized op it has no kernel for), naming the runtime that can; None when it can.
    ``types``: the file's tensor types when known (the integrity check's): a float file is
    then cleared without decoding every table (seconds on a 1B model's file)."""
    from circleops.errors import CircleOpsError
    from circleops.serialize import read_model

    if types is not None and not types & _QUANTIZED_TYPES:
        return None
    try:
        sg = read_model(path).subgraphs[0]
    except CircleOpsError:
        return None  # not a readable file: onert's own load error says so
    wide = sorted({t.dtype for t in sg.tensors if t.quant is not None and t.dtype not in ONERT_INTEGER_TYPES})
    ops = sorted({op.opcode for op in sg.operators if op.opcode in ONERT_NO_UINT8_KERNEL
                  and any(i >= 0 and sg.tensors[i].quant is not None for i in op.inputs)})
    if not wide and not ops:
        return None
    what = (f"{', '.join(wide)} tensors (onert loads no int16 or int4 graph)" if wide else "") + \
        ("; " if wide and ops else "") + (f"quantized {', '.join(ops)} (no onert kernel for them)" if ops else "")
    return (f"onert 0.1.0 cannot run {path}: it holds {what}, measured in bench/README.md. Run it with the reference "
            "interpreter (--runtime reference), or convert with --quantize uint8 --target onert (those ops stay "
            "float there)")


def _spec(info: Any) -> TensorSpec:
    return TensorSpec("", tuple(int(d) for d in info.dims[:info.rank]), np.dtype(info.dtype).name)


def _raise_or_echo(failure: Exception | None, text: list[str], stage: str, path: str) -> None:
    """RuntimeRunError with onert's own words for a failure; its warnings on success are not swallowed."""
    message = text[0] if text else ""
    if failure is not None:
        raise RuntimeRunError(f"onert could not {stage} {path}: {message or failure} ({failure}). {_HINT}") from failure
    if text:
        # onert's own words: a dependency's line, shown by the logging module (the CLI shows
        # dependencies' log lines only with --verbose: circleops/cli/quiet.py)
        logging.getLogger("onert").warning("\n".join(text))


def _io_names(path: str) -> tuple[list[str], list[str]]:
    """Input and output tensor names of subgraph 0 (best effort: empty when unreadable)."""
    try:
        from circleops.serialize.reader import io_names

        return io_names(path)
    except Exception:  # noqa: BLE001 - names are cosmetic
        return [], []


def run(path: str | os.PathLike, inputs: Sequence[np.ndarray], backends: str = "cpu") -> list[np.ndarray]:
    """Run the Circle file at ``path`` on ``inputs`` once; returns the outputs (copies)."""
    return [np.array(o, copy=True) for o in Session(path, backends=backends).run(inputs)]
