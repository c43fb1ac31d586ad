"""The Report that ``convert`` / ``save`` return and ``circleops convert`` prints.

    report = circleops.convert(model, (ids,), "model.circle", verify=True)
    report.ops            # {"FULLY_CONNECTED": 29, "RMS_NORM": 9, ...} in the written file
    report.fused          # {"rms_norm": 9, "rope": 8, ...} circle ops in the exported graph
    report.verify         # VerifyResult(runtime="reference", max_abs_error=3e-6, ...)
    print(report.summary())
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class VerifyResult:
    """The written file run by ``runtime`` against torch on the same inputs."""

    runtime: str
    max_abs_error: float
    tolerance: float
    reference_max_abs: float  # max |torch output|, the scale the error is measured against
    passed: bool


@dataclass
class Report:
    """What a conversion produced and how long each stage took."""

    path: str
    target: str
    format: str
    dtype: str
    ops: dict[str, int] = field(default_factory=dict)  # opcode -> count, main subgraph
    fused: dict[str, int] = field(default_factory=dict)  # circle op -> count in the exported graph
    file_size: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    verify: VerifyResult | None = None
    fusion: Any = None  # circleops.passes.fusion.FusionReport, when the pattern pass ran
    fuse: str = "none"  # the fusion mode used: auto, adapters, patterns, none
    source: str = ""
    inputs: list[tuple[str, list[int], str]] = field(default_factory=list)  # name, shape, dtype
    outputs: list[tuple[str, list[int], str]] = field(default_factory=list)
    parameters: int = 0
    warnings: list[str] = field(default_factory=list)
    quantization: Any = None  # circleops.quantize.weights.QuantReport when quantize= was given

    @property
    def total_seconds(self) -> float:
        return sum(self.timings.values())

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the --report file)."""
        d = asdict(self)
        d["fusion"] = _plain(self.fusion)
        d["quantization"] = self.quantization.to_dict() if self.quantization is not None else None
        d["total_seconds"] = round(self.total_seconds, 3)
        d["timings"] = {k: round(v, 3) for k, v in self.timings.items()}
        return d

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=False, default=str)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def summary(self) -> str:
        """The human summary ``circleops convert`` prints."""
        lines = [f"wrote {self.path} ({self.format}, target {self.target}, {self.dtype}): {_size(self.file_size)}"]
        if self.source:
            lines.append(f"  model:   {self.source}" + (f", {self.parameters / 1e6:.1f}M parameters" if self.parameters else ""))
        for label, ios in (("inputs", self.inputs), ("outputs", self.outputs)):
            if ios:
                lines.append(f"  {label + ':':8} " + ", ".join(f"{n} {list(s)} {t}" for n, s, t in ios))
        fused = ", ".join(f"{k} x{v}" for k, v in sorted(self.fused.items())) or "none"
        lines.append(f"  fused:   {fused}  (fuse={self.fuse})")
        total = sum(self.ops.values())
        hist = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items(), key=lambda kv: (-kv[1], kv[0])))
        lines.append(f"  ops:     {total} ({hist})")
        if self.quantization is not None:
            for k, line in enumerate(self.quantization.summary_lines()):
                lines.append(f"  {'quantize:' if k == 0 else '':9}{line}")
        if self.verify is not None:
            v = self.verify
            status = "ok" if v.passed else "MISMATCH"
            lines.append(f"  verify:  {v.runtime}: max abs error {v.max_abs_error:.3g} vs torch "
                         f"(max |output| {v.reference_max_abs:.3g}, tolerance {v.tolerance:.3g}) {status}")
        stages = ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
        lines.append(f"  time:    {self.total_seconds:.2f}s ({stages})")
        for w in self.warnings:
            lines.append(f"  warning: {w}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _plain(obj: Any) -> Any:
    """A FusionReport (or anything) as JSON-ready data."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    try:
        return _plain(asdict(obj))
    except TypeError:
        pass
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_plain(v) for v in obj]
    return str(obj)
