"""The held-out SELECTION text (``selection.txt``): the text measured choices of a recipe are made on.

Three shipped texts, three jobs: ``calibration.txt`` is what rounding fits (importances, GPTQ),
``perplexity.txt`` is what `circleops check` scores, and ``selection.txt`` (Python Language
Reference prose, PSF license; its header says where from) is what a recipe's measured choices
read, e.g. which int4 linears stay int8 (bench/int4_down.py). A choice made on the scored text
would tune the reported perplexity to its test.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

SELECTION_TEXT = Path(__file__).with_name("selection.txt")


def selection_text(path: Path | None = None) -> str:
    """The text without its header (the leading lines starting with "# " and the empty line after)."""
    lines = (path or SELECTION_TEXT).read_text().splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("# "):
        start += 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    return "".join(lines[start:])


def selection_ids(tokenizer: Any, vocab: int, path: Path | None = None) -> list[int]:
    """The selection text as token ids; without a tokenizer its UTF-8 bytes modulo ``vocab``."""
    text = selection_text(path)
    if tokenizer is not None:
        return list(tokenizer(text).input_ids)
    return [b % vocab for b in text.encode()]
