"""Hand-built ir.Models for interpreter tests: one operator, some inputs fed, some constant."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from circleops import ir


@dataclass
class Feed:
    """A graph input fed at run time (numpy, or torch for bf16)."""
    value: Any


@dataclass
class Const:
    """A constant tensor (weights, shape operands)."""
    value: Any


Operand = Union[Feed, Const, None]


def _meta(value: Any) -> tuple[tuple[int, ...], str]:
    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.array(value, order="C"))
    return tuple(t.shape), ir.TORCH_TO_TYPE[t.dtype]


def one_op(opcode: str, operands: Sequence[Operand], outputs: Sequence[Any], options: Optional[dict] = None,
           options_type: Optional[str] = None) -> tuple[ir.Model, list[np.ndarray]]:
    """A model with the single operator ``opcode``; outputs declared like the arrays given.

    Returns the model and the arrays to feed, in input order.
    """
    sg = ir.Subgraph("main")
    op_inputs, feeds = [], []
    for k, operand in enumerate(operands):
        if operand is None:
            op_inputs.append(-1)
            continue
        arr = operand.value if isinstance(operand.value, torch.Tensor) else np.asarray(operand.value)
        shape, dtype = _meta(arr)
        if isinstance(operand, Const):
            j = sg.add_tensor(ir.Tensor(f"const{k}", shape, dtype, data=arr))
        else:
            j = sg.add_tensor(ir.Tensor(f"in{k}", shape, dtype))
            sg.inputs.append(j)
            feeds.append(arr)
        op_inputs.append(j)
    op_outputs = []
    for k, out in enumerate(outputs):
        shape, dtype = _meta(out)
        op_outputs.append(sg.add_tensor(ir.Tensor(f"out{k}", shape, dtype)))
    sg.outputs = list(op_outputs)
    sg.operators.append(ir.Operator(opcode, op_inputs, op_outputs, options_type, dict(options or {})))
    return ir.Model([sg]), feeds
