"""Input-channel importances for weight quantization (llama.cpp's "importance matrix").

A linear's output error from quantizing its weight is (W - W_q) x; its mean square over the
inputs the model sees is, per output row, sum_k E[x_k^2] (w_k - w_q,k)^2 plus cross terms.
``input_importance`` measures E[x_k^2] for every ``nn.Linear`` in one forward pass over the
calibration text shipped with circleops (an LLM) or over the example input (any other
model); ``ggml.quantize_q4_0_weighted`` then picks each Q4_0 block's scale to minimise that
weighted error. Measured on SmolLM2 (bench/README.md, bench/ggml.py "Quality"): the 4-bit
linears cost +5 % perplexity this way, +17 % with the reference max-abs rounding.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from circleops.quantize.weights import source_key

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
# tokens of it an LLM runs: SmolLM2's q4_0 perplexity was the same within noise with the
# importances of 64, 128 or all 513 tokens (+4.6 / +5.9 / +5.7 %), and the forward is 4x shorter
CALIBRATION_TOKENS = 128


def calibration_ids(model: Any, tokenizer: Any = None) -> torch.Tensor | None:
    """[1, S] token ids of the shipped calibration text for a Hugging Face CausalLM (UTF-8
    bytes modulo the vocabulary without a tokenizer), its first CALIBRATION_TOKENS within
    the model's context; None for any other model."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    # a language model head is what makes it a CausalLM (no import of conversion: it imports us)
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if not vocab or not callable(output_embeddings) or output_embeddings() is None:
        return None
    text = CALIBRATION_TEXT.read_text()
    ids = list(tokenizer(text).input_ids) if tokenizer is not None else [b % int(vocab) for b in text.encode()]
    limit = min(CALIBRATION_TOKENS, getattr(config, "max_position_embeddings", None) or len(ids))
    return torch.tensor([ids[:limit]], dtype=torch.long)


def input_importance(model: torch.nn.Module, example_args: Sequence[Any] = (), tokenizer: Any = None
                     ) -> dict[tuple, torch.Tensor]:
    """Mean square of each input channel of every ``nn.Linear`` of ``model``, keyed by the
    ``source_key`` of its weight (how quantize_weights finds a weight whatever view the
    lowering made of it; a tied lm_head's key is the embedding table's).

    An LLM (``model.config.vocab_size``) runs the shipped calibration text; another model
    runs ``example_args``. A linear the forward never reached has no entry (its weight is
    then quantized with the reference rounding).
    """
    ids = calibration_ids(model, tokenizer)
    sums: dict[tuple, list] = {}
    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = source_key(module.weight.detach())
            if key is None:
                continue

            def hook(_mod: torch.nn.Module, args: tuple, key: tuple = key) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
                acc = sums.setdefault(key, [torch.zeros(x.shape[1], dtype=torch.float64), 0])
                acc[0] += (x * x).sum(0)
                acc[1] += x.shape[0]

            handles.append(module.register_forward_pre_hook(hook))
    from circleops.quantize.ggml import one_thread

    try:
        with torch.no_grad(), one_thread():
            if ids is not None:
                model(input_ids=ids, use_cache=False)
            else:
                model(*example_args)
    finally:
        for h in handles:
            h.remove()
    return {key: (total / max(count, 1)).to(torch.float32) for key, (total, count) in sums.items()}

