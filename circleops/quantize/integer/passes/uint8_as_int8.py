"""Every UINT8 tensor becomes INT8 with the zero point 128 lower
(TargetProfile.quantized_uint8_as_int8).

BEFORE:  x(uint8, s, zp)          data q
AFTER:   x(int8, s, zp - 128)     data q - 128

The same real values (scale · (q - zp)), in the int8 asymmetric activations TFLite's kernels take.
"""
from __future__ import annotations

import numpy as np

from circleops import ir


def uint8_as_int8(sg: ir.Subgraph) -> None:
    for t in sg.tensors:
        if t.dtype != "UINT8" or t.quant is None:
            continue
        t.dtype = "INT8"
        t.quant = ir.QuantParams(t.quant.scale, t.quant.zero_point - 128, t.quant.quantized_dimension)
        if t.data is not None:
            t.data = (np.asarray(t.data).astype(np.int16) - 128).astype(np.int8)
