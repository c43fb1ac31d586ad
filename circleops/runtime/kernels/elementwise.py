"""Elementwise kernels: arithmetic with broadcasting, comparisons, logic, unary math, CAST.

Binary ops need one input dtype (TFLite does not promote) and apply the fused activation
where the schema has one (ADD, SUB, MUL, DIV).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from circleops.runtime.kernels import KERNELS, KernelError, activation, kernel, option, same_dtype


def _div(a: Tensor, b: Tensor) -> Tensor:
    # Integer DIV truncates in TFLite (C++ '/'); float DIV is true division.
    if a.is_floating_point():
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


def _floor_div(a: Tensor, b: Tensor) -> Tensor:
    return torch.div(a, b, rounding_mode="floor")


def _squared_difference(a: Tensor, b: Tensor) -> Tensor:
    d = a - b
    return d * d


# opcode -> (torch function, has fusedActivationFunction)
BINARY: dict[str, tuple[Callable[[Tensor, Tensor], Tensor], bool]] = {
    "ADD": (torch.add, True),
    "SUB": (torch.sub, True),
    "MUL": (torch.mul, True),
    "DIV": (_div, True),
    "FLOOR_DIV": (_floor_div, False),
    "FLOOR_MOD": (torch.remainder, False),  # sign of the divisor, as TFLite's FloorMod
    "POW": (torch.pow, False),
    "MAXIMUM": (torch.maximum, False),
    "MINIMUM": (torch.minimum, False),
    "SQUARED_DIFFERENCE": (_squared_difference, False),
    "ATAN2": (torch.atan2, False),
    "LESS": (torch.lt, False),
    "LESS_EQUAL": (torch.le, False),
    "GREATER": (torch.gt, False),
    "GREATER_EQUAL": (torch.ge, False),
    "EQUAL": (torch.eq, False),
    "NOT_EQUAL": (torch.ne, False),
    "LOGICAL_AND": (torch.logical_and, False),
    "LOGICAL_OR": (torch.logical_or, False),
    "BITWISE_XOR": (torch.bitwise_xor, False),
}


def _binary_kernel(fn: Callable[[Tensor, Tensor], Tensor], fused: bool):
    def run(op, inputs, ctx):
        a, b = inputs[0], inputs[1]
        same_dtype(op, a, b)
        y = fn(a, b)
        return [activation(y, op) if fused else y]

    return run


for _name, (_fn, _fused) in BINARY.items():
    kernel(_name)(_binary_kernel(_fn, _fused))


def _square(x: Tensor) -> Tensor:
    return x * x


def _relu_0_to_1(x: Tensor) -> Tensor:
    return x.clamp(0, 1)


def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros_like(x)


_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "NEG": torch.neg,
    "ABS": torch.abs,
    "EXP": torch.exp,
    "LOG": torch.log,
    "SQRT": torch.sqrt,
    "RSQRT": torch.rsqrt,
    "SQUARE": _square,
    "SIN": torch.sin,
    "COS": torch.cos,
    "TANH": torch.tanh,
    "LOGISTIC": torch.sigmoid,
    "RELU": torch.relu,
    "RELU6": lambda x: x.clamp(0, 6),
    "RELU_N1_TO_1": lambda x: x.clamp(-1, 1),
    "RELU_0_TO_1": _relu_0_to_1,
    "ELU": F.elu,
    "HARD_SWISH": F.hardswish,
    "FLOOR": torch.floor,
    "CEIL": torch.ceil,
    "ROUND": torch.round,  # half to even, as TFLite's ROUND
    "SIGN": torch.sign,
    "LOGICAL_NOT": torch.logical_not,
    "ZEROS_LIKE": _zeros_like,
}


def _unary_kernel(fn: Callable[[Tensor], Tensor]):
    def run(op, inputs, ctx):
        return [fn(inputs[0])]

    return run


for _name, _fn in _UNARY.items():
    kernel(_name)(_unary_kernel(_fn))


@kernel("GELU")
def _gelu(op, inputs, ctx):
    return [F.gelu(inputs[0], approximate="tanh" if option(op, "approximate", default=False) else "none")]


@kernel("LEAKY_RELU")
def _leaky_relu(op, inputs, ctx):
    return [F.leaky_relu(inputs[0], float(option(op, "alpha", default=0.0)))]


@kernel("PRELU")
def _prelu(op, inputs, ctx):
    x, alpha = inputs
    same_dtype(op, x, alpha)
    return [torch.where(x >= 0, x, alpha * x)]


@kernel("CAST", "DEQUANTIZE")
def _cast(op, inputs, ctx):
    # DEQUANTIZE of a float16 constant is how TFLite files store fp16 weights.
    x = inputs[0]
    if op.opcode == "DEQUANTIZE" and not x.is_floating_point():
        raise KernelError("DEQUANTIZE of integer (quantized) tensors is not supported; only float16 -> float32")
    return [x.to(ctx.out_dtype())]


@kernel("SELECT", "SELECT_V2")
def _select(op, inputs, ctx):
    cond, a, b = inputs
    same_dtype(op, a, b)
    if op.opcode == "SELECT" and cond.dim() == 1 and a.dim() > 1 and cond.shape[0] == a.shape[0] != 1:
        # SELECT (v1) with a rank-1 condition picks whole rows.
        cond = cond.reshape(-1, *([1] * (a.dim() - 1)))
    return [torch.where(cond, a, b)]


@kernel("ADD_N")
def _add_n(op, inputs, ctx):
    same_dtype(op, *inputs)
    y = inputs[0]
    for t in inputs[1:]:
        y = y + t
    return [y]


assert set(BINARY) | set(_UNARY) <= set(KERNELS)
