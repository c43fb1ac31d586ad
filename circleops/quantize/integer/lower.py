"""The integer pass: a lowered PT2E graph (float ops + QUANTIZE markers, see
circleops.quantize.integer.markers) becomes an integer graph, by the passes of
circleops.quantize.integer.passes in this order (each module shows its BEFORE and AFTER):

1. ``fold_markers``: each QUANTIZE marker folds into the op producing its input: that op
   writes the integer tensor directly (a constant is quantized in place).
2. ``propagate``: parameters flow through ops that only move data (RESHAPE, TRANSPOSE,
   slices, GATHER, padding, max-pool): the lowering's own intermediates (an FC's 2-D output
   before its reshape, a conv's NHWC output before its transpose) get their neighbour's
   parameters. LOGISTIC / TANH / SOFTMAX outputs the torch graph did not observe (the
   sigmoid inside silu) get TFLite's fixed parameters (1/256, 1/32768 ...).
3. ``fuse_activations``: an integer RELU / RELU6 folds into the op before it.
4. ``integer_ops``: an op whose float tensors are all quantized now becomes an integer op;
   its constant inputs are quantized (weights with their PT2E parameters, FC/conv biases as
   int32 with scale s_in · s_w). Any other op stays float, with DEQUANTIZE / QUANTIZE at its edges.
5. ``drop_identity_requantize``; then the target's kernel rules (circleops.targets'
   ``quantized_*`` fields): ``fixed_outputs``, ``same_params``, ``neg_as_sub``,
   ``narrow_mean_squares``, ``rsqrt_ranges``, ``uint8_as_int8``; ``check_target``.
6. ``boundaries``: the graph's float inputs get a QUANTIZE and its quantized outputs a
   DEQUANTIZE (or, with ``integer_io``, the file's inputs and outputs are the integer tensors).
"""
from __future__ import annotations

from typing import Any

from circleops import ir
from circleops.quantize.integer import markers as _markers  # noqa: F401  (registers the marker lowerings)
from circleops.quantize.integer.graph import Graph, quantize_array  # noqa: F401  (quantize_array: public here too)
from circleops.quantize.integer.passes.boundaries import boundaries
from circleops.quantize.integer.passes.check_target import check_target
from circleops.quantize.integer.passes.drop_identity_requantize import drop_identity_requantize
from circleops.quantize.integer.passes.fixed_outputs import fixed_outputs
from circleops.quantize.integer.passes.fold_markers import fold_markers
from circleops.quantize.integer.passes.fuse_activations import fuse_activations
from circleops.quantize.integer.passes.integer_ops import integer_ops
from circleops.quantize.integer.passes.narrow_mean_squares import narrow_mean_squares
from circleops.quantize.integer.passes.neg_as_sub import neg_as_sub
from circleops.quantize.integer.passes.propagate import propagate
from circleops.quantize.integer.passes.rsqrt_ranges import rsqrt_ranges
from circleops.quantize.integer.passes.same_params import same_params
from circleops.quantize.integer.passes.uint8_as_int8 import uint8_as_int8
from circleops.quantize.integer.qdq import QuantPlan
from circleops.targets import TargetProfile, profile


def integerize(model: ir.Model, plan: QuantPlan, target: str | TargetProfile = "circle") -> None:
    """Turn the lowered PT2E graph ``model`` into an integer graph, in place (see module doc)."""
    sg = model.subgraphs[0]
    g = Graph(sg)
    fold_markers(g)
    propagate(g)
    fuse_activations(g)
    integer_ops(g, plan, target)
    drop_identity_requantize(g)
    p = profile(target)
    if p.quantized_fixed_outputs:
        fixed_outputs(g)
    if p.quantized_same_params:
        same_params(g, p.quantized_same_params)
    if p.quantized_neg_raw:
        neg_as_sub(g)
    if p.quantized_mean_square_narrow > 1:
        narrow_mean_squares(g, p.quantized_mean_square_narrow)
    if p.quantized_rsqrt_ranges > 1:
        rsqrt_ranges(g, p.quantized_rsqrt_ranges)
    if p.quantized_uint8_as_int8:
        uint8_as_int8(sg)
    check_target(sg, target)
    boundaries(model, sg, plan.integer_io)
    ir.prune(sg)  # the signature lists the subgraph's inputs and outputs, in order
    for sig in model.signatures:
        if sig.subgraph_index == 0:
            sig.inputs = dict(zip(sig.inputs, sg.inputs))
            sig.outputs = dict(zip(sig.outputs, sg.outputs))


def lower_quantized(ep: Any, target: str, *, dtype: Any = None, integer_io: bool = False) -> ir.Model | None:
    """Lower a converted PT2E program (quantize/dequantize pairs) to an integer ir.Model;
    None when ``ep`` holds no quantized_decomposed ops (lower it as a float program)."""
    from circleops.errors import TargetError
    from circleops.lowering.program import lower_program
    from circleops.quantize.integer.qdq import fold_qdq

    program, plan = fold_qdq(ep, integer_io=integer_io)
    if plan is None:
        return None
    if not profile(target).integer_graphs:
        raise TargetError(f"integer (PT2E) graphs are written for targets circle and onert; target "
                          f"{profile(target).name} writes composites with float decompositions. Use --target circle.")
    model = lower_program(program, target, dtype=dtype)
    integerize(model, plan, target)
    return model
