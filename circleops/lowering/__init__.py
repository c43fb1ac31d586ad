"""Lowering: torch.export ExportedProgram -> circleops.ir.Model, per target profile.

    model = lower_program(ep, "onert")

Target profiles (circleops.targets: "circle", "onert", "tflite") differ in how the fused
circle ops are written (Circle builtin, decomposed aten ops, or a STABLEHLO_COMPOSITE with
a decomposition subgraph), in which builtins the runtime executes and on what dtypes and
ranks; lowerings read them as ``ctx.profile.*`` / ``ctx.supports(opcode, dtype)``. Each
aten / circle op has one short lowering function registered with ``@lower(op)``; the
modules below hold them by op group.
"""
from __future__ import annotations

from circleops.lowering.context import LoweringContext, Value
from circleops.lowering.program import lower_program
from circleops.lowering.registry import LOWERINGS, lower, lowering_for

# Importing the op-group modules registers their lowerings.
from circleops.lowering import (circle_ops, conv, dynamic, elementwise, elementwise_math, linalg,  # noqa: E402,F401
                                norm, pool, reduce, resize, scatter, select, shape, views)

__all__ = ["LOWERINGS", "LoweringContext", "Value", "lower", "lower_program", "lowering_for"]
