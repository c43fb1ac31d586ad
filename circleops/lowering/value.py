"""What an FX node lowers to: a ``Value``, and torch's dtype promotion / broadcasting over them.

A ``Value`` is a tensor of the subgraph being built, or a constant (a torch tensor not yet
written into any subgraph). Constants are materialized lazily, once per subgraph, by the
LoweringContext the first time an operator uses them.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.fx

from circleops import ir


class Value:
    """A lowered tensor: ``index`` in subgraph ``sg``, or a constant ``const``."""

    __slots__ = ("shape", "dtype", "index", "const", "name", "sg")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, *, index: int | None = None,
                 const: torch.Tensor | None = None, name: str = "", sg: ir.Subgraph | None = None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.index = index
        self.const = const
        self.name = name
        self.sg = sg

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        kind = "const" if self.is_const else f"#{self.index}"
        return f"Value({self.name or '?'} {kind} {list(self.shape)} {self.dtype})"


def const_value(t: torch.Tensor, name: str = "") -> Value:
    return Value(t.shape, t.dtype, const=t, name=name)


def source_line(node: torch.fx.Node | None) -> str:
    """The user's source line that produced ``node`` (the last frame of its stack trace)."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{lines[i]}: {code}" if code else lines[i]
    return "(no source location recorded)"


def scalar_dtype(x: Any) -> torch.dtype:
    """The dtype torch gives a Python scalar: bool, int64, or float32 (the default dtype)."""
    if isinstance(x, bool):
        return torch.bool
    if isinstance(x, int):
        return torch.int64
    return torch.float32


def result_type(*xs: Any) -> torch.dtype:
    """torch's type promotion over Values and Python scalars (0-dim tensors rank as scalars)."""
    probes = []
    for x in xs:
        if isinstance(x, Value):
            probes.append(torch.empty(() if x.rank == 0 else (0,), dtype=x.dtype))
        elif x is not None:
            probes.append(x)
    out = probes[0]
    if len(probes) == 1:
        return out.dtype if isinstance(out, torch.Tensor) else scalar_dtype(out)
    dtype = torch.result_type(probes[0], probes[1])
    for p in probes[2:]:
        dtype = torch.promote_types(dtype, p.dtype if isinstance(p, torch.Tensor) else scalar_dtype(p))
    return dtype


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy/torch broadcasting of static shapes."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for s in shapes:
        for i, d in enumerate(s, rank - len(s)):
            if d != 1:
                if out[i] not in (1, d):
                    raise ValueError(f"shapes {[list(x) for x in shapes]} do not broadcast")
                out[i] = d
    return tuple(out)
