"""The reference interpreter's kernel table: one short torch function per opcode.

A kernel is ``fn(op, inputs, ctx) -> list[torch.Tensor]``:
  * ``op``: the ir.Operator (``op.options`` by object-API field name, e.g. ``keepNumDims``),
  * ``inputs``: torch tensors in operator order, ``None`` where the operator omits one (-1),
  * ``ctx``: a :class:`KernelContext` with the IR of the op's output tensors (the dtype a
    CAST casts to, a declared shape) and ``call`` to run another subgraph.

Kernels follow TFLite/Circle semantics and compute in the tensors' dtype: an fp16 op is
computed in fp16 and nothing is upcast unless the op's contract says so (the fused ops'
fp32 policy). Inputs are never modified in place: a result may be a view of an input.

Adding an opcode = one ``@kernel("NAME")`` function in one of the modules below.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from circleops import ir


class KernelError(Exception):
    """A kernel found its inputs or options invalid; the interpreter adds op context."""


@dataclass
class KernelContext:
    """What a kernel may know beyond its inputs; built once per operator in the plan."""

    outputs: list[ir.Tensor]
    call: Callable[[int, list[Tensor]], list[Tensor]] = field(repr=False, default=None)  # type: ignore[assignment]
    inputs: list[Optional[ir.Tensor]] = field(default_factory=list)  # the IR of the inputs (quantization)

    def out_dtype(self, i: int = 0) -> torch.dtype:
        """The declared torch dtype of output ``i``."""
        return self.outputs[i].torch_dtype


Kernel = Callable[[ir.Operator, list[Optional[Tensor]], KernelContext], Sequence[Tensor]]

KERNELS: dict[str, Kernel] = {}

# opcode -> input positions an operator updates in place when it declares fewer outputs
# than its kernel returns (ONE's ATTENTION has one output and writes k/v into the caches).
IN_PLACE: dict[str, tuple[int, ...]] = {}

# opcode -> input positions that may be GGML blocks (a circleops.quantize.ggml.BlockTensor
# reaches the kernel there; onert reads GGML blocks nowhere else).
BLOCK_WEIGHT_INPUTS: dict[str, tuple[int, ...]] = {"FULLY_CONNECTED": (1,), "GATHER": (0,)}


def kernel(*opcodes: str, in_place: tuple[int, ...] = ()) -> Callable[[Kernel], Kernel]:
    """Register ``fn`` as the kernel of each BuiltinOperator name in ``opcodes``.

    ``in_place``: input positions that receive the kernel's extra results (beyond the
    outputs the operator declares), for ops whose runtime updates those inputs in place.
    """

    def register(fn: Kernel) -> Kernel:
        for name in opcodes:
            if name in KERNELS:
                raise ValueError(f"kernel for {name} registered twice")
            KERNELS[name] = fn
            if in_place:
                IN_PLACE[name] = in_place
        return fn

    return register


# ---- helpers shared by the kernel modules -------------------------------------------

def option(op: ir.Operator, *names: str, default: Any = None) -> Any:
    """The first present option among ``names`` (Circle and TFLite spell a few differently)."""
    for name in names:
        value = op.options.get(name)
        if value is not None:
            return value
    return default


def enum_value(value: Any, names: Sequence[str]) -> int:
    """An enum option as its integer value; accepts the integer or the enum member name."""
    if isinstance(value, str):
        try:
            return list(names).index(value.upper())
        except ValueError:
            raise KernelError(f"unknown enum value {value!r}; expected one of {list(names)}") from None
    return int(value or 0)


_ACTIVATIONS = ("NONE", "RELU", "RELU_N1_TO_1", "RELU6", "TANH", "SIGN_BIT")


def activation(x: Tensor, op: ir.Operator) -> Tensor:
    """Apply the op's fusedActivationFunction (ActivationFunctionType)."""
    code = enum_value(op.options.get("fusedActivationFunction", 0), _ACTIVATIONS)
    if code == 0:
        return x
    if code == 1:
        return torch.relu(x)
    if code == 2:
        return x.clamp(-1, 1)
    if code == 3:
        return x.clamp(0, 6)
    if code == 4:
        return torch.tanh(x)
    if code == 5:
        return torch.signbit(x).to(x.dtype)
    raise KernelError(f"unknown fusedActivationFunction {code}")


# Largest tensor a kernel may allocate from shapes it computes out of the file's values
# (FILL dims, TILE multiples, PAD amounts, RANGE bounds, broadcasting): a 1 KB file must
# not make the interpreter allocate gigabytes. $CIRCLEOPS_MAX_TENSOR_BYTES overrides it.
DEFAULT_MAX_TENSOR_BYTES = 4 << 30


def max_tensor_bytes() -> int:
    """The allocation limit per computed tensor, in bytes."""
    env = os.environ.get("CIRCLEOPS_MAX_TENSOR_BYTES")
    try:
        return int(env) if env else DEFAULT_MAX_TENSOR_BYTES
    except ValueError:
        return DEFAULT_MAX_TENSOR_BYTES


def check_alloc(shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
    """Refuse (before allocating) a tensor of ``shape`` that is invalid or over the limit."""
    n = 1
    for d in shape:
        d = int(d)
        if d < 0:
            raise KernelError(f"{what}: negative dimension in shape {list(shape)}")
        n *= d
    nbytes = n * (torch.empty((), dtype=dtype).element_size() if dtype is not None else 1)
    if nbytes > max_tensor_bytes():
        raise KernelError(
            f"{what}: shape {list(shape)} would allocate {nbytes} bytes, over the interpreter's limit of "
            f"{max_tensor_bytes()} bytes per tensor (set CIRCLEOPS_MAX_TENSOR_BYTES to allow more)")


def ints(t: Tensor | None) -> list[int]:
    """A small integer tensor (shape, axes, begin...) as a Python list."""
    if t is None:
        return []
    return [int(v) for v in t.reshape(-1).tolist()]


def scalar(t: Tensor) -> Any:
    """A one-element tensor as a Python number."""
    if t.numel() != 1:
        raise KernelError(f"expected a scalar tensor, got shape {list(t.shape)}")
    return t.reshape(-1)[0].item()


def axis_of(axis: int, rank: int) -> int:
    """A possibly negative axis as a non-negative one, checked against the rank."""
    if not -rank <= axis < max(rank, 1):
        raise KernelError(f"axis {axis} out of range for rank {rank}")
    return axis % max(rank, 1)


def same_dtype(op: ir.Operator, *tensors: Tensor) -> None:
    """TFLite requires equal input dtypes where torch would promote; refuse to promote."""
    first = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != first:
            raise KernelError(
                f"{op.opcode} needs inputs of one dtype, got {[str(x.dtype) for x in tensors]}; "
                "torch would promote them silently, a TFLite/Circle runtime does not")


# Importing the modules registers their kernels.
from circleops.runtime.kernels import elementwise, fused, nn, quantized, reduce, shape  # noqa: E402,F401

__all__ = ["KERNELS", "IN_PLACE", "BLOCK_WEIGHT_INPUTS", "Kernel", "KernelContext", "KernelError", "kernel", "option", "enum_value",
           "activation", "ints", "scalar", "axis_of", "same_dtype", "check_alloc", "max_tensor_bytes"]
