"""Token ids checked against the vocabulary before a runtime sees them.

A graph's embedding lookup (GATHER) reads row ``id`` of its table: onert and LiteRT do not
bound-check it, so an id past the vocabulary (or a negative one) reads outside the table —
SIGSEGV, or silently garbage. Ids reach the graphs from the command line (``--token-ids``),
the tokenizer (a tokenizer.json may map a piece to any id), the chat template, the manifest
(pad, eos, a VLM's image token, Whisper's start / forced / suppressed tokens) and sampling;
each path calls :func:`check_token_ids`, the one check, with the vocabulary size the
manifest gives (itself checked against the graph's logits when the graphs are opened).
"""
from __future__ import annotations

import operator
from typing import Any, Iterable

from circleops.errors import CircleOpsError, ModelLoadError


def _as_int(value: Any) -> int | None:
    """``value`` as an int when it is an integer (Python, numpy, a 0-d integer tensor: what
    ``operator.index`` takes; not a bool, not a float), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_token_ids(ids: Iterable[Any], vocab_size: int, what: str, *, fix: str = "",
                    error: type[CircleOpsError] = ModelLoadError) -> list[int]:
    """``ids`` as a list of ints, each in ``0 <= id < vocab_size``; otherwise ``error``
    naming ``what`` holds them, the offending ids and the vocabulary, followed by ``fix``."""
    ids = list(ids)
    out: list[int] = []
    bad: list[str] = []
    for value in ids:
        i = _as_int(value)
        if i is None or not 0 <= i < vocab_size:
            bad.append(repr(value) if i is None else str(i))
        else:
            out.append(i)
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise error(f"{what}: token id{'s' if len(bad) > 1 else ''} {shown} outside the model's vocabulary of "
                    f"{vocab_size} tokens (ids 0 to {vocab_size - 1}); a runtime would read outside its embedding "
                    f"table.{' ' + fix if fix else ''}")
    return out
