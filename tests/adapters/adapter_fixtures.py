"""Shared, cached models and reference results for tests/adapters and tests/fusion."""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import torch

from families import BY_NAME, example_ids

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# fused attention reorders the score/value matmuls (caches, GQA expansion); decomposed
# norm and rope must be bit-equal
ATTENTION_TOL = {"fp32": 1e-5, "bf16": 4e-2, "fp16": 1e-2}


@dataclass(frozen=True)
class Built:
    model: torch.nn.Module
    ids: torch.Tensor
    logits: torch.Tensor  # the unpatched HF model's
    norm_calls: int  # RMSNorm module calls in one forward (q/k norms included)
    layers: int


# config variants of a family: name -> config overrides
VARIANTS = {
    "": {},
    "partial_rotary": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    "sliding_window": {"sliding_window": 4},  # shorter than the 8-token sequence: the window masks
}


@functools.cache
def built(name: str, dtype: str = "fp32", variant: str = "") -> Built:
    """A 2-layer random model of the family, with its HF logits for example_ids() (seq 8)."""
    from circleops.adapters import BY_NAME as ADAPTERS

    model = BY_NAME[name].build(DTYPES[dtype], **VARIANTS[variant])
    norm_classes = set(ADAPTERS[name].norm_classes)
    calls = Counter()
    hooks = [m.register_forward_hook(lambda mod, i, o: calls.update([1]))
             for m in model.modules() if type(m).__name__ in norm_classes]
    ids = example_ids()
    with torch.no_grad():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    return Built(model, ids, logits, sum(calls.values()), model.config.num_hidden_layers)


def circle_counts(ep: torch.export.ExportedProgram) -> Counter:
    """circle op name -> number of nodes in the exported graph."""
    from circleops.ops import by_overload

    return Counter(spec.name for n in ep.graph.nodes if n.op == "call_function"
                   and (spec := by_overload(n.target)) is not None)


def logits_of(ep: torch.export.ExportedProgram, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = ep.module()(ids)
    return out.logits if hasattr(out, "logits") else out[0]
