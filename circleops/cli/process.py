"""How the ``circleops`` process ends: SIGTERM as an exception (cleanups run), a reader
that left a pipe, and leaving without the interpreter's teardown."""
from __future__ import annotations

import os
import signal
import sys


def exit_without_teardown(code: int) -> None:
    """End the console script without the interpreter's teardown: freeing the ~4000 modules
    torch and transformers load takes ~1 s, a fifth of a whole conversion. atexit handlers
    (tempfile and logging cleanup) still run; the command has closed its files."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


class Terminated(BaseException):
    """SIGTERM arrived: unwinds like KeyboardInterrupt (cleanups run), exit status 143."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated()


def install_sigterm() -> object:
    """SIGTERM raises Terminated in the main thread from now on; returns the handler it replaced."""
    try:
        return signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (an embedding application): leave it alone
        return None


def restore_sigterm(previous: object) -> None:
    """Put back the SIGTERM handler install_sigterm replaced."""
    if previous is not None:
        try:
            signal.signal(signal.SIGTERM, previous)
        except (ValueError, TypeError):
            pass


def silence_stdout() -> None:
    """Point fd 1 at /dev/null (the reader of a pipe left): the final flush cannot fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def one_line(err: BaseException, limit: int = 300) -> str:
    """An error's message on one line, at most ``limit`` characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
