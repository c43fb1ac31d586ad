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
    if options and options_type is None:
        options_type = options_table(opcode)
    sg.operators.append(ir.Operator(opcode, op_inputs, op_outputs, options_type, dict(options or {})))
    return ir.Model([sg]), feeds


_SPECIAL_OPTIONS = {
    "MEAN": "ReducerOptions", "SUM": "ReducerOptions", "REDUCE_MAX": "ReducerOptions",
    "REDUCE_MIN": "ReducerOptions", "REDUCE_PROD": "ReducerOptions", "REDUCE_ANY": "ReducerOptions",
    "MAX_POOL_2D": "Pool2DOptions", "AVERAGE_POOL_2D": "Pool2DOptions",
    "MAXIMUM": "MaximumMinimumOptions", "MINIMUM": "MaximumMinimumOptions",
    "L2_NORMALIZATION": "L2NormOptions", "ATTENTION": "AttentionOptions",
}


def options_table(opcode: str) -> str:
    """The options table name of ``opcode`` (AddOptions for ADD, ReducerOptions for MEAN...)."""
    if opcode in _SPECIAL_OPTIONS:
        return _SPECIAL_OPTIONS[opcode]
    from circle_schema import circle

    want = opcode.replace("_", "").lower() + "options"
    for name in dir(circle.BuiltinOptions.BuiltinOptions) + dir(circle.BuiltinOptions2.BuiltinOptions2):
        if name.lower() == want:
            return name
    raise KeyError(f"no options table for {opcode}")


def write_and_run(model: ir.Model, feeds: list, fmt: str, path) -> list[np.ndarray]:
    """Write ``model`` as ``fmt`` and run it in the real runtime: onert (circle) or LiteRT (tflite)."""
    from circleops.serialize import write_model

    write_model(model, path, fmt)
    if fmt == "tflite":
        from circleops.runtime import litert

        return litert.run(path, feeds)
    import onert

    return [np.asarray(o) for o in onert.infer.session(str(path), "cpu").infer([np.asarray(f) for f in feeds])]
