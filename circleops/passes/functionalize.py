"""Functionalization: in-place, ``out=`` and ``*_copy`` overloads become their functional
forms before lowering, so that lowerings stay one per functional op.

    ep = functionalize(ep)      # the same program when it has none of them (the usual case)

torch.export's default IR keeps a module's in-place ops (``scores /= sqrt(d)`` is
``aten.div_.Tensor``, ``x[:, 0] = v`` a ``copy_`` into a ``select`` view, ``torch.sub(...,
out=buf)`` ``aten.sub.out``). Two ways out, cheapest first:

* Local rewrite: each mutating node becomes its functional overload (``add_.Tensor`` ->
  ``add.Tensor``, ``sub.out`` -> ``sub.Tensor``, ``copy_`` -> ``copy``, found from the
  schema, not from a table), and every later use of the mutated tensor reads the new
  node. Exact when the mutated tensor has no live view: nothing else can observe the write.
* Otherwise (a write through a view, or a view taken before a later write):
  ``ep.run_decompositions({})``, torch's own functionalization (views become
  ``select_scatter``/``slice_scatter``...), paid only by programs that need it.

Then ``*_copy`` view variants (``slice_copy``, ``select_copy``, ``alias_copy``, ...) become
their view ops: in a functional graph a copy and a view hold the same values.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Graph, GraphModule, Node

from circleops.passes._graph import copy_graph

aten = torch.ops.aten
_OpOverload = torch._ops.OpOverload


def _mutated_args(op: Any) -> list[int]:
    """Positions (in the schema's argument list) of the arguments ``op`` writes."""
    if not isinstance(op, _OpOverload):
        return []
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _is_view(op: Any) -> bool:
    """Whether ``op``'s result may alias an input (select, view, reshape, to, ...)."""
    if not isinstance(op, _OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


def _arg_key(a: Any) -> tuple:
    return a.name, str(a.type), a.kwarg_only


def _functional_overload(op: _OpOverload) -> Optional[_OpOverload]:
    """The functional overload computing what ``op`` writes: ``add_.Tensor`` -> ``add.Tensor``,
    ``sub.out`` -> ``sub.Tensor``, ``copy_`` -> ``copy``; None if torch has none."""
    schema = op._schema
    name = schema.name.split("::")[-1]
    writes = set(_mutated_args(op))
    if name.endswith("_") and not name.endswith("__"):
        packet = getattr(aten, name[:-1], None)
        want = [_arg_key(a) for a in schema.arguments]
        n_returns = len(schema.returns)
    else:  # out= variant: the same name, the arguments without the outputs
        packet = getattr(aten, name, None)
        want = [_arg_key(a) for i, a in enumerate(schema.arguments) if i not in writes]
        n_returns = len(writes)
    if packet is None:
        return None
    own = schema.overload_name or "default"
    candidates = [own] + [o for o in packet.overloads() if o != own]
    for overload in candidates:
        cand = getattr(packet, overload, None)
        if cand is None or _mutated_args(cand) or len(cand._schema.returns) != n_returns:
            continue
        if [_arg_key(a) for a in cand._schema.arguments] == want:
            return cand
    return None


def _as_call(op: _OpOverload, node: Node) -> tuple[list[Any], dict[str, Any]]:
    """The node's arguments by schema position (args and kwargs merged)."""
    values = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(node.args):
            values.append(node.args[i])
        elif a.name in node.kwargs:
            values.append(node.kwargs[a.name])
        else:
            values.append(_MISSING)
    return values, {}


_MISSING = object()


def _fake_eval(op: Any, args: list, kwargs: dict) -> Any:
    """``op`` on the arguments' fake values (None if there is no fake mode to run in)."""
    from torch._guards import detect_fake_mode

    a, k = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta.get("val"))
    mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves((a, k)) if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return op(*a, **k)


def _synced(ep: torch.export.ExportedProgram, graph: Graph) -> torch.export.ExportedProgram:
    """``ep`` with ``graph``; output specs renamed to the output node's arguments (a user
    input's mutation is returned by the node that now computes it)."""
    import copy

    signature = copy.deepcopy(ep.graph_signature)
    outs = torch.utils._pytree.tree_leaves(graph.output_node().args)
    for spec, arg in zip(signature.output_specs, outs):
        if isinstance(arg, Node) and hasattr(spec.arg, "name") and spec.arg.name != arg.name:
            spec.arg = type(spec.arg)(name=arg.name)
    return ep._update(GraphModule(ep.graph_module, graph), signature)


def _needs_torch_functionalization(graph: Graph) -> bool:
    """True when some write is visible through a view (the local rewrite would be wrong)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    root: dict[Node, Node] = {}  # in-place result / out= result -> the tensor it wrote
    last_write: dict[Node, int] = {}
    for n in graph.nodes:
        for i in _mutated_args(n.target):
            args, _ = _as_call(n.target, n)
            t = args[i]
            if not isinstance(t, Node):
                return True
            r = root.get(t, t)
            if r.op == "call_function" and _is_view(r.target):
                return True  # a write through a view: its base changes too
            last_write[r] = order[n]
            root[n] = r
    members: dict[Node, list[Node]] = {}
    for m, r in root.items():
        members.setdefault(r, [r]).append(m)
    for r, ms in members.items():
        for m in ms:
            for u in m.users:
                if u.op == "call_function" and _is_view(u.target) and order[u] < last_write[r]:
                    return True  # a view taken before a later write sees that write
    return False


def _rewrite_locally(graph: Graph) -> bool:
    """Replace each mutating node by its functional overload (see the module docstring);
    False (graph unusable) if some op has no functional overload."""
    current: dict[Node, Node] = {}  # a written tensor (or an alias of it) -> its latest value
    for n in list(graph.nodes):
        if current:
            n.args = torch.fx.node.map_arg(n.args, lambda a: current.get(a, a))
            n.kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: current.get(a, a))
        writes = _mutated_args(n.target)
        if not writes:
            continue
        op = n.target
        func = _functional_overload(op)
        if func is None:
            return False
        values, _ = _as_call(op, n)
        schema = op._schema
        in_place = not schema.arguments[writes[0]].kwarg_only
        keep = range(len(values)) if in_place else [i for i in range(len(values)) if i not in writes]
        args, kwargs = [], {}
        for i in keep:
            a, v = schema.arguments[i], values[i]
            if v is _MISSING:
                continue
            if a.kwarg_only:
                kwargs[a.name] = v
            else:
                args.append(v)
        with graph.inserting_before(n):
            f = graph.call_function(func, tuple(args), kwargs)
        f.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        val = _fake_eval(func, args, kwargs)
        want = n.meta.get("val")
        f.meta["val"] = want if val is None else val
        outs = [f]
        if len(writes) > 1:
            with graph.inserting_after(f):
                outs = [graph.call_function(operator.getitem, (f, k)) for k in range(len(writes))]
            for k, g in enumerate(outs):
                g.meta["val"] = want[k] if isinstance(want, (tuple, list)) else None
        elif isinstance(want, torch.Tensor) and isinstance(val, torch.Tensor) and val.dtype != want.dtype:
            # an in-place op keeps the written tensor's dtype (x_fp16.add_(y_fp32) stays fp16)
            with graph.inserting_after(f):
                cast = graph.call_function(aten._to_copy.default, (f,), {"dtype": want.dtype})
            cast.meta.update(f.meta)
            cast.meta["val"] = want
            outs = [cast]
        for k, i in enumerate(writes):
            written = values[i]
            current[written] = outs[k]
            for alias, latest in list(current.items()):
                if latest is written:
                    current[alias] = outs[k]
        n.replace_all_uses_with(outs[0] if len(outs) == 1 else f)
        current[n] = outs[0] if len(outs) == 1 else f
        graph.erase_node(n)
    return True


def _copy_variants_to_views(graph: Graph) -> bool:
    """``slice_copy`` -> ``slice`` and the like (same arguments); True if any changed."""
    changed = False
    for n in graph.nodes:
        op = n.target
        if n.op != "call_function" or not isinstance(op, _OpOverload):
            continue
        name = op._schema.name.split("::")[-1]
        if not name.endswith("_copy") or op._schema.overload_name == "out":
            continue
        packet = getattr(aten, name[: -len("_copy")], None)
        view = getattr(packet, op._schema.overload_name or "default", None) if packet is not None else None
        if view is not None and [_arg_key(a) for a in view._schema.arguments] == \
                [_arg_key(a) for a in op._schema.arguments]:
            n.target = view
            changed = True
    return changed


def has_mutations(ep: torch.export.ExportedProgram) -> bool:
    return any(n.op == "call_function" and _mutated_args(n.target) for n in ep.graph.nodes)


def functionalize(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` with no in-place / out= / ``*_copy`` nodes (``ep`` itself when it has none)."""
    graph = ep.graph
    if has_mutations(ep):
        if _needs_torch_functionalization(graph):
            ep = ep.run_decompositions({})
            graph = ep.graph
        else:
            graph = copy_graph(graph)
            if not _rewrite_locally(graph):
                ep = ep.run_decompositions({})
                graph = ep.graph
            else:
                graph.eliminate_dead_code()
                ep = _synced(ep, graph)
                graph = ep.graph
    if any(n.op == "call_function" and isinstance(n.target, _OpOverload)
           and n.target._schema.name.endswith("_copy") for n in graph.nodes):
        graph = copy_graph(graph)
        if _copy_variants_to_views(graph):
            ep = _synced(ep, graph)
    return ep


__all__ = ["functionalize", "has_mutations"]
