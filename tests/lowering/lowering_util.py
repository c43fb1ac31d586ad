"""Shared, cached exports for the lowering and onert tests (one export per process and case)."""
from __future__ import annotations

import functools
from collections import Counter

import torch

from circleops import ir
from families import BY_NAME, example_ids

SEQ = 8


class Logits(torch.nn.Module):
    """An HF CausalLM as ids -> logits (the graph's one output)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


class DecodeStep(torch.nn.Module):
    """One token at an explicit position: ids [1, 1], position_ids [1, 1] -> logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, position_ids):
        return self.model(input_ids=ids, position_ids=position_ids).logits


@functools.lru_cache(maxsize=None)
def family_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return BY_NAME[name].build(dtype=dtype)


@functools.lru_cache(maxsize=None)
def family_program(name: str, fused: str = "none", dtype: torch.dtype = torch.float32,
                   seq: int = SEQ) -> torch.export.ExportedProgram:
    """The family's small model exported as ids -> logits.

    fused: "none" (plain HF graph), "norms" (circle.rms_norm + circle.rope via the
    adapters) or "all" (attention too, where the family's attention is fusable).
    """
    model = Logits(family_model(name, dtype))
    ids = example_ids(seq)
    if fused == "none":
        return torch.export.export(model, (ids,), strict=False)
    from circleops.adapters import patched_modules

    with patched_modules(attention=fused == "all"):
        return torch.export.export(model, (ids,), strict=False)


@functools.lru_cache(maxsize=None)
def lowered(name: str, fused: str, target: str, dtype: torch.dtype = torch.float32) -> ir.Model:
    from circleops.lowering import lower_program

    return lower_program(family_program(name, fused, dtype), target)


@functools.lru_cache(maxsize=None)
def reference_logits(name: str, dtype: torch.dtype = torch.float32, seq: int = SEQ) -> torch.Tensor:
    with torch.no_grad():
        return family_model(name, dtype)(input_ids=example_ids(seq)).logits


def opcodes(model: ir.Model, subgraph: int = 0) -> Counter:
    return Counter(op.opcode for op in model.subgraphs[subgraph].operators)


def norm_count(model: torch.nn.Module) -> int:
    """How many RMSNorm modules (layer norms and q/k norms) the HF model has."""
    return sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
