"""What a quantized file costs against fp32, from the references verify computes anyway.

``convert --graphs --quantize FMT --verify`` runs the model's forward on the file's weights
(and the runtime's input rounding) to check the written graphs; one more forward on the fp32
weights over the same tokens gives the quality figure, reported beside verify and never a
bound of it (issue 32: verify checks the file against its own arithmetic, the quality is a
separate figure):

* SQNR of the logits, 10 log10(sum fp32^2 / sum (quantized - fp32)^2), over every position;
* top-1 agreement: at how many positions the quantized logits' argmax is fp32's (the greedy
  token, teacher-forced on the same ids).

Perplexity needs real text (the verify tokens are random ids): ``circleops check MODEL
--quantize FMT`` measures it (circleops.tools.quant_report).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Quality:
    """A quantized reference against fp32's over the same inputs."""

    sqnr_db: float  # 10 log10(sum fp32^2 / sum error^2) over every compared value (inf: identical)
    agreement: int  # positions whose argmax (greedy token) equals fp32's
    positions: int  # positions compared (rows of the outputs' last axis)
    max_abs: float  # the largest difference, for scale

    def to_dict(self) -> dict[str, Any]:
        """Plain data (an infinite SQNR, identical outputs, as None: JSON has no infinity)."""
        return {**asdict(self), "sqnr_db": None if math.isinf(self.sqnr_db) else self.sqnr_db}

    def line(self) -> str:
        """The summary's words."""
        db = "identical" if math.isinf(self.sqnr_db) else f"SQNR {self.sqnr_db:.1f} dB"
        return (f"{db}, top-1 agreement {self.agreement}/{self.positions} positions, max abs difference "
                f"{self.max_abs:.3g}")


def float_arrays(value: Any) -> list[Any]:
    """The float numpy arrays of a recipe's references (a dataclass, mapping, sequence or
    array, tensors as arrays), in a fixed order: what two references are compared over."""
    import numpy as np

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        value = [value[k] for k in sorted(value, key=str)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in float_arrays(v)]
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().float().numpy() if value.is_floating_point() else None
    return [value] if isinstance(value, np.ndarray) and value.dtype.kind == "f" else []


def outputs(references: Any) -> list[Any]:
    """What the quality is measured over: a recipe's references' ``logits`` when they have
    them (a VLM's also hold its input pixels and its fp32 vision features), else every float
    array (:func:`float_arrays`)."""
    logits = getattr(references, "logits", None)
    return float_arrays(logits) if logits is not None else float_arrays(references)


def measure(fp32: Any, quantized: Any) -> Quality | None:
    """The :class:`Quality` of ``quantized`` against ``fp32``: two references of one recipe
    (their :func:`outputs`, in the same order and shapes); each array's rows along its last
    axis are positions. None when there is nothing to compare."""
    import numpy as np

    signal = noise = 0.0
    agree = positions = 0
    worst = 0.0
    for a, b in zip(outputs(fp32), outputs(quantized)):
        if a.size == 0 or a.shape != b.shape:
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        signal += float(np.square(a64).sum())
        noise += float(np.square(b64 - a64).sum())
        worst = max(worst, float(np.abs(b64 - a64).max()))
        rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        agree += int((rows_a.argmax(-1) == rows_b.argmax(-1)).sum())
        positions += rows_a.shape[0]
    if positions == 0:
        return None
    db = math.inf if noise == 0.0 else (10 * math.log10(signal / noise) if signal > 0 else -math.inf)
    return Quality(sqnr_db=db, agreement=agree, positions=positions, max_abs=worst)
