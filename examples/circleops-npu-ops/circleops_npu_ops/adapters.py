"""Route model code to the NPU ops during export, with circleops' public patching.

    from circleops_npu_ops.adapters import SwiGLU, patched_npu_modules
    with patched_npu_modules():
        circleops.convert(model, (x,), "model.circle")

:class:`SwiGLU` is this package's own gated MLP activation module (a fused gate_up
projection's output in, the gated half out); ``transformers.activations.GELUTanh`` (Gemma's
``gelu_pytorch_tanh``) is routed to ``npu::gelu_tanh`` when transformers is installed.
"""
from __future__ import annotations

import torch

import circleops
import circleops.adapters
import circleops_npu_ops  # noqa: F401  (defines torch.ops.npu.*)


class SwiGLU(torch.nn.Module):
    """``silu(alpha · a) · b`` of the two halves of the last dim, in plain torch ops (so the
    model runs anywhere); exported inside :func:`patched_npu_modules` it is one npu::swiglu."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a * self.alpha) * b


def _swiglu_forward(self: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.npu.swiglu(x, float(self.alpha))


def _gelu_tanh_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.npu.gelu_tanh(x)


def patched_npu_modules(*, transformers: bool = True) -> circleops.adapters.PatchSession:
    """Inside the ``with``, :class:`SwiGLU` runs as npu::swiglu and (``transformers=True``,
    when it is installed) ``transformers.activations.GELUTanh`` as npu::gelu_tanh. Export
    inside it; when none of them ran, circleops warns (UnusedPatchWarning)."""
    forwards = {SwiGLU: _swiglu_forward}
    if transformers:
        try:
            from transformers.activations import GELUTanh
        except ImportError:  # transformers is optional
            GELUTanh = None
        if GELUTanh is not None:
            forwards[GELUTanh] = _gelu_tanh_forward
    return circleops.patch_modules(forwards, name="patched_npu_modules")
