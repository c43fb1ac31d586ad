"""What the tests that run a guide block by block share (docs/tasks.md, vlm.md, speech.md):
the guide's fenced blocks, and one `circleops ...` command line run in this process."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from circleops.cli import main


def blocks(doc: Path) -> list[tuple[str, str]]:
    """The (language, code) of every fenced block of ``doc``, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w+)\n(.*?)^```$", doc.read_text(), re.M | re.S)]


def run_cli(command: str) -> tuple[int, str, str]:
    """Run ``circleops ARGS`` through circleops.cli.main: exit code (argparse's too), stdout, stderr."""
    argv = shlex.split(command)
    assert argv[0] == "circleops", command
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv[1:])
        except SystemExit as exit_:  # argparse
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()
