"""Refuse a graph holding quantized dtypes the target's runtime cannot load.

BEFORE:  an integer graph for target onert with an INT16 tensor (or int8 per-channel weights)
AFTER:   unchanged, or TargetError naming the tensor and what to use instead

(TargetProfile.quantized_dtypes, quantized_per_channel_int8: onert 0.1.0 measured by
bench/onert_quantized.py.)
"""
from __future__ import annotations

from circleops import ir
from circleops.targets import TargetProfile, profile


def check_target(sg: ir.Subgraph, target: str | TargetProfile) -> None:
    from circleops.errors import TargetError

    p = profile(target)
    for t in sg.tensors:
        if t.dtype in ("UINT8", "INT8", "INT16", "INT4") and t.quant is not None and t.dtype not in p.quantized_dtypes:
            raise TargetError(f"target {p.name}: its runtime loads no {t.dtype.lower()} graph (tensor {t.name!r} is "
                              f"{t.dtype}; onert 0.1.0: 'OperationValidator failed' for every op). Use --quantize uint8 "
                              "for onert, or --target circle for an int16 file for NPU compilers.")
        if t.dtype == "INT8" and t.quant is not None and t.quant.per_channel and not p.quantized_per_channel_int8:
            raise TargetError(f"target {p.name}: onert 0.1.0 computes int8 per-channel weights wrongly (tensor "
                              f"{t.name!r}; measured ~250 output steps off): quantize weights as uint8 per tensor "
                              "(CircleQuantizer(weight='uint8')) for onert, or use --target circle.")
