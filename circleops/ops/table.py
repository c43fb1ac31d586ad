"""The op registry as a table (what ``circleops ops`` prints): the built-ins of
schema/ops.yaml, then users' and plugins' ops (plugins are loaded first).

One row per op: name, Circle form (builtin and code, or CUSTOM and its custom_code) and
options, TFLite form (composite name, or CUSTOM), how each target profile writes the op,
the autocast rule, who provides it, and the torch schema.
"""
from __future__ import annotations

from circleops.errors import CircleOpsError

COLUMNS = ("op", "circle builtin", "circle options", "tflite composite", "targets", "autocast", "provider",
           "torch schema")


def _circle(spec) -> tuple[str, str]:
    c = spec.circle
    if c["form"] == "builtin":
        return f"{c['builtin']} ({c['code']})", c.get("options") or "-"
    if c["form"] == "custom":
        return f"CUSTOM {c['custom_code']!r}", "flexbuffer {" + ", ".join(spec.attribute_args) + "}"
    return "decomposed", "-"


def _tflite(spec) -> str:
    t = spec.tflite
    if t["form"] == "composite":
        return t["composite"]
    return f"CUSTOM {t['custom_code']!r}" if t["form"] == "custom" else "decomposed"


def rows(names: list[str] | None = None) -> list[dict[str, str]]:
    """The table's rows, one dict per op (keys = COLUMNS), in registry order."""
    from circleops.ops import REGISTRY, load_plugins, lookup

    load_plugins()
    wanted = [lookup(n) for n in names or ()]
    unknown = [n for n, spec in zip(names or (), wanted) if spec is None]
    if unknown:
        raise CircleOpsError(f"unknown op(s) {', '.join(unknown)}; the registry has {', '.join(REGISTRY)}. "
                             "Run `circleops ops` without arguments to list them all.")
    out = []
    for spec in REGISTRY.values():
        if names and spec not in wanted:
            continue
        circle, options = _circle(spec)
        out.append({
            "op": spec.qualname,
            "circle builtin": circle,
            "circle options": options,
            "tflite composite": _tflite(spec),
            "targets": ", ".join(f"{t}: {how}" for t, how in spec.targets.items()),
            "autocast": spec.autocast,
            "provider": spec.provider,
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
