"""Graph helpers the passes share."""
from __future__ import annotations

import copy

import torch.fx


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A deep copy of ``graph`` whose nodes keep their names.

    ``copy.deepcopy`` of an FX graph renames nodes whose name shadows a Python builtin
    (a ``forward(self, input)`` placeholder becomes ``input_1``), which breaks the
    ExportedProgram's signature (it names placeholders): restore each original name.
    """
    new = copy.deepcopy(graph)
    namespace = new._graph_namespace
    for old, node in zip(graph.nodes, new.nodes):
        if node.name != old.name:
            # torch.export itself names placeholders this way; the name is free in the copy
            # because the copy holds exactly the original's names
            namespace._used_names.add(old.name)
            namespace._obj_to_name[node] = old.name
            node.name = old.name
    return new
