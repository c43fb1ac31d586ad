"""Which linears of an ``int4`` file stay int8: a choice measured at convert time on the SELECTION text.

The MLP down projections read the gate · up product, the widest-ranging activation of a Llama
block; at 4 bits some of them cost a model far more than others (SmolLM2-135M, one down at a
time at 4 bits on the selection text: from ~0 to several tenths of a per cent of perplexity,
bench/int4_down.py). So instead of keeping every down int8, the convert measures each
candidate's cost and keeps int8 only the costliest:

* one forward pass of the float model over the selection text (circleops.quantize.selection:
  neither the calibration text the rounding fits nor the scored perplexity text), windows of
  ``WINDOW`` tokens; at each candidate linear, the output error its int4 weight would make on
  the inputs it sees, ``‖x (Ŵ4 − W)ᵀ‖²`` (Ŵ4: the file's int4 blocks, importance-weighted as the
  weight pass rounds them), over the energy of the residual stream that linear writes into
  (the decoder layer's output), summed over the text: the relative noise the 4-bit weight adds;
* the candidates in increasing cost go to 4 bits while their costs summed stay within
  ``SHARE`` of all candidates' summed cost; the rest stay int8, and the summary names them
  with their measured cost.

``SHARE`` was chosen on the selection text (SmolLM2-135M, bench/int4_down.py,
bench/results/67-int4-downs.yaml), never on the scored text. A model without a causal-LM head
(no text to measure on) keeps every candidate int8, and the summary says so; a causal LM without a tokenizer reads the text's UTF-8 bytes modulo its vocabulary (as the
calibration does, circleops.quantize.importance).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# parameter-name parts of the linears whose 4-bit cost is measured, per format
CANDIDATES: dict[str, tuple[str, ...]] = {"int4": ("mlp.down_proj.",)}
SHARE = 0.30  # the 4-bit candidates' summed cost, of all candidates' (chosen on the selection text)
WINDOW = 256  # tokens per window of the selection text (as the perplexity windows)
MAX_TOKENS = 1024  # of the selection text: enough to rank the candidates, one forward's time


@dataclass
class Choice:
    """The measured choice: each candidate's cost and whether it stays int8."""

    costs: dict[str, float] = field(default_factory=dict)  # parameter name -> relative output noise at 4 bits
    eight_bit: dict[str, str] = field(default_factory=dict)  # parameter name -> why it stays int8
    tokens: int = 0  # selection-text tokens measured on
    note: str = ""  # why nothing was measured
    keys: dict[tuple, str] = field(default_factory=dict)  # source_key of each candidate's weight -> its name
    written: set[str] = field(default_factory=set)  # the kept weights' names in the file (a graph may prefix them)

    def keeps(self, key: tuple | None) -> bool:
        """Whether the weight at ``key`` (circleops.quantize.weights.source_key) stays int8."""
        return key is not None and self.keys.get(key) in self.eight_bit

    @property
    def four_bit(self) -> list[str]:
        return [n for n in self.costs if n not in self.eight_bit]

    def summary_line(self) -> str:
        if not self.costs:
            return f"{len(self.eight_bit)} weights kept INT8 unmeasured: {self.note}" if self.note else ""
        kept = sorted(self.eight_bit, key=lambda n: -self.costs[n])
        if not kept:
            return (f"all {len(self.costs)} MLP down projections at INT4 (their 4-bit costs measured on the selection "
                    f"text, {self.tokens} tokens, all within the share)")
        return (f"{len(self.four_bit)} of {len(self.costs)} MLP down projections at INT4, {len(kept)} kept INT8 by their "
                f"measured 4-bit cost on the selection text ({self.tokens} tokens; the costliest, holding "
                f"{1 - self.share_four_bit():.0%} of the summed cost): " + ", ".join(
                    f"{_short(n)} {self.costs[n]:.1e}" for n in kept))

    def share_four_bit(self) -> float:
        total = sum(self.costs.values())
        return sum(self.costs[n] for n in self.four_bit) / total if total > 0 else 0.0


def _short(name: str) -> str:
    return name.replace("model.layers.", "L").replace(".mlp.down_proj.weight", ".down")


def is_candidate(name: str, fmt_name: str) -> bool:
    """Whether the parameter ``name`` is one whose 4-bit cost the format measures."""
    return any(part in name for part in CANDIDATES.get(fmt_name, ()))


def costs(model: torch.nn.Module, tokenizer: Any, importance: dict[tuple, torch.Tensor] | None, block: int, fmt_name: str,
          *, ids: list[int] | None = None) -> tuple[dict[str, float], int]:
    """Each candidate linear's relative output noise at 4 bits over the selection text (its
    first MAX_TOKENS; ``ids`` instead when given), by parameter name; and the tokens read."""
    from circleops.quantize import int4
    from circleops.quantize.selection import selection_ids
    from circleops.quantize.weights import source_key

    vocab = int(model.config.vocab_size)
    ids = ids if ids is not None else selection_ids(tokenizer, vocab)[:MAX_TOKENS]
    limit = min(WINDOW, getattr(model.config, "max_position_embeddings", None) or WINDOW)
    windows = [ids[k:k + limit] for k in range(0, len(ids) - 1, limit)]
    layers = _decoder_layers(model)
    noise: dict[str, float] = {}
    energy: dict[int, float] = {}
    handles = []
    owner: dict[str, int] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        pname = f"{name}.weight"
        if not isinstance(module, torch.nn.Linear) or not is_candidate(pname, fmt_name):
            continue
        w = module.weight.detach().to(torch.float32)
        b = int4.block_for(w.shape[1], block)
        if b is None:
            continue
        imp = (importance or {}).get(source_key(module.weight.detach()))
        deltas[pname] = int4.dequantize(int4.quantize(w, b, imp)) - w
        owner[pname] = next((i for i, layer in enumerate(layers) if any(m is module for m in layer.modules())), -1)
        noise[pname] = 0.0

        def hook(_m: torch.nn.Module, args: tuple, pname: str = pname) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            noise[pname] += float((x @ deltas[pname].T).double().pow(2).sum())

        handles.append(module.register_forward_pre_hook(hook))
    for i, layer in enumerate(layers):
        def out_hook(_m: torch.nn.Module, _args: tuple, out: Any, i: int = i) -> None:
            h = out[0] if isinstance(out, (tuple, list)) else out
            energy[i] = energy.get(i, 0.0) + float(h.detach().double().pow(2).sum())

        handles.append(layer.register_forward_hook(out_hook))
    from circleops.quantize.ggml import one_thread

    try:
        with torch.no_grad(), one_thread():
            for w in windows:
                model(input_ids=torch.tensor([w]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: v / max(energy.get(owner[n], 0.0), 1e-30) for n, v in noise.items()}, sum(len(w) for w in windows)


def choose(model: torch.nn.Module, tokenizer: Any, importance: dict[tuple, torch.Tensor] | None, block: int,
           fmt_name: str, *, share: float | None = None) -> Choice:
    """The candidates kept int8 (module docstring): measured on the selection text for a causal
    LM; every candidate int8, unmeasured, for another model."""
    from circleops.quantize.weights import source_key

    if fmt_name not in CANDIDATES:
        return Choice()
    keys = {source_key(m.weight.detach()): f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and is_candidate(f"{n}.weight", fmt_name)}
    keys.pop(None, None)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or not getattr(getattr(model, "config", None), "vocab_size", None):
        why = "no selection text to measure on (not a causal LM)"
        return Choice(note=why, keys=keys, eight_bit={n: why for n in keys.values()})
    share = SHARE if share is None else share
    cost, tokens = costs(model, tokenizer, importance, block, fmt_name)
    choice = Choice(costs=cost, tokens=tokens, keys=keys)
    total = sum(cost.values())
    spent = 0.0
    for name in sorted(cost, key=lambda n: cost[n]):
        if total > 0 and spent + cost[name] <= share * total:
            spent += cost[name]
            continue
        choice.eight_bit[name] = f"4-bit cost {cost[name]:.1e} on the selection text (the costliest {1 - share:.0%})"
    return choice


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers (the first ModuleList of the model whose entries hold linears)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and any(
                isinstance(m, torch.nn.Linear) for m in module[0].modules()):
            return list(module)
    return []
