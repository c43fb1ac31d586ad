"""The lowering table: one short function per aten / circle op.

    @lower(torch.ops.aten.rsqrt)
    def _(ctx, node, x):
        return ctx.emit("RSQRT", [x])

A lowering receives the LoweringContext, the FX node, and the node's args/kwargs with
every FX node replaced by its lowered Value (Python scalars, lists and None pass through).
It returns a Value, a list/tuple of Values for multi-output ops, or a Python scalar.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

Lowering = Callable[..., Any]

# OpOverload or OpOverloadPacket -> lowering. An overload's own entry wins over its packet's.
LOWERINGS: dict[Any, Lowering] = {}


def lower(*targets: Any) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of each target op.

    A target is an OpOverload (``torch.ops.aten.add.Tensor``), an OpOverloadPacket
    (``torch.ops.aten.add``, covering every overload without an entry of its own), or a
    plain Python callable that FX graphs call (``operator.getitem``).
    """

    def register(fn: Lowering) -> Lowering:
        for target in targets:
            LOWERINGS[target] = fn
        return fn

    return register


def lowering_for(target: Any) -> Lowering | None:
    """The lowering registered for an FX node target, else None."""
    fn = LOWERINGS.get(target)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        fn = LOWERINGS.get(target.overloadpacket)
    return fn
