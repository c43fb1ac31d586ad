"""A fresh Python interpreter as a runtime's child process (circleops.runtime.isolated).

A forked child shares the parent's pages, and its resident set counts them: a 1B-class
convert reaches its verify holding ~1 GB (torch, the reference logits), which the LiteRT
child's peak carried on top of the file's packed weights (issue 32). A fresh interpreter
(``python -m circleops.runtime.fresh_child FD``) starts with none of that; it imports circleops
from where the parent found it and serves the pipe it is given, as a forked child does.

    proc = start(child_conn, {"CIRCLEOPS_XNNPACK_CACHE": "/tmp/..."})   # a subprocess.Popen
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def start(conn: Any, env: dict[str, str]) -> subprocess.Popen:
    """A fresh interpreter serving ``conn`` (a multiprocessing Connection end, passed by its
    descriptor; the caller closes its own copy), with ``env`` over this process's environment
    and this process's import path (so it runs the same circleops)."""
    path = [p for p in sys.path if p]
    child_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join(path)}
    fd = conn.fileno()
    return subprocess.Popen([sys.executable, "-m", "circleops.runtime.fresh_child", str(fd)], env=child_env,
                            pass_fds=(fd,), stdin=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    """Serve the connection on descriptor ``argv[0]`` until the parent closes it."""
    from multiprocessing.connection import Connection

    from circleops.runtime.isolated import _serve

    _serve(Connection(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
