"""Norm policies for an fp16/bf16 graph: how each circle.rms_norm is computed and written.

The adapters export every RMSNorm as ``circle.rms_norm(..., policy="fp32")``; this pass
rewrites the exported graph before lowering, so one export serves every policy:

==============  ==============  =====================================================
name            op policy       written for target circle
==============  ==============  =====================================================
fused           fp32            RMS_NORM builtin (the interpreter runs the registry
                                kernel, policy fp32)
fp32-island     fp32            decomposed: CAST to fp32, the norm's ops, CAST back
scaled          scaled          decomposed, in the graph dtype, on x / 2^ceil(log2 max|x|)
native          native          decomposed, in the graph dtype all the way (what a
                                backend that drops HF's upcast computes)
==============  ==============  =====================================================

The decomposed lowering of an fp32-policy node is forced with the node meta flag
``circleops.lowering.circle_ops.LOWERING_META`` = "decomposed"; scaled and native are
decomposed by the lowering anyway (RMS_NORM has no such modes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from circleops.errors import CircleOpsError


@dataclass(frozen=True)
class NormPolicy:
    """One way to compute and write the RMSNorms of a reduced-precision graph."""

    name: str
    op_policy: str  # circle.rms_norm's ``policy`` attribute
    lowering: str  # "builtin" (the target's choice) or "decomposed" (forced)
    description: str


NORM_POLICIES: dict[str, NormPolicy] = {p.name: p for p in (
    NormPolicy("fused", "fp32", "builtin", "RMS_NORM builtin, computed in fp32"),
    NormPolicy("fp32-island", "fp32", "decomposed", "decomposed, CAST to fp32 and back around the norm"),
    NormPolicy("scaled", "scaled", "decomposed", "decomposed, graph dtype, x pre-scaled by a power of two ~ max|x|"),
    NormPolicy("native", "native", "decomposed", "decomposed, graph dtype all the way (no upcast)"),
)}


def norm_policy(name: str) -> NormPolicy:
    """The policy called ``name``; a CircleOpsError lists the valid names otherwise."""
    try:
        return NORM_POLICIES[name]
    except KeyError:
        raise CircleOpsError(f"unknown norm policy {name!r}: choose from {', '.join(NORM_POLICIES)}.") from None


def rms_norm_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The graph's circle.rms_norm calls, in graph order."""
    target = torch.ops.circle.rms_norm.default
    return [n for n in ep.graph.nodes if n.op == "call_function" and n.target is target]


def set_norm_policy(ep: torch.export.ExportedProgram, policy: NormPolicy | str) -> int:
    """Rewrite every circle.rms_norm of ``ep`` in place to ``policy``; returns how many.

    The op's ``policy`` argument is set (positional or keyword, as the node has it) and the
    lowering flag set or cleared, so calling it again with another policy is safe.
    """
    from circleops.lowering.circle_ops import LOWERING_META

    policy = norm_policy(policy) if isinstance(policy, str) else policy
    nodes = rms_norm_nodes(ep)
    index = [a.name for a in torch.ops.circle.rms_norm.default._schema.arguments].index("policy")
    for node in nodes:
        if len(node.args) > index:
            args = list(node.args)
            args[index] = policy.op_policy
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "policy": policy.op_policy}
        if policy.lowering == "decomposed":
            node.meta[LOWERING_META] = "decomposed"
        else:
            node.meta.pop(LOWERING_META, None)
    ep.graph_module.recompile()
    return len(nodes)
