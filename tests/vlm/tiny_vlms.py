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


class QwenImagesProcessor:
    """What Qwen2VLProcessor does for images (its constructor insists on a video processor,
    which needs torchvision: not installable here with the CPU torch): the image processor's
    patches and grids, and each ``<|image_pad|>`` of the text expanded to grid.prod() / merge²
    tokens, in order."""

    def __init__(self, image_processor: Any, tokenizer: Any):
        self.image_processor, self.tokenizer = image_processor, tokenizer

    def __call__(self, images: Any = None, text: list[str] = (), return_tensors: str = "pt") -> dict:
        out: dict = {}
        text = list(text)
        if images:
            out = dict(self.image_processor(images=images[0], return_tensors="pt"))
            merge = self.image_processor.merge_size ** 2
            counts = iter(int(g.prod()) // merge for g in out["image_grid_thw"])
            parts = text[0].split("<|image_pad|>")
            text = [parts[0] + "".join("<|placeholder|>" * next(counts) + p for p in parts[1:])]
            text = [text[0].replace("<|placeholder|>", "<|image_pad|>")]
        out.update(self.tokenizer(text, return_tensors=return_tensors))
        # what the model's get_rope_index groups by (text 0, image 1): without it transformers
        # gives the image tokens 1-D positions
        image = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        out["mm_token_type_ids"] = (out["input_ids"] == image).to(torch.int32)
        return out

    def save_pretrained(self, path: str) -> None:
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def _qwen(version: str) -> Callable[[Path, int], tuple[Any, Any]]:
    def build(root: Path, seed: int = 0) -> tuple[Any, Any]:
        """Qwen2-VL / Qwen2.5-VL: patches of 8 px merged 2x2; Qwen2.5's windows of 32 px
        (2x2 merge units) in block 0 and full attention in block 1; a 2-layer text model
        with M-RoPE sections (2, 1, 1) over head_dim 8."""
        import transformers as tf

        tok = _gemma_tokenizer({})
        tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                              "<|video_pad|>"]})
        ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                        "<|video_pad|>")}
        image_proc = tf.Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=PATCH,
                                                 temporal_patch_size=2, merge_size=2)
        processor = QwenImagesProcessor(image_proc, tok)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=PATCH, spatial_merge_size=2,
                      temporal_patch_size=2, out_hidden_size=32)
        if version == "qwen2_5_vl":
            vision.update(window_size=32, fullatt_block_indexes=[1])
            config_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
        else:
            vision.update(embed_dim=32, mlp_ratio=2)
            config_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                    pad_token_id=0, eos_token_id=1, bos_token_id=2)
        config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], pad_token_id=0, eos_token_id=1, bos_token_id=2)
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        _widen(model)
        return model, processor

    return build


def smolvlm(root: Path, seed: int = 0) -> tuple[Any, Any]:
    """Idefics3 / SmolVLM: SigLIP tiles of 32 px (16 patches, pixel-shuffled to 4 tokens),
    an image split into tiles + the global image; a 2-layer Llama."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    from circleops.recipes.vlm import IMAGE_TOKENS, build_processor

    tok = _gemma_tokenizer({})
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IMAGE, patch_size=PATCH),
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    _widen(model)
    return model, build_processor(tok, model, chat_template=None)


def paligemma(root: Path, seed: int = 0) -> tuple[Any, Any]:
    """PaliGemma: SigLIP at 32 px (16 image tokens per image, all images first), a 2-layer
    Gemma whose prompt prefix (images, BOS, prompt) is attended both ways."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    from circleops.recipes.vlm import paligemma_processor

    processor = paligemma_processor(_gemma_tokenizer({}), image_size=IMAGE, image_seq_len=(IMAGE // PATCH) ** 2)
    tok = processor.tokenizer
    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=PATCH),
        text_config=dict(model_type="gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=8, vocab_size=len(tok),
                         max_position_embeddings=512, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id),
        image_token_index=processor.image_token_id, vocab_size=len(tok), projection_dim=32, hidden_size=32,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = PaliGemmaForConditionalGeneration(config).eval()
    _widen(model)
    return model, processor


BUILDERS: dict[str, Callable[[Path, int], tuple[Any, Any]]] = {
    "smolvlm": smolvlm, "paligemma": paligemma, "gemma3": gemma3, "qwen2_vl": _qwen("qwen2_vl"), "qwen2_5_vl": _qwen("qwen2_5_vl")}


@dataclass
class TinyVLM:
    family: str
    directory: Path
    model: Any
    processor: Any
    images: list[Path]

    def inputs(self, text: str, images: list[Path], side: int | None = None) -> dict[str, torch.Tensor]:
        """The processor's inputs; ``side``: each image resized to side x side pixels first (a
        converted patch tower's fixed size)."""
        from PIL import Image

        pics = [Image.open(p).convert("RGB") for p in images]
        if side is not None:
            pics = [p.resize((side, side), Image.BICUBIC) for p in pics]
        out = dict(self.processor(images=[pics] if pics else None, text=[text], return_tensors="pt"))
        out.pop("labels", None)  # PaliGemma's processor returns them for training
        return out

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


MAX_PATCHES = 48  # the Qwen vision graph's patch capacity: a 48 x 32 px image (6 x 4 patches)


def image_features(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every image's rows, in prompt order, through circleops' vision module: one tile at a
    time (pooled towers), or one image's patches padded to MAX_PATCHES (Qwen)."""
    from circleops.adapters.qwen_vision import QwenVisionTower, vision_index
    from circleops.adapters.vlm import VisionTower, family_of

    px = inputs["pixel_values"]
    px = px[0] if px.dim() == 5 else px  # Idefics3: [1, tiles, 3, H, W]
    if family_of(model).tower != "qwen":
        tower = VisionTower(model)
        return torch.cat([tower(px[i:i + 1])[0] for i in range(px.shape[0])])
    tower, rows, start = QwenVisionTower(model), [], 0
    for grid in inputs["image_grid_thw"].tolist():
        index = vision_index(tower.visual, grid, MAX_PATCHES)
        patches = torch.cat([px[start:start + index.patches], px.new_zeros(MAX_PATCHES - index.patches, px.shape[1])])
        rows.append(tower(patches, *index.inputs())[:index.tokens])
        start += index.patches
    return torch.cat(rows)


def greedy(model: Any, inputs: dict[str, torch.Tensor], new: int, *, chunk: int = 8, cache: int = 224,
           cache_update: str = "rows", eos: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through circleops' modules: the vision module on every image, its rows
    placed at the image tokens in order; the prompt in prefill runs (M-RoPE: with the
    prompt's 3-D positions); one token per decode."""
    from circleops.adapters.decode import DecoderWithCache
    from circleops.adapters.qwen_vision import mrope_positions
    from circleops.adapters.vlm import ImagePrefill, MRopeDecode, TextLM, family_of

    fam = family_of(model)
    image_token = int(model.config.image_token_id)
    ids = inputs["input_ids"][0].tolist()
    eos = model.generation_config.eos_token_id if eos is None else eos
    with torch.no_grad(), fam.explicit_mask(model):
        features = image_features(model, inputs) if "pixel_values" in inputs else None
        step = DecoderWithCache(TextLM(model), cache, cache_update)
        prefill = ImagePrefill(step, image_token, image_blocks=fam.image_blocks, mrope=fam.mrope,
                               prefix_lm=fam.prefix_lm)
        if fam.prefix_lm:  # the processor's prompt is all prefix: one prefill run
            chunk = max(chunk, len(ids))
        decode, delta = step, None
        if fam.mrope:
            grids = inputs["image_grid_thw"].tolist() if "image_grid_thw" in inputs else []
            rope, delta = mrope_positions(ids, image_token, grids, model.config.vision_config.spatial_merge_size)
            rope = torch.tensor(rope)
            decode = MRopeDecode(step)
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
            extra = ()
            if fam.mrope:  # the chunk's positions, the padding counting on
                extra = (torch.cat([rope[:, start:end], rope[:, end - 1:end] + torch.arange(1, chunk - n + 1)], 1)[:, None],)
            if fam.prefix_lm:
                extra = (*extra, torch.tensor([n]))
            out = prefill(chunk_ids, torch.tensor([start]), torch.tensor([n - 1]), embeds, *extra, *caches)
            caches = _update(caches, out[1:], start, n, cache_update)
        logits, tokens, seen, pos = out[0][0, -1], [], [], len(ids)
        for _ in range(new):
            seen.append(logits)
            tokens.append(int(logits.argmax()))
            if tokens[-1] == eos:
                break
            extra = (torch.tensor([delta]),) if fam.mrope else ()
            out = decode(torch.tensor([[tokens[-1]]]), torch.tensor([pos]), *extra, *caches)
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
