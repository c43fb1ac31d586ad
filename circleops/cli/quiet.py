"""What a dependency may print during a command: nothing, unless ``--verbose``.

Importing transformers imports torchao, which logs a "Failed to load ... .so" warning per
CUDA extension it cannot load on a CPU machine, and torch's pytree logs a "W1201 ... Enum
subclass" deprecation per torchao enum it registers. Neither is about the user's model, and
both came out of every ``circleops convert``. A command therefore runs with

- the ``logging`` module off below ERROR (``logging.disable``): torch, torchao, transformers
  and the rest log through it. circleops itself prints its messages, never logs them, so
  nothing of ours is lost. ``logging.disable`` is global, which matters because torch resets
  its own loggers' levels when it is imported, after this has been set up;
- Python warnings shown only when they are circleops' own (a warning class defined in
  circleops, or raised from a circleops source file).

Errors are untouched: a dependency's ERROR log line and every exception still show.
Both settings are restored when the command returns, so ``circleops.cli.main`` called in a
process (the tests, an embedding application) leaves that process as it was.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_circleops_warning(category: type[Warning], filename: str) -> bool:
    """A warning is ours when circleops defines its class or a circleops file raised it."""
    module = getattr(category, "__module__", "") or ""
    return (module == "circleops" or module.startswith("circleops.")
            or os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep))


@contextlib.contextmanager
def dependency_output(verbose: bool) -> Iterator[None]:
    """Run a command with dependencies' log lines and warnings hidden (``verbose=False``)
    or as they come (``verbose=True``)."""
    if verbose:
        yield
        return
    previous_disable = logging.root.manager.disable
    with warnings.catch_warnings():
        show = warnings.showwarning

        def show_ours(message, category, filename, lineno, file=None, line=None):
            if is_circleops_warning(category, filename):
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_ours
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(previous_disable)
