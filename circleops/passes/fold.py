"""Constant folding: what does not depend on the user's inputs is computed once, in torch.

In an exported HF decoder the causal mask, the RoPE cos/sin tables, position ids and all
shape arithmetic depend only on parameters, buffers and shapes. They become constants, and
the nodes nothing reaches from the outputs (dead code, ``_assert_tensor_metadata``) go.

Two entry points share the rules below:
* circleops.lowering folds *during* the walk (the fast path used by convert: no second
  pass over the graph, and a folded value that only feeds other folded values never
  reaches the file);
* ``fold_constants(ep)`` is the same as a standalone ExportedProgram -> ExportedProgram
  pass (folded values become lifted constants), for tools that want the folded program.
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec,
                                          TensorArgument)
from torch.utils import _pytree as pytree

from circleops.passes._graph import copy_graph

_CONST_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def is_foldable(node: torch.fx.Node) -> bool:
    """Whether ``node`` may be evaluated at conversion time when its inputs are constants:
    a pure, deterministic op (no mutation, no random numbers)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return True


def evaluate(target: Any, args: Any, kwargs: dict) -> Any:
    """Run ``target`` on real tensors (on CPU: traced decompositions say device='meta')."""
    if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
        kwargs = {**kwargs, "device": torch.device("cpu")}
    with torch.no_grad():
        return target(*args, **kwargs)


def live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes the graph's output depends on (placeholders are always kept)."""
    live: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("output", "placeholder") or node in live:
            live.add(node)
            live.update(node.all_input_nodes)
    return live


def fold_constants(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A new ExportedProgram in which every input-independent value that feeds the rest of
    the graph is a lifted constant (``InputKind.CONSTANT_TENSOR`` named ``_folded_<node>``),
    dead nodes are removed, and parameters/buffers nothing uses any more are dropped.
    The original program is left unchanged."""
    gm = torch.fx.GraphModule(ep.graph_module, copy_graph(ep.graph))
    graph = gm.graph
    specs = list(ep.graph_signature.input_specs)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values: dict[torch.fx.Node, Any] = {}
    for spec, node in zip(specs, placeholders):
        if spec.kind in _CONST_KINDS:
            values[node] = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
    live = live_nodes(graph)
    for node in graph.nodes:
        if node not in live or not is_foldable(node):
            continue
        if not all(n in values for n in node.all_input_nodes):
            continue
        args, kwargs = pytree.tree_map_only(torch.fx.Node, values.__getitem__, (node.args, node.kwargs))
        values[node] = evaluate(node.target, args, kwargs)

    constants = dict(ep.constants)
    first_user_input = next((n for s, n in zip(specs, placeholders) if s.kind not in _CONST_KINDS), None)
    new_specs: list[tuple[torch.fx.Node, InputSpec]] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node not in values or not isinstance(values[node], torch.Tensor):
            continue
        if all(u in values for u in node.users if u.op != "output") and "output" not in {u.op for u in node.users}:
            continue  # only feeds other folded nodes
        name = f"_folded_{node.name}"
        if first_user_input is not None:
            with graph.inserting_before(first_user_input):
                ph = graph.placeholder(name)
        else:
            with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
                ph = graph.placeholder(name)
        ph.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
        node.replace_all_uses_with(ph)
        constants[name] = values[node].detach().contiguous()
        new_specs.append((ph, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(name), target=name)))

    live = live_nodes(graph)
    for node in reversed(list(graph.nodes)):
        if node.op not in ("placeholder", "output") and node not in live:
            graph.erase_node(node)

    # Rebuild the input specs in placeholder order; drop constant inputs nothing uses.
    spec_of = dict(zip(placeholders, specs))
    spec_of.update(dict(new_specs))
    input_specs, state_dict = [], {}
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        spec = spec_of[node]
        if spec.kind in _CONST_KINDS and not node.users:
            graph.erase_node(node)
            continue
        input_specs.append(spec)
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in ep.state_dict:
            state_dict[spec.target] = ep.state_dict[spec.target]
    used = {s.target for s in input_specs}
    constants = {k: v for k, v in constants.items() if k in used}
    graph.lint()
    gm.recompile()
    signature = ExportGraphSignature(input_specs=input_specs, output_specs=list(ep.graph_signature.output_specs))
    return torch.export.ExportedProgram(
        root=gm, graph=graph, graph_signature=signature, state_dict=state_dict,
        range_constraints=ep.range_constraints, module_call_graph=copy.deepcopy(ep.module_call_graph),
        example_inputs=ep.example_inputs, constants=constants, verifiers=ep.verifiers)
