"""Ops whose result shape or Python value depends on the data: a static Circle graph cannot
hold them unless their input is a constant (then they fold). Each refusal says so and
what to write instead."""
from __future__ import annotations

import torch

from circleops.lowering.registry import lower

aten = torch.ops.aten


@lower(aten.item, aten._local_scalar_dense)
def _(ctx, node, x):
    if x.is_const:
        return x.const.item()
    raise ctx.unsupported(
        "reads a tensor's value into Python (.item(), int(t), a data-dependent branch or size), which a "
        "static graph cannot do",
        "Keep the value a tensor (torch.where instead of an if, fixed sizes), or make it a constant of the model.")


@lower(aten.nonzero, aten.argwhere, aten.masked_select, aten._unique2, aten.unique_consecutive, aten.unique_dim)
def _(ctx, node, x, *args, **kwargs):
    if getattr(x, "is_const", False) and node.target is aten.nonzero.default:
        return ctx.const(torch.nonzero(x.const))
    raise ctx.unsupported(
        f"calls {node.target}, whose output size depends on the data (static Circle shapes cannot hold it)",
        "Write it with a fixed size: a mask and torch.where instead of nonzero/masked_select (for "
        "mixture-of-experts routing, circleops dispatches every expert densely when the experts class uses "
        "transformers' use_experts_implementation).")
