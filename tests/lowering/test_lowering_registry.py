"""The lowering registry and the lowering package's structure: one lowering per op, and
imports that run one way (no cycle hidden by an import inside a function)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import circleops
from circleops.lowering import LOWERINGS, lower, lowering_for

PACKAGE = Path(circleops.__file__).parent


def test_a_second_lowering_for_an_op_is_refused():
    op = torch.ops.aten.rsqrt
    first = LOWERINGS[op]
    with pytest.raises(ValueError, match=r"aten\.rsqrt.*would replace the lowering .*elementwise"):
        @lower(op)
        def _(ctx, node, x):
            return x
    assert LOWERINGS[op] is first and lowering_for(op.default) is first


def test_one_function_may_lower_several_ops_and_be_registered_again():
    fn = LOWERINGS[torch.ops.aten.rsqrt]
    assert lower(torch.ops.aten.rsqrt)(fn) is fn  # the same function again is not a second lowering


def _imports(path: Path) -> set[str]:
    """circleops modules ``path`` imports anywhere (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("circleops.")}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("package", ["lowering", "ops"])
def test_no_import_cycle(package):
    """Module-level and function-level imports among circleops.lowering (resp. .ops) and what
    they import form no cycle. A package's __init__ only gathers its modules: edges into a
    package itself are not counted."""
    paths = {_module(p): p for p in PACKAGE.rglob("*.py")}
    packages = {_module(p) for p in PACKAGE.rglob("__init__.py")}
    graph = {m: {i for i in _imports(p) if i in paths and i not in packages and i != m}
             for m, p in paths.items() if m not in packages}
    start = [m for m in graph if m.startswith(f"circleops.{package}.")]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                if any(c.startswith(f"circleops.{package}.") for c in cycle):
                    pytest.fail("import cycle: " + " -> ".join(cycle))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in start:
        if m not in state:
            visit(m)
