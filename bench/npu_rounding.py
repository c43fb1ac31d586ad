"""Experimental per-group int4 roundings for bench/npu_weights.py (not circleops' API)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from circleops.quantize import gptq as G
from circleops.quantize import grouped as Q


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    head = model.get_output_embeddings()
    return {n: m for n, m in Q.eligible_linears(model).items() if m is not head}


def gptq_group_rule(w: torch.Tensor, h: torch.Tensor, group: int, clips=(1.0,), damp: float = G.DAMP,
                    act_order: bool = False, static_clips=Q.CLIPS, weighted: bool = False) -> torch.Tensor:
    """GPTQ on the grouped grid; the group rule's scale by a clipping search over ``clips``.
    act_order: static groups (clipping search ``static_clips``), columns by decreasing diag(H)."""
    w = w.detach().to(torch.float32)
    rows, cols = w.shape
    s_r = Q.row_scales(w, 4)
    block = max(G.BLOCK // group, 1) * group
    if act_order:
        imp = torch.diagonal(h).reshape(cols // group, group) if weighted else None
        mult = Q.search_mult(w.reshape(rows, cols // group, group), s_r, 4, static_clips, imp)
        static = (s_r[:, None] * mult).repeat_interleave(group, dim=1)
    else:
        mult = torch.zeros(rows, cols // group, dtype=torch.int64)
        static = None
    current = [s_r]

    def level(col, j, w1, i):
        if static is not None:
            current[0] = static[:, j]
        elif j % group == 0:
            m = Q.search_mult(w1[:, None, i:i + group], s_r, 4, clips)[:, 0]
            mult[:, j // group] = m
            current[0] = s_r * m
        return torch.clamp(torch.round(col / current[0]), -7, 7), current[0]

    q = G.compensate(w, h, level, block=block, damp=damp, act_order=static is not None)
    return Q.dequantize(q, s_r, mult, group)


def rounded_weight(method: str, w: torch.Tensor, h: torch.Tensor | None, group: int) -> torch.Tensor:
    base = method.split("+")[0]
    if base == "fp":
        return w
    if base == "int8":
        q, s = Q.rtn(w.detach().float(), 8)
        return q * s[:, None]
    if base == "rtn":
        q, s, m = Q.rtn_grouped(w, 4, group)
        return Q.dequantize(q, s, m, group)
    if base == "rtn-mse":
        q, s, m = Q.rtn_grouped(w, 4, group, Q.CLIPS)
        return Q.dequantize(q, s, m, group)
    if base == "gptq":
        return gptq_group_rule(w, h, group)
    if base == "gptq-mse":
        return gptq_group_rule(w, h, group, clips=Q.CLIPS)
    if base == "gptq-act":
        return gptq_group_rule(w, h, group, act_order=True)
    if base == "gptq-act-h":
        return gptq_group_rule(w, h, group, act_order=True, weighted=True)
    if base == "gptq-act-hf":
        return gptq_group_rule(w, h, group, act_order=True, weighted=True, static_clips=FINE)
    if base == "gptq-act-mm":
        return gptq_group_rule(w, h, group, act_order=True, static_clips=(1.0,))
    if base == "gptq-d1":
        return gptq_group_rule(w, h, group, damp=0.1)
    raise ValueError(method)


FINE = tuple(1.0 - 0.025 * k for k in range(17))  # 1.0 .. 0.6

CAP = [0.0]  # > 0: each token's squared norm capped at CAP x the median token's (per sample) in the Hessians


def hessians(model, linears, samples):
    """gptq.hessians, with each token's input row scaled down to at most CAP[0] x the median
    token's squared norm (massive-activation tokens would otherwise carry the whole XᵀX)."""
    if not CAP[0]:
        return G.hessians(model, linears, samples)[0]
    result, hooks = {}, []

    def hook_for(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            n = x.pow(2).sum(1)
            limit = CAP[0] * n.median()
            x = x * torch.sqrt(torch.clamp(limit / n.clamp_min(1e-30), max=1.0))[:, None]
            result[name] = result.get(name, 0) + x.T @ x
        return hook

    for name, lin in linears.items():
        hooks.append(lin.register_forward_pre_hook(hook_for(name)))
    try:
        with torch.no_grad():
            for args in samples:
                model(*args)
    finally:
        for h in hooks:
            h.remove()
    return result


def _stages(model) -> list[list[str]]:
    """Linears in the order sequential GPTQ rounds them: per layer q/k/v, o, gate/up, down."""
    out = []
    for k in range(len(model.model.layers)):
        p = f"model.layers.{k}."
        out += [[p + "self_attn." + x for x in ("q_proj", "k_proj", "v_proj")], [p + "self_attn.o_proj"],
                [p + "mlp." + x for x in ("gate_proj", "up_proj")], [p + "mlp.down_proj"]]
    return out


@contextlib.contextmanager
def rounded(model: torch.nn.Module, samples: Sequence[Sequence[Any]], method: str, group: int) -> Iterator[None]:
    linears = decoder_linears(model)
    saved = {n: m.weight.detach().clone() for n, m in linears.items()}
    ORIGINAL.clear()
    ORIGINAL.update(saved)
    try:
        with torch.no_grad():
            needs_h = method.startswith("gptq")
            if needs_h and "+seq" in method:
                for names in _stages(model):
                    hs = hessians(model, {n: linears[n] for n in names}, samples)
                    for n in names:
                        linears[n].weight.copy_(rounded_weight(method, linears[n].weight, hs[n], group))
            else:
                hs = hessians(model, linears, samples) if needs_h else {}
                for n, m in linears.items():
                    m.weight.copy_(rounded_weight(method, m.weight, hs.get(n), group))
        yield
    finally:
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(saved[n])


def int8_gains(model: torch.nn.Module, samples: Sequence[Sequence[Any]], ref: list[torch.Tensor],
               names: Sequence[str]) -> dict[str, float]:
    """For each linear named (the model's weights as rounded now): how much the squared logits
    error against ``ref`` (fp32 logits of ``samples``) falls when that linear alone goes back
    to int8 per channel (from its original weight, ``ORIGINAL``), relative to Σ ref²."""
    linears = Q.eligible_linears(model)
    replay = Q._Replay(model, samples)
    energy = sum(float(r.pow(2).sum()) for r in ref)
    base = sum(float((b - r).pow(2).sum()) for b, r in zip(replay.base, ref)) / energy
    gains = {}
    for name in names:
        lin = linears[name]
        rounded_w = lin.weight.detach().clone()
        q, s = Q.rtn(ORIGINAL[name], 8)
        lin.weight.copy_(q * s[:, None])
        try:
            err = sum(float((got - r).pow(2).sum()) for got, r in zip(replay.logits(name), ref)) / energy
        finally:
            lin.weight.copy_(rounded_w)
        gains[name] = base - err
    return gains


ORIGINAL: dict[str, torch.Tensor] = {}


def choose_by_gain(gains: dict[str, float], sizes: dict[str, int], budget: float) -> list[str]:
    """The largest gains per weight first, within ``budget`` of all the weights (convert's rule
    while issue 34 measured it: circleops.quantize.grouped.choose_by_gain)."""
    return Q.choose_by_gain(gains, sizes, budget)


@contextlib.contextmanager
def with_int8(model: torch.nn.Module, samples: Sequence[Sequence[Any]], budget: float, how: str = "gain") -> Iterator[list[str]]:
    """Inside ``rounded``: the linears whose int8 weights (instead of their rounding) gain
    most, within ``budget`` of the decoder linears' weights, set to int8 per channel."""
    linears = decoder_linears(model)
    sizes = {n: m.weight.numel() for n, m in linears.items()}
    if how == "gain":
        gains = int8_gains(model, samples, REF, list(linears))
    else:  # "rtn": the old measure, each linear's RTN int4 rounding alone (of the original weights)
        rounded_now = {n: m.weight.detach().clone() for n, m in linears.items()}
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(ORIGINAL[n])
        gains = Q.linear_sensitivity(model, samples, list(linears), 32)
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(rounded_now[n])
    if how == "rtnabs":  # the committed rule until issue 34: the largest errors first (grouped.choose_int8)
        chosen = Q.choose_int8(gains, sizes, target=0.15, budget=budget)
    else:
        chosen = choose_by_gain(gains, sizes, budget)
    saved = {n: linears[n].weight.detach().clone() for n in chosen}
    try:
        with torch.no_grad():
            for n in chosen:
                q, s = Q.rtn(ORIGINAL[n], 8)
                linears[n].weight.copy_(q * s[:, None])
        yield chosen
    finally:
        with torch.no_grad():
            for n in chosen:
                linears[n].weight.copy_(saved[n])


REF: list[torch.Tensor] = []
