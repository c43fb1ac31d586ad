"""The RMSNorm replacement: one circle.rms_norm per HF RMSNorm module call.

The HF variants differ only in where the eps lives, whether the weight is stored as an
offset from 1, and whether the weight multiply happens before or after the cast back to
the input dtype; a :class:`NormStyle` row says which, and circle.rms_norm reproduces each
bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)

from circleops.adapters._patching import mark_ran


@dataclass(frozen=True)
class NormStyle:
    eps_attr: str  # attribute of the module holding eps
    offset: float  # added to the weight before the multiply (1.0 for Gemma)
    multiply: str  # "input_dtype" (Llama) or "fp32" (OLMo2, Gemma)


# Llama, Mistral, Qwen2/3, Phi3: normalize in fp32, cast, then weight * y
LLAMA = NormStyle("variance_epsilon", 0.0, "input_dtype")
# OLMo2: weight * y in fp32, then cast
OLMO2 = NormStyle("variance_epsilon", 0.0, "fp32")
# Gemma 1/2/3: y * (1 + weight) in fp32, then cast
GEMMA = NormStyle("eps", 1.0, "fp32")


def norm_forward(style: NormStyle, label: str) -> Callable[..., Any]:
    """A ``forward(self, hidden_states)`` computing the module with circle.rms_norm."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mark_ran(label)
        eps = float(getattr(self, style.eps_attr))
        return torch.ops.circle.rms_norm(hidden_states, self.weight, eps, style.offset, style.multiply, "fp32")

    forward.__name__ = "forward"
    forward.__qualname__ = f"{label}.forward[circle.rms_norm]"
    return forward
