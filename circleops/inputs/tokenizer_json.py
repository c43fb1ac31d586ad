"""What a saved tokenizer.json may ask of the ``tokenizers`` library that no released tokenizer
does, checked before the library runs it on a prompt."""
from __future__ import annotations

from typing import Any

# No released tokenizer's normalizer lengthens a text more than a few times (NFKC's widest
# expansions, a Replace of one mark by another, a Prepend); a Replace of "h" by 100000 h's
# turned a 100-character prompt into 10 M characters and a 1.7 GB allocation in the Rust library.
MAX_NORMALIZER_GROWTH = 64


def normalizer_growth(spec: Any) -> float:
    """How many characters one character of text can become, at most, through the normalizer
    ``spec`` of a tokenizer.json (a Sequence multiplies its parts' growth; a Replace grows by
    its content over its pattern, by 1 + its content for a regex, which may match empty)."""
    if not isinstance(spec, dict):
        return 1.0
    kind = spec.get("type")
    if kind == "Sequence":
        growth = 1.0
        for part in spec.get("normalizers") or []:
            growth *= normalizer_growth(part)
        return growth
    if kind == "Replace":
        content, pattern = spec.get("content"), spec.get("pattern")
        size = len(content) if isinstance(content, str) else 0
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(literal, str) and literal:
            return max(1.0, size / len(literal))
        return 1.0 + size
    return 1.0


__all__ = ["MAX_NORMALIZER_GROWTH", "normalizer_growth"]
