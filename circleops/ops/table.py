"""The fused-op registry as a table (what ``circleops ops`` prints), read from schema/ops.yaml.

One row per op: name, Circle builtin (code) and options table, TFLite composite name,
how each target profile writes the op, the autocast rule, and the torch schema.
"""
from __future__ import annotations

from circleops.errors import CircleOpsError

COLUMNS = ("op", "circle builtin", "circle options", "tflite composite", "targets", "autocast", "torch schema")


def rows(names: list[str] | None = None) -> list[dict[str, str]]:
    """The table's rows, one dict per op (keys = COLUMNS), in registry order."""
    from circleops.ops import REGISTRY

    unknown = [n for n in names or () if n not in REGISTRY]
    if unknown:
        raise CircleOpsError(f"unknown op(s) {', '.join(unknown)}; the registry has {', '.join(REGISTRY)}. "
                             "Run `circleops ops` without arguments to list them all.")
    out = []
    for name, spec in REGISTRY.items():
        if names and name not in names:
            continue
        out.append({
            "op": f"circle::{name}",
            "circle builtin": f"{spec.circle['builtin']} ({spec.circle['code']})",
            "circle options": spec.circle.get("options") or "-",
            "tflite composite": spec.tflite["composite"],
            "targets": ", ".join(f"{t}: {how}" for t, how in spec.targets.items()),
            "autocast": spec.autocast,
            "torch schema": spec.schema,
        })
    return out


def format_table(table: list[dict[str, str]]) -> str:
    """Aligned plain-text columns; the (long) schema is the last column so nothing wraps mid-row."""
    widths = {c: max(len(c), *(len(r[c]) for r in table)) for c in COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in COLUMNS).rstrip(),
             "  ".join("-" * widths[c] for c in COLUMNS)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in COLUMNS).rstrip() for r in table]
    return "\n".join(lines)


def format_markdown(table: list[dict[str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) if c != "torch schema" else f"`{cell(r[c])}`" for c in COLUMNS) + " |"
              for r in table]
    return "\n".join(lines)
