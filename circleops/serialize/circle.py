"""Circle-specific write rules (file identifier CIR0, schema circle_schema 0.10)."""
from __future__ import annotations

from circleops.serialize.schema import FormatRules


def _deprecated_code(code: int) -> int:
    # Extended Circle ops (negative codes) carry the code in both fields: what tico writes
    # and what onert loads. Ordinary ops past int8 use the 127 placeholder, as in TFLite.
    return code if code < 0 else min(code, 127)


RULES = FormatRules(
    schema_name="circle",
    op_version=lambda name, version: version,
    deprecated_code=_deprecated_code,
    # Circle (ONE's luci) defines Buffer.offset/size; onert 0.1.0 crashes on it, but a file
    # past 2 GiB has no other layout, so it is written for target circle and refused for
    # target onert (circleops.pipeline.stages.write).
    reads_offset_buffers=True,
)
