"""Flatbuffer writers and reader: ir.Model <-> .circle / .tflite.

``write_model(model, path, fmt)`` writes Circle ("circle", identifier CIR0) or TFLite
("tflite", TFL3) atomically and deterministically, streaming the weights from the model's
memory; ``read_model(path)`` reads any Circle or TFLite file back into an ir.Model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from circleops.serialize.writer import WriteInfo, write_model
    from circleops.serialize.reader import read_model

__all__ = ["WriteInfo", "write_model", "read_model"]


def __getattr__(name: str):
    # Lazy: `import circleops.serialize` stays cheap (no flatbuffers / schema imports).
    if name in ("WriteInfo", "write_model"):
        from circleops.serialize import writer

        return getattr(writer, name)
    if name == "read_model":
        from circleops.serialize import reader

        return reader.read_model
    raise AttributeError(name)
