"""GPTQ rounding for the int4 formats (``--quantize int4-gptq`` ...): each linear's block scales
fixed first (circleops.quantize.int4: the importance-weighted candidates, on the bf16 grid),
then GPTQ (circleops.quantize.gptq's algorithm) quantizes the input columns in order of
decreasing Hessian diagonal ("act order": static scales make any order valid), moving each
column's rounding error onto the columns not yet quantized so that the linear's output over
the calibration text, not its weight, stays close. The result is the file's blocks as they
are (the weight pass writes them unchanged: ``pretrained``), so GPTQ's integers are the
file's and verify's dequantized weights are GPTQ's.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from circleops.quantize import int4
from circleops.quantize.formats import WeightFormat

DAMP = 0.01
BLOCK = 128


def gptq_static(w: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, *, damp: float = DAMP,
                block: int = BLOCK) -> torch.Tensor:
    """int4 levels [rows, cols] (float) of ``w`` at the fixed per-element ``scale`` [rows, cols]
    (0: the level is 0), error-compensated with the Hessian ``h`` [cols, cols], act order."""
    from circleops.quantize.gptq import compensate

    inv = torch.where(scale != 0, 1.0 / scale, torch.zeros_like(scale))

    def level(col: torch.Tensor, j: int, w1: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.clamp(torch.round(col * inv[:, j]), *int4.LEVELS), scale[:, j]

    return compensate(w, h, level, block=block, damp=damp, act_order=True)


def gptq_blocks(model: torch.nn.Module, fmt: WeightFormat, tokenizer: Any = None,
                importance: dict[tuple, torch.Tensor] | None = None) -> tuple[dict[tuple, tuple], str]:
    """The int4 blocks of every linear of ``model`` that takes the format's blocks (the output
    head stays the format's head type), by ``source_key`` of its weight, as the weight pass's
    ``pretrained`` takes them; and the summary line. Calibration: the shipped text (an LLM)."""
    from circleops.quantize.ggml import one_thread
    from circleops.quantize.gptq import eligible_linears, hessians
    from circleops.quantize.importance import calibration_ids
    from circleops.quantize.weights import source_key

    ids = calibration_ids(model, tokenizer)
    if ids is None:
        return {}, "no GPTQ: not a causal LM (the calibration text needs one)"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = {n: m for n, m in eligible_linears(model).items()
               if m is not head and int4.block_for(m.weight.shape[1], fmt.block_size or 0) is not None}
    t = time.perf_counter()
    out: dict[tuple, tuple] = {}
    with one_thread(), torch.no_grad():
        hs, tokens = hessians(model, linears, [(ids,)])
        for name, lin in linears.items():
            w = lin.weight.detach()
            key = source_key(w)
            if key is None or name not in hs:
                continue
            h = hs.pop(name)
            imp = importance.get(key) if importance else None
            packed = int4.quantize(w, int4.block_for(w.shape[1], fmt.block_size or 0),
                                   imp if imp is not None else torch.diagonal(h) / max(tokens, 1))
            scale = int4.expanded_scales(packed)
            q = gptq_static(w, h, scale)
            out[key] = (int4.DTYPE, packed._replace(q=q.to(torch.int8).numpy()), "gptq")
    line = (f"GPTQ rounding (act order, static block scales) of {len(out)} int4 linears on {tokens} calibration "
            f"tokens, {time.perf_counter() - t:.1f} s")
    return out, line
