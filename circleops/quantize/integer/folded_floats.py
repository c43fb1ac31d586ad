"""What the converted PT2E graphs still read, so that the float weights PT2E folded into integers can be given back.

convert_pt2e replaces a weight it quantizes by an integer buffer (circleops.quantize.integer.shared),
but the converted module still registers the float parameter (no ``get_attr`` reads it), so
does the program exported from it (a placeholder without users), and the model holds it until
the conversion's restore closes (after verify). With the Hadamard rotation at the Llama-3.2-1B
shape those are the rotated embedding (1.05 GB of written pages of the checkpoint's mapping)
and the untied lm_head (a 1.05 GB clone), resident through the lowering, the write and verify's
torch runs for nothing (issue 32). :func:`read_storages` is what every graph still reads;
circleops.quantize.rotate.release_unread gives back the rotated copies of the rest (nothing a
graph or its program reads is touched, so the written file is the same).
"""
from __future__ import annotations

import functools
from typing import Any, Iterable

import torch


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def read_storages(converted: Iterable[Any], programs: Iterable[Any]) -> set[int]:
    """The storages the converted modules' ``get_attr`` nodes and the programs' used
    placeholders (parameters, buffers, constants) read."""
    used: set[int] = set()
    for module in converted:
        for node in module.graph.nodes:
            if node.op == "get_attr":
                value = functools.reduce(getattr, node.target.split("."), module)
                if isinstance(value, torch.Tensor):
                    used.add(_ptr(value))
    for ep in programs:
        read = {n.name for n in ep.graph.nodes if n.op == "placeholder" and n.users}
        for spec in ep.graph_signature.input_specs:
            if spec.target is None or getattr(spec.arg, "name", None) not in read:
                continue
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if isinstance(value, torch.Tensor):
                used.add(_ptr(value))
    return used
