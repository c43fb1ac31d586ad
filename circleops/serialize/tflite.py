"""TFLite-specific write rules (file identifier TFL3, schema version 3, LiteRT 2.3.0)."""
from __future__ import annotations

from circleops.serialize.schema import FormatRules

# Lowest OperatorCode.version LiteRT accepts for an op, where version 1 is refused
# (measured with ai-edge-litert 2.3.0: "Didn't find op for builtin opcode ... version 1").
MIN_VERSION: dict[str, int] = {
    "BROADCAST_TO": 2,
}


def _op_version(name: str, version: int) -> int:
    return max(version, MIN_VERSION.get(name, 1))


RULES = FormatRules(
    schema_name="tflite",
    op_version=_op_version,
    deprecated_code=lambda code: min(code, 127),
    reads_offset_buffers=True,
)
