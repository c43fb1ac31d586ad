"""``circleops run FILE --input x.npy ...``: run a Circle or TFLite file on .npy inputs.

A file converted for a task (``circleops convert DIR``, circleops.recipes.tasks) also runs on ``--image``,
``--text`` or ``--audio`` through the model's saved processor, and prints labels (``--top``).

The reference interpreter (pure torch, every op circleops writes) is the default runtime;
``--runtime onert`` or ``--runtime litert`` run the file in a real runtime instead, and
``--compare`` runs a second runtime and reports the largest difference per output.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from circleops.errors import OutputError, RuntimeRunError
from circleops.inputs.user_files import load_npy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from circleops.runtime import RUNTIMES  # standard library only

    parser.add_argument("file", help="the .circle or .tflite file")
    parser.add_argument("--input", "-i", action="append", nargs="+", default=[], metavar="NPY",
                        help="input arrays as .npy files, in the model's input order (repeat or list several)")
    parser.add_argument("--output-dir", "-o", metavar="DIR",
                        help="write each output as DIR/output_<i>.npy (default: only print a summary)")
    parser.add_argument("--runtime", choices=RUNTIMES, default="reference",
                        help="reference: circleops' torch interpreter (default); onert: the ONE runtime "
                             "(Circle files); litert: LiteRT (TFLite files)")
    parser.add_argument("--signature", metavar="KEY", help="run this signature instead of the main subgraph")
    parser.add_argument("--compare", choices=RUNTIMES, metavar="RUNTIME",
                        help="also run on RUNTIME and print the max abs difference per output")
    parser.add_argument("--image", metavar="PATH", help="a task model's input from this image (its processor)")
    parser.add_argument("--text", metavar="TEXT", help="a task model's input from this text (its tokenizer)")
    parser.add_argument("--audio", metavar="WAV", help="a task model's input from this WAV file (its feature extractor)")
    parser.add_argument("--model", metavar="DIR", help="with --image/--text/--audio: the model directory with the "
                        "processor (default: the one recorded in the file when it was converted)")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="labels to print for a classifier (default 5)")


def _load_inputs(paths: Sequence[str]) -> list[np.ndarray]:
    arrays = []
    for p in paths:
        if not os.path.isfile(p):
            raise RuntimeRunError(f"input file {p!r} does not exist; give one .npy file per model input")
        arrays.append(load_npy(p, error=RuntimeRunError))  # size checked against the file; no pickles
    return arrays


def _summary(a: np.ndarray) -> str:
    if a.size == 0:
        return ""
    try:
        f = a.astype(np.float64)  # also bf16 (ml_dtypes)
    except (TypeError, ValueError):
        return ""
    finite = np.isfinite(f)
    text = f"min {f[finite].min():.6g} max {f[finite].max():.6g} mean {f[finite].mean():.6g}" if finite.any() else ""
    if not finite.all():
        text += f" non-finite {int((~finite).sum())}"
    return text


def main(args: argparse.Namespace) -> int:
    from circleops.runtime import open_session, runtime_module

    path = args.file
    if not os.path.isfile(path):
        raise RuntimeRunError(f"model file {path!r} does not exist; give the path of a .circle or .tflite file")
    out_dir = _output_dir(args.output_dir)  # before the run: a wrong -o fails in a second, not after it
    prepared = _task_inputs(args, path)
    inputs = prepared.inputs if prepared else _load_inputs([p for group in args.input for p in group])
    runtime_module(args.runtime)  # imported before the clock starts: the time is the run's
    t0 = time.perf_counter()
    session = open_session(args.runtime, path, args.signature, isolated=True)
    outputs = [np.asarray(o) for o in session.run(inputs)]
    seconds = time.perf_counter() - t0
    names = [spec.name for spec in session.outputs]
    print(f"{path}: {len(outputs)} outputs from {args.runtime} in {seconds * 1e3:.1f} ms (file read included)")
    others = None
    if args.compare:
        others = [np.asarray(o) for o in open_session(args.compare, path, args.signature, isolated=True).run(inputs)]
    for i, a in enumerate(outputs):
        name = names[i] if i < len(names) and names[i] else f"output_{i}"
        line = f"  [{i}] {name}: {a.dtype} {list(a.shape)} {_summary(a)}"
        if others is not None:
            b = others[i]
            if b.shape != a.shape:
                line += f" | {args.compare}: shape {list(b.shape)} differs"
            else:
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                line += f" | max abs diff vs {args.compare}: {np.nanmax(diff) if diff.size else 0.0:.3g}"
        print(line)
        if out_dir is not None:
            np.save(out_dir / f"output_{i}.npy", a)
    if out_dir is not None:
        print(f"wrote {len(outputs)} arrays to {out_dir}/output_<i>.npy")
    if prepared:
        from circleops.recipes.task_io import describe

        print("\n".join(describe(prepared, outputs, args.top)))
    return 0


def _output_dir(name: str | None) -> Path | None:
    """-o DIR, made if missing; OutputError when it is a file or cannot be made."""
    if not name:
        return None
    out = Path(name)
    if out.exists() and not out.is_dir():
        raise OutputError(f"-o {name}: it is a file, and -o names a directory to write output_<i>.npy into. Pass "
                          f"a directory (it is made if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputError(f"-o {name}: cannot make the directory ({err.strerror or err}).") from None
    return out


def _task_inputs(args: argparse.Namespace, path: str):
    """--image / --text / --audio: inputs through the processor of the model the file records."""
    if args.image is None and args.text is None and args.audio is None:
        return None
    from circleops.recipes.task_io import prepare
    from circleops.recipes.tasks import read_task_record

    if args.input:
        raise RuntimeRunError("give the inputs either as .npy files (--input) or from --image/--text/--audio.")
    record = read_task_record(path)
    if record is None:
        raise RuntimeRunError(f"{path} records no task (it was not converted by `circleops convert` from a Hugging "
                              "Face model directory): give its inputs as .npy files with --input.")
    return prepare(record, image=args.image, text=args.text, audio=args.audio, model_dir=args.model)
