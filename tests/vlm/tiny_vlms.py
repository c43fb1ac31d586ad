"""Tiny random vision-language models of the newer families (tests/vlm), each with its own
processor over a tiny tokenizer (vocab < 100, built offline), and a greedy loop over
circleops' torch modules (adapters.vlm: VisionTower, ImagePrefill over a DecoderWithCache)
that places every image where the processor placed its tokens and runs the prompt in
prefill chunks that never split an image block. Its tokens and logits are compared with
transformers' generate."""
from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

IMAGE, PATCH = 32, 8


def save_image(path: Path, height: int, width: int, seed: int) -> Path:
    from PIL import Image

    Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")).save(path)
    return path


def _gemma_tokenizer(extra: dict[str, str]) -> Any:
    from transformers import GemmaTokenizer

    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    chars = list(string.ascii_letters + string.digits + " .,:!?'\n▁")
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(base + chars)}, merges=[], extra_special_tokens=extra)


def _widen(model: Any, std: float = 0.5) -> None:
    """Matrices drawn wider than the default init (std 0.02, and Gemma 3's projector starts at
    zero), so that images and attention are sharp enough for a wrong mask, position or image
    row to change the logits and tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std if "language_model" in name else 1.0 / p.shape[0] ** 0.5)


def gemma3(root: Path, seed: int = 0) -> tuple[Any, Any]:
    """Gemma 3 with images: SigLIP (32 px, 16 patches) pooled to 4 tokens per image, a
    2-layer text model (a sliding layer of window 6, then a full one)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

    tok = _gemma_tokenizer({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                            "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}),
                                tokenizer=tok, image_seq_length=4)
    config = Gemma3Config(
        text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=len(tok), sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE, patch_size=PATCH),
        mm_tokens_per_image=4, image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
        eoi_token_id=tok.convert_tokens_to_ids("<end_of_image>"), pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    _widen(model)
    return model, processor


BUILDERS: dict[str, Callable[[Path, int], tuple[Any, Any]]] = {"gemma3": gemma3}


@dataclass
class TinyVLM:
    family: str
    directory: Path
    model: Any
    processor: Any
    images: list[Path]

    def inputs(self, text: str, images: list[Path]) -> dict[str, torch.Tensor]:
        from PIL import Image

        pics = [Image.open(p).convert("RGB") for p in images]
        return dict(self.processor(images=[pics] if pics else None, text=[text], return_tensors="pt"))

    def hf_greedy(self, inputs: dict[str, torch.Tensor], new: int) -> tuple[list[int], list[torch.Tensor]]:
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        n = inputs["input_ids"].shape[1]
        return out.sequences[0, n:].tolist(), [x[0] for x in out.logits]


def save_tiny(family: str, root: Path, seed: int = 0) -> TinyVLM:
    root.mkdir(parents=True, exist_ok=True)
    model, processor = BUILDERS[family](root, seed)
    model.save_pretrained(str(root / "model"))
    processor.save_pretrained(str(root / "model"))
    images = [save_image(root / "a.png", 40, 56, 0), save_image(root / "b.png", 30, 30, 1)]
    return TinyVLM(family, root / "model", model, processor, images)


def plan(ids: list[int], image_token: int, chunk: int) -> list[tuple[int, int]]:
    """Prefill runs of at most ``chunk`` tokens, each ending before an image block it would
    split (a block is attended both ways, so it is computed in one run)."""
    runs, start = [], 0
    while start < len(ids):
        end = min(start + chunk, len(ids))
        if end < len(ids) and ids[end] == image_token and ids[end - 1] == image_token:
            block = end
            while block > start and ids[block - 1] == image_token:
                block -= 1
            if block == start:
                raise ValueError(f"an image block is longer than the prefill chunk {chunk}")
            end = block
        runs.append((start, end))
        start = end
    return runs


def greedy(model: Any, ids: list[int], tiles: list[torch.Tensor], new: int, *, chunk: int = 8, cache: int = 96,
           cache_update: str = "rows", eos: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through circleops' modules: the vision module on every tile, its rows
    placed at the image tokens in order; the prompt in prefill runs; one token per decode."""
    from circleops.adapters.decode import DecoderWithCache
    from circleops.adapters.vlm import ImagePrefill, TextLM, VisionTower, family_of

    fam = family_of(model)
    image_token = int(model.config.image_token_id)
    with torch.no_grad():
        features = torch.cat([VisionTower(model)(t)[0] for t in tiles]) if tiles else None
        step = DecoderWithCache(TextLM(model), cache, cache_update)
        prefill = ImagePrefill(step, image_token, image_blocks=fam.image_blocks)
        hidden = int(model.config.text_config.hidden_size)
        rows = torch.zeros(len(ids), hidden)
        where = [i for i, t in enumerate(ids) if t == image_token]
        if where:
            rows[where] = features
        caches = step.empty_caches()
        for start, end in plan(ids, image_token, chunk):
            n = end - start
            chunk_ids = torch.tensor([ids[start:end] + [0] * (chunk - n)])
            embeds = torch.cat([rows[start:end], torch.zeros(chunk - n, hidden)])[None]
            out = prefill(chunk_ids, torch.tensor([start]), torch.tensor([n - 1]), embeds, *caches)
            caches = _update(caches, out[1:], start, n, cache_update)
        logits, tokens, seen, pos = out[0][0, -1], [], [], len(ids)
        for _ in range(new):
            seen.append(logits)
            tokens.append(int(logits.argmax()))
            if tokens[-1] == eos:
                break
            out = step(torch.tensor([[tokens[-1]]]), torch.tensor([pos]), *caches)
            caches = _update(caches, out[1:], pos, 1, cache_update)
            pos += 1
            logits = out[0][0, -1]
    return tokens, seen


def _update(caches: list[torch.Tensor], new: tuple, pos: int, n: int, cache_update: str) -> list[torch.Tensor]:
    if cache_update == "full":
        return list(new)
    for c, r in zip(caches, new):  # slot-major [1, C, Hkv, D]: the rows at pos .. pos+n-1
        c[:, pos:pos + n] = r[:, :n]
    return caches
