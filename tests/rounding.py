"""Error bounds from the computation's depth: how many times a value is rounded on its way
to the output (docs/testing.md, "Tolerances from the format and the depth")."""
from __future__ import annotations

import torch


def pt2e_rounding_depth(graph: torch.fx.Graph) -> int:
    """The most activation roundings (quantize nodes) on one path of a PT2E (fake-quantized)
    graph. Two implementations of the graph (torch's float fake-quant, a fixed-point kernel
    set) may round a value on a boundary differently at each of them: passed on at unit gain,
    their outputs differ by at most this many output steps (times each kernel's own
    per-op deviation)."""
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    depth: dict = {}
    for n in graph.nodes:
        d = max((depth[a] for a in n.all_input_nodes), default=0)
        depth[n] = d + (n.op == "call_function" and n.target == quantize)
    return max(depth.values(), default=0)
