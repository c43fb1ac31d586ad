"""Mixture-of-experts blocks as static graphs: dense dispatch.

transformers 5 writes every MoE family's experts (Mixtral, Qwen2/3-MoE, GraniteMoE,
DeepSeek-V3, gpt-oss, ...) as one class decorated with ``use_experts_implementation``:
3-D weight tensors ``gate_up_proj [E, 2I, H]`` (or ``up_proj``), ``down_proj [E, H, I]``
(transposed in gpt-oss), optional biases, a gate function (``_apply_gate``) and optional
post-expert norm; ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
Its eager forward loops over ``nonzero()`` experts and ``torch.where`` token lists: shapes
that depend on the routing, which a static Circle graph cannot hold.

Dense dispatch computes every expert on every token and weights each result by the
routing weight, zero for the experts a token did not pick: the same sum as the sparse
dispatch (the unpicked terms are exact zeros), with static shapes. The first projection
of all experts is one ``linear`` over the experts' stacked weights; the second is one
batched matmul over the experts.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from circleops.adapters._patching import mark_ran


def dense_experts_forward(label: str) -> Callable[..., Any]:
    """A ``forward(self, hidden_states, top_k_index, top_k_weights)`` for an HF experts class."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor = None,
                top_k_weights: torch.Tensor = None, **kwargs: Any) -> torch.Tensor:
        mark_ran(label)
        if top_k_index is None:  # gpt-oss names them router_indices / routing_weights
            top_k_index, top_k_weights = kwargs["router_indices"], kwargs["routing_weights"]
        return dense_experts(self, hidden_states, top_k_index, top_k_weights)

    forward.__name__ = "forward"
    forward.__qualname__ = f"{label}.forward[dense experts]"
    return forward


def _stacked(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """[E, out, in] whatever the storage ([E, in, out] when ``transposed``)."""
    return weight.transpose(1, 2) if transposed else weight


def dense_experts(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero where not picked)."""
    tokens, hidden = hidden_states.shape
    experts = module.num_experts
    transposed = getattr(module, "is_transposed", False)
    has_gate = getattr(module, "has_gate", True)
    has_bias = getattr(module, "has_bias", False)
    # routing weights as [T, E]: top_k_weights at the picked experts, 0 elsewhere
    picked = top_k_index.unsqueeze(-1) == torch.arange(experts, device=top_k_index.device)
    routing = torch.where(picked, top_k_weights.unsqueeze(-1), torch.zeros((), dtype=top_k_weights.dtype)).sum(1)

    up = _stacked(module.gate_up_proj if has_gate else module.up_proj, transposed)  # [E, U, H]
    width = up.shape[1]
    proj = torch.nn.functional.linear(hidden_states, up.reshape(experts * width, hidden))
    proj = proj.reshape(tokens, experts, width)  # [T, E, U]
    if has_bias:
        proj = proj + (module.gate_up_proj_bias if has_gate else module.up_proj_bias)
    proj = module._apply_gate(proj) if has_gate else module.act_fn(proj)  # [T, E, I]

    down = _stacked(module.down_proj, transposed)  # [E, H, I]
    out = torch.matmul(proj.transpose(0, 1), down.transpose(1, 2))  # [E, T, H]
    if has_bias:
        out = out + module.down_proj_bias.unsqueeze(1)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    out = out * routing.transpose(0, 1).unsqueeze(-1).to(out.dtype)
    return out.sum(0).to(hidden_states.dtype)


DENSE = "circleops_dense"


@contextlib.contextmanager
def dense_experts_implementation(model: torch.nn.Module) -> Iterator[None]:
    """Every ``use_experts_implementation`` experts module of ``model`` dispatches densely
    while the block is active (any MoE family, adapter or not): the implementation is
    registered in transformers' experts interface and selected on each config the model's
    modules read; their own settings come back on exit."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface
        yield
        return
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if hasattr(c, "_experts_implementation_internal")}
    if not configs:
        yield
        return
    ALL_EXPERTS_FUNCTIONS[DENSE] = dense_experts
    saved = {k: c._experts_implementation_internal for k, c in configs.items()}
    for c in configs.values():
        c._experts_implementation_internal = DENSE
    try:
        yield
    finally:
        for k, c in configs.items():
            c._experts_implementation_internal = saved[k]
