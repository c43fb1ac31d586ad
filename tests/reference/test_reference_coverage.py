"""Every opcode the lowering can emit has an interpreter kernel, and every kernel is a real opcode.

circleops.lowering writes opcodes as string literals (``ctx.emit("CONV_2D", ...)``,
``ctx.unary("RSQRT", x)``, op tables) and the fused builtins from schema/ops.yaml; this
collects both, so a new lowering that emits an opcode the interpreter lacks fails here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import circleops.lowering
from circleops.ops import BUILTINS, REGISTRY
from circleops.runtime.kernels import KERNELS


def _schema_opcodes() -> set[str]:
    import ai_edge_litert.schema_py_generated as tfl
    from circle_schema import circle

    names = {n for n in vars(circle.BuiltinOperator.BuiltinOperator) if n.isupper()}
    return names | {n for n in vars(tfl.BuiltinOperator) if n.isupper()}


def _lowering_opcodes(opcodes: set[str]) -> set[str]:
    found = set()
    for path in Path(circleops.lowering.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in opcodes:
                found.add(node.value)
    return found | {REGISTRY[name].circle["builtin"] for name in BUILTINS}


def test_every_opcode_the_lowering_emits_has_a_kernel():
    """A kernel of its own, or (a fused op's Circle builtin) its op's reference kernel run by
    circleops.runtime.kernels.fused.registered_builtin."""
    from circleops.runtime.kernels.fused import registered_builtin

    emitted = _lowering_opcodes(_schema_opcodes())
    assert len(emitted) > 30, "the scan found too few opcodes: has the lowering changed how it names them?"
    missing = sorted(o for o in emitted - set(KERNELS) if registered_builtin(o) is None)
    assert not missing, f"the lowering emits {missing} but circleops/runtime/kernels has no kernel for them"


def test_every_kernel_is_a_schema_opcode():
    unknown = sorted(set(KERNELS) - _schema_opcodes())
    assert not unknown, f"kernels registered under names no schema has: {unknown}"
