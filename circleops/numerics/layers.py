"""A causal LM whose graph also returns each decoder layer's output (its hidden states).

    wrapped = LayerOutputs(model)
    logits, *hidden = wrapped(input_ids)      # hidden[i]: [1, S, E] after decoder layer i

Exported like any module, the per-layer hidden states become extra graph outputs, so
one run of the written file gives the error after every layer. They are taken with
forward hooks that exist only during the call (the model is left as it was).
"""
from __future__ import annotations

import torch
from torch import Tensor

from circleops.errors import CircleOpsError


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """``model.model.layers`` of a Hugging Face *ForCausalLM, or a CircleOpsError."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise CircleOpsError(
            f"{type(model).__name__} has no decoder layers at model.model.layers: the numerics check takes a "
            "Hugging Face *ForCausalLM (Llama, Mistral, Qwen2/3, Phi3, OLMo2, Gemma 1/2/3).")
    return layers


class LayerOutputs(torch.nn.Module):
    """``forward(input_ids) -> (logits, hidden_0, ..., hidden_{L-1})``, no KV cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.num_layers = len(decoder_layers(model))

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        captured: list[Tensor] = []

        def keep(module, args, output):
            captured.append(output[0] if isinstance(output, (tuple, list)) else output)

        handles = [layer.register_forward_hook(keep) for layer in decoder_layers(self.model)]
        try:
            logits = self.model(input_ids=input_ids, use_cache=False, return_dict=True).logits
        finally:
            for h in handles:
                h.remove()
        return (logits, *captured)
