"""``circleops inspect FILE``: what a Circle or TFLite file holds.

Op histogram, inputs and outputs with shapes and dtypes, constant tensors and bytes by
dtype, subgraphs, signatures, composites (name, attributes, decomposition subgraph) and
CUSTOM ops (custom_code, custom_options decoded from their flexbuffer map).
Works on any Circle or TFLite file; ``--json`` prints the same as one JSON object.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any


def json_default(value: Any) -> Any:
    """``json.dumps(summary, default=json_default)``: numpy scalars, bytes and the rest as text."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _custom_options(raw: Any) -> dict[str, Any] | str:
    """A CUSTOM op's custom_options: the flexbuffer map circleops writes (and most NPU
    toolchains do), else a note of how many opaque bytes they are."""
    from circleops.serialize.composite import decode_attributes

    if not raw:
        return {}
    try:
        return decode_attributes(raw)
    except Exception:  # noqa: BLE001 - another writer's raw bytes are not an error
        return f"{len(raw)} bytes, not a flexbuffer map"


def _layout(path: Path, fmt: str) -> dict[str, int]:
    """How many buffers hold data inline and how many after the flatbuffer (offset/size)."""
    import mmap

    from circleops.serialize.schema import get_schema

    schema = get_schema(fmt)
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    root = schema.reader_cls("Model").GetRootAs(buf, 0)
    inline = offset = 0
    for i in range(root.BuffersLength()):
        b = root.Buffers(i)
        if b.DataLength() > 0:
            inline += 1
        elif b.Offset() > 1 and b.Size() > 0:
            offset += 1
    return {"inline": inline, "offset": offset}


def _tensor_info(t) -> dict[str, Any]:
    info = {"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
    if t.quant is not None:
        info["quantization"] = _quant_info(t)
    return info


def _quant_info(t) -> str | None:
    """How a constant is quantized: GGML blocks, or its QuantizationParameters."""
    from circleops import ir

    if t.dtype in ir.GGML_BLOCKS:
        per_block, block_bytes = ir.GGML_BLOCKS[t.dtype]
        return f"blocks of {per_block} ({block_bytes * 8 / per_block:g} bits/weight)"
    if t.quant is not None:
        kind = f"per-channel (dim {t.quant.quantized_dimension}, {len(t.quant.scale)} scales)" \
            if t.quant.per_channel else f"scale {float(t.quant.scale[0]):.4g}, zero point {int(t.quant.zero_point[0])}"
        return kind
    return None


def _stored_bytes(t) -> int:
    """Bytes of a constant in the file (INT4/UINT4: two values per byte; the IR holds one per element)."""
    from circleops import ir

    if t.dtype in ir.PACKED_4BIT:
        return (int(t.data.size) + 1) // 2
    return int(t.data.nbytes)


class _Totals:
    """What ``summarize`` adds up over the subgraphs."""

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.const_by_dtype: dict[str, dict[str, int]] = {}
        self.seen_data: set[int] = set()
        self.composites: dict[tuple, dict[str, Any]] = {}
        self.customs: dict[tuple, dict[str, Any]] = {}
        self.constants: list[dict[str, Any]] = []
        self.activations: list[dict[str, Any]] = []  # quantized non-constant tensors (integer graphs)

    def add_tensors(self, si: int, sg: Any) -> int:
        """Count the subgraph's constants (a shared buffer's bytes once) and quantized
        activations; returns how many constants it has."""
        n_const = 0
        for t in sg.tensors:
            if t.data is None:
                if t.quant is not None:
                    self.activations.append({"subgraph": si, **_tensor_info(t)})
                continue
            n_const += 1
            entry = self.const_by_dtype.setdefault(t.dtype, {"tensors": 0, "bytes": 0})
            entry["tensors"] += 1
            shared = id(t.data) in self.seen_data
            if not shared:  # a shared buffer counts once
                self.seen_data.add(id(t.data))
                entry["bytes"] += _stored_bytes(t)
            self.constants.append({"subgraph": si, "name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                   "bytes": _stored_bytes(t), "shared": shared, "quantization": _quant_info(t)})
        return n_const

    def add_operators(self, sg: Any) -> None:
        """Count the CUSTOM ops by (custom_code, options) and the composites by (name,
        decomposition, attributes)."""
        for op in sg.operators:
            if op.opcode == "CUSTOM":
                options = _custom_options(op.options.get("customOptions"))
                key = (op.options.get("customCode"), json.dumps(options, sort_keys=True, default=json_default))
                c = self.customs.setdefault(key, {"custom_code": op.options.get("customCode"), "options": options,
                                                  "count": 0})
                c["count"] += 1
                continue
            if op.opcode != "STABLEHLO_COMPOSITE":
                continue
            o = op.options
            attrs = o.get("compositeAttributes") or {}
            key = (o.get("name"), o.get("decompositionSubgraphIndex"), json.dumps(attrs, sort_keys=True, default=json_default))
            c = self.composites.setdefault(key, {
                "name": o.get("name"), "decomposition_subgraph": o.get("decompositionSubgraphIndex"),
                "attributes": attrs, "version": o.get("version", 0), "count": 0})
            c["count"] += 1

    def add_subgraph(self, si: int, sg: Any) -> dict[str, Any]:
        """The subgraph's own summary; its ops, constants, composites and CUSTOM ops counted."""
        sg_ops = Counter(op.opcode for op in sg.operators)
        self.ops.update(sg_ops)
        n_const = self.add_tensors(si, sg)
        self.add_operators(sg)
        return {
            "index": si, "name": sg.name, "ops": len(sg.operators), "tensors": len(sg.tensors),
            "constants": n_const, "op_histogram": dict(sorted(sg_ops.items(), key=lambda kv: (-kv[1], kv[0]))),
            "inputs": [_tensor_info(sg.tensors[i]) for i in sg.inputs],
            "outputs": [_tensor_info(sg.tensors[i]) for i in sg.outputs],
        }


def _signatures(model: Any) -> list[dict[str, Any]]:
    """Each signature's key, subgraph and named inputs/outputs (with their tensors' shapes and dtypes)."""
    signatures = []
    for sig in model.signatures:
        tensors = model.subgraphs[sig.subgraph_index].tensors if sig.subgraph_index < len(model.subgraphs) else []

        def info(name, idx):
            d = _tensor_info(tensors[idx]) if idx < len(tensors) else {"dtype": "?", "shape": []}
            return {**d, "name": name, "tensor": d.get("name")}

        signatures.append({
            "key": sig.key, "subgraph": sig.subgraph_index,
            "inputs": [info(n, i) for n, i in sig.inputs.items()],
            "outputs": [info(n, i) for n, i in sig.outputs.items()],
        })
    return signatures


def summarize(path: str | os.PathLike) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data."""
    from circleops.serialize.reader import detect_format, read_model

    path = Path(path)
    fmt = detect_format(path)
    model = read_model(path)
    layout = _layout(path, fmt)
    totals = _Totals()
    subgraphs = [totals.add_subgraph(si, sg) for si, sg in enumerate(model.subgraphs)]
    return {
        "file": str(path),
        "format": fmt,
        "file_bytes": path.stat().st_size,
        "description": model.description,
        "weights": ("after the flatbuffer (Buffer.offset/size)" if layout["offset"] and not layout["inline"]
                    else "inline" if not layout["offset"] else "mixed inline and after the flatbuffer"),
        "buffers": layout,
        "subgraphs": subgraphs,
        "signatures": _signatures(model),
        "op_histogram": dict(sorted(totals.ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "constants_by_dtype": dict(sorted(totals.const_by_dtype.items())),
        "constant_bytes": sum(v["bytes"] for v in totals.const_by_dtype.values()),
        "composites": list(totals.composites.values()),
        "custom_ops": list(totals.customs.values()),
        "constants": totals.constants,
        "quantized_activations": totals.activations,
        "metadata": {k: len(v) for k, v in model.metadata.items()},
        "task": _task_record(model.metadata),
    }


def _task_record(metadata: dict[str, bytes]) -> dict[str, Any] | None:
    """What circleops.recipes.tasks recorded about the source model (task, inputs, labels), if anything."""
    import json

    from circleops.options import TASK_METADATA_KEY as METADATA_KEY

    from circleops.errors import CircleOpsError
    from circleops.inputs.user_files import parse_json

    try:
        return parse_json(bytes(metadata[METADATA_KEY]), "the task metadata") if METADATA_KEY in metadata else None
    except CircleOpsError:
        return None


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _io_line(t: dict[str, Any]) -> str:
    shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
    extra = f"  (tensor {t['tensor']})" if t.get("tensor") and t["tensor"] != t["name"] else ""
    extra += f"  {t['quantization']}" if t.get("quantization") else ""
    return f"    {t['name']:<24} {t['dtype']:<9} {shape}{extra}"


def format_text(s: dict[str, Any], tensors: bool = False) -> str:
    """The human-readable report; ``tensors`` adds every constant's storage type and bytes."""
    fmt = {"circle": "Circle (CIR0)", "tflite": "TFLite (TFL3)"}[s["format"]]
    lines = [f"{s['file']}: {fmt}, {_size(s['file_bytes'])}, weights {s['weights']}"]
    if s["description"]:
        lines.append(f"description: {s['description']}")

    lines.append(f"\nsubgraphs ({len(s['subgraphs'])}):")
    for sg in s["subgraphs"]:
        lines.append(f"  [{sg['index']}] {sg['name']}: {sg['ops']} ops, {sg['tensors']} tensors "
                     f"({sg['constants']} constant)")
    main = s["subgraphs"][0] if s["subgraphs"] else None
    if main:
        lines.append(f"\ninputs of [0] {main['name']}:")
        lines += [_io_line(t) for t in main["inputs"]] or ["    (none)"]
        lines.append(f"outputs of [0] {main['name']}:")
        lines += [_io_line(t) for t in main["outputs"]] or ["    (none)"]

    lines.append(f"\nsignatures ({len(s['signatures'])}):" if s["signatures"] else "\nsignatures: none")
    for sig in s["signatures"]:
        lines.append(f"  {sig['key']!r} -> subgraph {sig['subgraph']}")
        lines.append("    inputs:")
        lines += ["  " + _io_line(t) for t in sig["inputs"]]
        lines.append("    outputs:")
        lines += ["  " + _io_line(t) for t in sig["outputs"]]

    total = sum(s["op_histogram"].values())
    lines.append(f"\nops ({total} in all subgraphs):")
    for name, n in s["op_histogram"].items():
        lines.append(f"  {name:<28} {n:>6}")

    lines.append(f"\nconstants ({_size(s['constant_bytes'])}):")
    for dtype, v in s["constants_by_dtype"].items():
        lines.append(f"  {dtype:<10} {v['tensors']:>6} tensors  {_size(v['bytes']):>10}")
    if not s["constants_by_dtype"]:
        lines.append("  (none)")
    if tensors and s["constants"]:
        lines.append(f"\nconstant tensors ({len(s['constants'])}; storage type, shape, bytes):")
        for t in s["constants"]:
            shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
            extra = (f"  {t['quantization']}" if t["quantization"] else "") + ("  (shared buffer)" if t["shared"] else "")
            lines.append(f"  [{t['subgraph']}] {t['name']:<44} {t['dtype']:<10} {shape:<16} {_size(t['bytes']):>10}{extra}")

    if tensors and s.get("quantized_activations"):
        lines.append(f"\nquantized activations ({len(s['quantized_activations'])}; dtype, shape, parameters):")
        for t in s["quantized_activations"]:
            shape = "[" + ", ".join(str(d) for d in t["shape"]) + "]"
            lines.append(f"  [{t['subgraph']}] {t['name']:<44} {t['dtype']:<10} {shape:<16} {t['quantization']}")

    if s["composites"]:
        lines.append(f"\ncomposites ({sum(c['count'] for c in s['composites'])}):")
        for c in s["composites"]:
            attrs = ", ".join(f"{k}={v!r}" for k, v in c["attributes"].items())
            lines.append(f"  {c['name']} x{c['count']}  decomposition subgraph {c['decomposition_subgraph']}"
                         f"  {{{attrs}}}")
    if s.get("custom_ops"):
        lines.append(f"\ncustom ops ({sum(c['count'] for c in s['custom_ops'])}):")
        for c in s["custom_ops"]:
            opts = c["options"]
            shown = ", ".join(f"{k}={v!r}" for k, v in opts.items()) if isinstance(opts, dict) else opts
            lines.append(f"  {c['custom_code']} x{c['count']}  custom_options {{{shown}}}")
    if s["metadata"]:
        lines.append("\nmetadata: " + ", ".join(f"{k} ({n} B)" for k, n in s["metadata"].items()))
    task = s.get("task")
    if task:
        labels = f"; {len(task['id2label'])} labels (config.id2label)" if task.get("id2label") else ""
        lines.append(f"task: {task.get('task')} ({task.get('class')}, from {task.get('model_dir') or '--config'})"
                     f"{labels}; `circleops run` makes its inputs from --image / --text / --audio")
    return "\n".join(lines)
