"""Input-channel importances for weight quantization (llama.cpp's "importance matrix").

A linear's output error from quantizing its weight is (W - W_q) x; its mean square over the
inputs the model sees is, per output row, sum_k E[x_k^2] (w_k - w_q,k)^2 plus cross terms.
``input_importance`` measures E[x_k^2] for every ``nn.Linear`` in one forward pass over the
calibration text shipped with circleops (an LLM) or over the example input (any other
model); ``ggml.quantize_q4_0_weighted`` then picks each Q4_0 block's scale to minimise that
weighted error. Measured on SmolLM2 (bench/README.md, bench/ggml.py "Quality"): the 4-bit
linears cost +5 % perplexity this way, +17 % with the reference max-abs rounding.

An LLM's importances are kept on disk (``cache_dir()/importance``), keyed by everything the
forward depends on: the weights and buffers (a CRC-32 of each tensor's bytes: 0.1 s for
SmolLM2's 540 MB, against 0.6-1 s for the forward on one core), the config, the token ids,
the model class and the torch / transformers versions. A second convert of the same model
reads them back bit for bit.
"""
from __future__ import annotations

import hashlib
import os
import sys
import zlib
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
    return _calibrate(model, example_args, tokenizer, "importance")


def input_absmax(model: torch.nn.Module, example_args: Sequence[Any] = (), tokenizer: Any = None
                 ) -> dict[str, torch.Tensor]:
    """Max |x| of each input channel of every ``nn.Linear`` of ``model`` over the same run as
    ``input_importance`` (the shipped calibration text for an LLM), keyed by module name (the
    first module holding each weight); cached the same way. SmoothQuant's scales for w8
    (circleops.quantize.smooth) are made of them."""
    by_key = _calibrate(model, example_args, tokenizer, "absmax")
    return {name: by_key[key] for name, key in _linear_keys(model).items() if key in by_key}


def _calibrate(model: torch.nn.Module, example_args: Sequence[Any], tokenizer: Any, stat: str
               ) -> dict[tuple, torch.Tensor]:
    """One forward with a pre-hook on every nn.Linear: "importance" (mean of x^2) or "absmax"
    (max |x|) per input channel, by source_key; read from / written to the disk cache."""
    ids = calibration_ids(model, tokenizer)
    linears = _linear_keys(model)
    cache = _cache_path(model, ids, stat) if ids is not None and linears else None
    cached = _read(cache, linears) if cache is not None else None
    if cached is not None:
        return cached
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
                if stat == "absmax":
                    acc[0] = torch.maximum(acc[0], x.abs().amax(0))
                else:
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
    if stat == "absmax":
        result = {key: total.to(torch.float32) for key, (total, _count) in sums.items()}
    else:
        result = {key: (total / max(count, 1)).to(torch.float32) for key, (total, count) in sums.items()}
    if cache is not None:
        _write(cache, {"linears": list(linears),
                       "importance": {name: result[key] for name, key in linears.items() if key in result}})
    return result


# bump when what input_importance computes changes (the hooks, the text's use)
_CACHE_FORMAT = 1


def _linear_keys(model: torch.nn.Module) -> dict[str, tuple]:
    """{name of the first ``nn.Linear`` holding each weight: its source_key}, in module order."""
    out: dict[str, tuple] = {}
    seen: set = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = source_key(module.weight.detach())
            if key is not None and key not in seen:
                seen.add(key)
                out[name] = key
    return out


def _cache_path(model: torch.nn.Module, ids: torch.Tensor, stat: str = "importance") -> Path | None:
    """The cache file of ``model`` run on ``ids``; None when the model cannot be fingerprinted."""
    from circleops.system.cache_dir import cache_dir

    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            h.update(repr(part).encode())
            h.update(b"\0")

    try:
        transformers = sys.modules.get("transformers")
        config = getattr(model, "config", None)
        to_json = getattr(config, "to_json_string", None)
        add(_CACHE_FORMAT, torch.__version__, getattr(transformers, "__version__", None), type(model).__module__,
            type(model).__qualname__, model.training, to_json(use_diff=False) if callable(to_json) else repr(config),
            ids.shape, ids.tolist())
        # what the forward reads from each module's config besides its fields (convert runs
        # eager attention and, for MoE, dense experts)
        configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
        add([(getattr(c, "_attn_implementation", None), getattr(c, "_experts_implementation_internal", None))
             for c in configs.values()])
        tensors = [(name, t.detach()) for name, t in [*model.named_parameters(), *model.named_buffers()]]
        if any(t.device.type != "cpu" or type(t) is not torch.Tensor for _, t in tensors):
            return None
        for (name, t), crc in zip(tensors, _crcs([t for _, t in tensors])):
            add(name, tuple(t.shape), str(t.dtype), crc)
    except Exception:  # noqa: BLE001 - a model this cannot fingerprint is calibrated every time
        return None
    suffix = "" if stat == "importance" else f"-{stat}"  # the importances keep their file names
    return cache_dir() / "importance" / f"{h.hexdigest()[:32]}{suffix}.pt"


def _crcs(tensors: list[torch.Tensor]) -> list[int]:
    """CRC-32 of each tensor's bytes, on one thread per torch thread (zlib releases the GIL)."""
    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    workers = min(torch.get_num_threads(), len(tensors))
    if workers < 2:
        return [crc(t) for t in tensors]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="circleops-crc") as pool:
        return list(pool.map(crc, tensors))


def _read(path: Path, linears: dict[str, tuple]) -> dict[tuple, torch.Tensor] | None:
    """The cached importances by source_key; None when absent, unreadable or for other linears."""
    try:
        saved = torch.load(path, weights_only=True)
        if saved["linears"] != list(linears):
            return None
        return {linears[name]: value for name, value in saved["importance"].items()}
    except Exception:  # noqa: BLE001 - no cache, or a damaged one: compute again
        return None


def _write(path: Path, by_name: dict[str, torch.Tensor]) -> None:
    """Atomically (a reader sees the whole file or none); a cache that cannot be written is skipped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(by_name, tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)

