"""A fresh Python interpreter as a runtime's child process (circleops.runtime.isolated).

A forked child shares the parent's pages, and its resident set counts them: a 1B-class
convert reaches its verify holding ~1 GB (torch, the reference logits), which the LiteRT
child's peak carried on top of the file's packed weights (issue 32). A fresh interpreter
(``python -m circleops.runtime.fresh_child FD``, started by circleops.runtime.isolated) begins
with none of that; it imports circleops from where the parent found it and serves the pipe
whose descriptor it is given, as a forked child does.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Serve the connection on descriptor ``argv[0]`` until the parent closes it."""
    from multiprocessing.connection import Connection

    from circleops.runtime.isolated import serve

    serve(Connection(int(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
