"""fd 2 (C++ writes included) captured around a native call: onert's Python and C errors say
only a status code; the real message is printed by its core on stderr."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Iterator


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
