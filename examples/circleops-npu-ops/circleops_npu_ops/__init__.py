"""An NPU vendor's own ops for circleops: ``npu::swiglu`` and ``npu::gelu_tanh``.

Each op is one ``@circleops.op``: the schema, the reference kernel in aten ops, the fake.
circleops then writes them for every target with no more code:

* circle: a CUSTOM op, custom_code ``NPU_SWIGLU`` / ``npu::gelu_tanh`` (the qualified name
  by default), custom_options = a flexbuffer map of the non-tensor arguments (``alpha``);
* onert (no custom kernels): the reference kernel's aten ops;
* tflite: STABLEHLO_COMPOSITE ``npu.swiglu`` / ``npu.gelu_tanh`` with the decomposition.

The module adapters (:mod:`circleops_npu_ops.adapters`) route model code to these ops.
"""
from __future__ import annotations

import math

import torch

import circleops

__all__ = ["swiglu", "gelu_tanh", "sample_swiglu", "sample_gelu_tanh"]


@circleops.op("npu::swiglu(Tensor x, float alpha=1.0) -> Tensor", custom_code="NPU_SWIGLU")
def swiglu(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """SwiGLU over the last dim: ``silu(alpha * a) * b`` with ``a, b = x.chunk(2, -1)``
    (the gate half first, as a fused gate_up projection lays them out)."""
    a, b = x.chunk(2, -1)
    return torch.nn.functional.silu(a * alpha) * b


@swiglu.register_fake
def _(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    torch._check(x.shape[-1] % 2 == 0, lambda: f"npu::swiglu: the last dim must be even, got {x.shape[-1]}")
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


@circleops.op("npu::gelu_tanh(Tensor x) -> Tensor", autocast="none")
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation: ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``, computed in
    fp32 for fp16/bf16 input (as the NPU does) and cast back."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    y = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h * h * h)))
    return y.to(x.dtype)


@gelu_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def sample_swiglu(dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    """(args, kwargs) pairs for circleops.testing.check_op."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, generator=g).to(dtype)
    return [((x,), {}), ((x,), {"alpha": 1.702}), ((x[0],), {"alpha": 0.5})]


def sample_gelu_tanh(dtype: torch.dtype) -> list[tuple[tuple, dict]]:
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(2, 5, 16, generator=g).mul(3).to(dtype),), {})]
