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
    plain Python callable that FX graphs call (``operator.getitem``). Registering a second
    lowering for the same target raises ValueError.
    """

    def register(fn: Lowering) -> Lowering:
        for target in targets:
            previous = LOWERINGS.get(target)
            if previous is not None and previous is not fn:
                # a second lowering would silently win by import order, and the first
                # one become dead code: say which two collide
                raise ValueError(f"@lower({target}): {_where(fn)} would replace the lowering "
                                 f"{_where(previous)}; an op has one lowering: extend that one")
            LOWERINGS[target] = fn
        return fn

    return register


def _where(fn: Lowering) -> str:
    code = getattr(fn, "__code__", None)
    at = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}{at}"


# Functions target -> lowering or None, asked when no @lower entry exists: the registered
# ops (circleops.op) get their lowering from their OpSpec (lowering.circle_ops), no @lower.
RESOLVERS: list[Callable[[Any], Lowering | None]] = []


def lowering_for(target: Any) -> Lowering | None:
    """The lowering registered for an FX node target, else one a resolver gives, else None."""
    fn = LOWERINGS.get(target)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        fn = LOWERINGS.get(target.overloadpacket)
    if fn is None and isinstance(target, torch._ops.OpOverload):
        for resolve in RESOLVERS:
            fn = resolve(target)
            if fn is not None:
                break
    return fn
