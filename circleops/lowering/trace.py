"""Inlining a Python kernel: trace it with make_fx over Values' shapes and dtypes.

``trace(fn, args, kwargs)`` returns the traced aten graph and the Values that feed its
placeholders; ``LoweringContext.call`` lowers that graph inline through the same registry.
Traces are cached per (fn, shapes/dtypes, baked arguments): the same norm at the same shape
is traced once per process, not once per layer.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx
from torch.utils import _pytree as pytree

from circleops.lowering.registry import lowering_for
from circleops.lowering.value import Value


def trace(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
          decompose: bool = False) -> tuple[torch.fx.GraphModule, list[Value]]:
    """``fn(*args, **kwargs)`` traced to aten ops; Values in the arguments become the graph's
    placeholders (returned in order), every other argument is baked into the trace.

    The trace keeps composite ops whole (linear, matmul: the export's own dialect) unless
    ``decompose``, which traces below them with the core-aten decompositions of ops that
    have no lowering.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Value)]
    key = None
    try:
        key = (fn, decompose, spec, tuple((leaf.shape, leaf.dtype) if isinstance(leaf, Value) else ("py", type(leaf), leaf)
                                          for leaf in leaves))
        hash(key)
    except TypeError:
        key = None
    gm = _TRACES.get(key) if key is not None else None
    if gm is None:
        gm = _trace(fn, leaves, spec, slots, decompose=decompose)
        if key is not None:
            if len(_TRACES) >= _TRACE_CACHE_SIZE:
                _TRACES.pop(next(iter(_TRACES)))
            _TRACES[key] = gm
    return gm, [leaves[i] for i in slots]


# make_fx traces of decompositions, by (fn, argument shapes/dtypes, baked arguments): the
# same norm at the same shape is traced once per process, not once per layer.
_TRACES: dict[Any, torch.fx.GraphModule] = {}
_TRACE_CACHE_SIZE = 256


_FALLBACK_TABLE: dict[Any, Callable[..., Any]] | None = None


def fallback_decompositions() -> dict[Any, Callable[..., Any]]:
    """torch's core-aten decompositions for the ops that have no lowering of their own
    (built on first use, once every lowering module has registered)."""
    global _FALLBACK_TABLE
    if _FALLBACK_TABLE is None:
        from torch._decomp import core_aten_decompositions  # slow import: only when a node needs it

        _FALLBACK_TABLE = {op: fn for op, fn in core_aten_decompositions().items() if lowering_for(op) is None}
    return _FALLBACK_TABLE


def _trace(fn: Callable[..., Any], leaves: list[Any], spec: Any, slots: list[int],
           decompose: bool = False) -> torch.fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    def traced(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        a, k = pytree.tree_unflatten(filled, spec)
        return fn(*a, **k)

    metas = [torch.empty(leaves[i].shape, dtype=leaves[i].dtype, device="meta") for i in slots]
    if decompose:
        gm = make_fx(traced, decomposition_table=fallback_decompositions())(*metas)
    else:
        gm = make_fx(traced, pre_dispatch=True)(*metas)
    if any(_mutates(n) for n in gm.graph.nodes):
        # A kernel writing into a tensor it made (m[0, 1] += 1): the lowering is functional
        # and would drop the write. Functionalized, the write is a new value.
        table = fallback_decompositions() if decompose else None
        gm = make_fx(torch.func.functionalize(traced, remove="mutations_and_views"), decomposition_table=table)(*metas)
    return gm


def _mutates(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)
