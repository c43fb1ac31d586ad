"""What several subcommands share: the progress bar, writable-path checks, quiet model loading.

Standard library only at import time (``circleops CMD --help`` must stay instant).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator


class ProgressBar:
    """A tqdm bar over a command's stages, on stderr, only when ``enabled`` (an interactive terminal)."""

    def __init__(self, stages: list[str], enabled: bool):
        self.bar = None
        self.stages = stages
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=len(stages), file=sys.stderr, unit="stage", leave=False,
                            bar_format="{desc:<18} {bar} {n_fmt}/{total_fmt} [{elapsed}]")
        self.done = 0

    def __call__(self, stage: str) -> None:
        if self.bar is None:
            return
        if stage in self.stages:
            idx = self.stages.index(stage)
            self.bar.update(idx - self.bar.n)
        self.bar.set_description_str(f"circleops: {stage}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.update(self.bar.total - self.bar.n)
            self.bar.close()


def convert_stages(model: str | None, fuse: str, quantize: bool, verify: bool) -> list[str]:
    """The stages ``circleops convert`` goes through, in order (the progress bar's steps)."""
    exported_input = model is not None and Path(model).suffix.lower() in (".pt2", ".pt", ".ep")
    stages = ["load"] + ([] if exported_input else ["export"])
    stages += ["fuse"] if fuse in ("auto", "patterns") else []
    return stages + ["lower"] + (["quantize"] if quantize else []) + ["write"] + (["verify"] if verify else [])


def _names_torchao(source: str | None) -> bool:
    """Whether SOURCE's config (an HF directory's config.json, or a config file) names torchao."""
    config = Path(source) / "config.json" if source and Path(source).is_dir() else Path(source or "-")
    try:
        return config.suffix == ".json" and b"torchao" in config.read_bytes()
    except OSError:
        return False


@contextlib.contextmanager
def scipy_hidden(*sources: str | None) -> Iterator[None]:
    """While transformers is first imported here, scipy (its object-detection losses, ~0.4 s) and
    torchao (its quantizer, ~1.5 s of CPU), which a conversion never uses, look absent to it;
    torchao not when a SOURCE's config names it (a torchao checkpoint). circleops' own torchao
    use (PT2E) imports it afterwards as usual."""
    hidden = [n for n in ("scipy", "torchao") if n not in sys.modules] if "transformers" not in sys.modules else []
    hidden = [n for n in hidden if n != "torchao" or not any(map(_names_torchao, sources))]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # find_spec(name) -> None
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def write_report(report, path: str | None) -> None:
    """``--report JSON``: the conversion report as JSON (an OutputError if it cannot be written)."""
    if not path:
        return
    try:
        report.to_json(path)
    except OSError as err:
        from circleops.errors import OutputError

        raise OutputError(f"cannot write the report {path}: {err.strerror}.") from None


def finish_graphs(report, args, summary: str | None = None) -> int:
    """The end of a ``convert --graphs`` command: ``--report JSON`` written (an OutputError if it
    cannot be), the summary (``summary`` or the report's own) printed unless ``--quiet``; 0."""
    if args.report:
        import json

        try:
            Path(args.report).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        except OSError as err:
            from circleops.errors import OutputError

            raise OutputError(f"cannot write the report {args.report}: {err.strerror}.") from None
    if not args.quiet:
        print(summary if summary is not None else report.summary())
    return 0


def writable(path: Path) -> bool:
    """Whether a file can be created at ``path``: its directory exists and is writable, and the
    path is not a directory (checked before the slow work, so a bad path fails at once)."""
    parent = path.parent if str(path.parent) else Path(".")
    return not path.is_dir() and parent.is_dir() and os.access(parent, os.W_OK)


def one_length(text: str | None, source: str | None) -> int | None:
    """``--seq-len`` without ``--graphs``: one sequence length, at least 1 (a list is for
    --graphs only)."""
    from circleops.errors import TargetError

    if text is None:
        return None
    try:
        length = int(text)
    except ValueError:
        raise TargetError(f"--seq-len takes one length (several, comma-separated, only with --graphs: one prefill "
                          f"graph each); got {text!r}.") from None
    if length < 1:
        from circleops.sources.models import check_seq_len

        check_seq_len(length, None, source)
    return length
