"""The held-out SELECTION text (circleops.quantize.selection): what a recipe's measured choices
read, apart from the calibration text (what rounding fits) and the scored perplexity text."""
from __future__ import annotations

from circleops.quantize import selection
from circleops.quantize.importance import CALIBRATION_TEXT
from circleops.tools.quant_report import PERPLEXITY_TEXT


def test_selection_text_is_held_out():
    """Its header (source, license) dropped, prose left, and no sentence of it in the
    calibration text or the scored text."""
    raw = selection.SELECTION_TEXT.read_text()
    assert "License:" in raw and "Source:" in raw and raw.startswith("# ")
    text = selection.selection_text()
    assert not text.startswith("#") and "License" not in text and len(text.split()) > 2000
    others = CALIBRATION_TEXT.read_text() + PERPLEXITY_TEXT.read_text()
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 40]
    assert len(sentences) > 100 and not [s for s in sentences if s in others]


def test_selection_ids_read_the_file(tmp_path):
    """Token ids of the text after the header (UTF-8 bytes modulo the vocabulary without a
    tokenizer, as the calibration reads its text); another file, other ids."""
    other = tmp_path / "t.txt"
    other.write_text("# a header line\n# another\n\nZebras graze.\n")
    assert selection.selection_text(other) == "Zebras graze.\n"
    assert selection.selection_ids(None, 50, other) == [b % 50 for b in b"Zebras graze.\n"]

    class Tok:
        def __call__(self, text: str):
            return type("Enc", (), {"input_ids": [len(w) for w in text.split()]})()

    assert selection.selection_ids(Tok(), 50, other) == [6, 6]
    assert selection.selection_ids(None, 256) == list(selection.selection_text().encode())
