"""Tiny random vision-language models over the bundled SmolLM2 tokenizer, saved as a model
directory is (save_pretrained + its processor), each converted once by the CLI for onert;
transformers' greedy generate on the same model is the expected output of every VLM test.
``tiny_vlm_onert`` is parametrized over the families:

* smolvlm: Idefics3 (SigLIP tower, pixel-shuffle connector, 2-layer Llama), SmolVLM's chat
  template, images split into 4 tiles + the global image;
* paligemma: SigLIP tower, linear projector, 2-layer Gemma with the prefix-LM mask over the
  image and the prompt, one 32 px image of 16 tokens, no chat template.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from generate_fixtures import one_torch_thread

VLM_PREFILL, VLM_CACHE, VLM_NEW = "16,8", 128, 12
TILE, PATCH, SCALE = 32, 8, 2  # 16 patches per tile -> 4 image tokens after the pixel shuffle
# PaliGemma: 16 image tokens (no pixel shuffle) + BOS + prompt + "\n" in one prefill run
PALI_PREFILL, PALI_TOKENS = "48,8", (TILE // PATCH) ** 2
VLM_FAMILIES = ("smolvlm", "paligemma")


def tiny_vlm(vocab_size: int, image_token_id: int, seed: int = 0):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                         max_position_embeddings=512, tie_word_embeddings=False),
        scale_factor=SCALE, image_token_id=image_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config).eval()


def tiny_paligemma(tokenizer, image_token_id: int, seed: int = 0):
    """A 2-layer Gemma (MQA, head_dim 8) under a 2-layer SigLIP; the text weights drawn wider
    than the default (initializer_range 0.2) so that attention is sharp enough for the mask
    to decide tokens: with the default 0.02 a causal prefill gives the same greedy tokens."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, image_size=TILE, patch_size=PATCH),
        text_config=dict(model_type="gemma", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=8, vocab_size=len(tokenizer),
                         max_position_embeddings=512, initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id),
        image_token_index=image_token_id, vocab_size=len(tokenizer), projection_dim=32, hidden_size=32,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return PaliGemmaForConditionalGeneration(config).eval()


def save_image(path: Path, height: int, width: int, seed: int) -> Path:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


@dataclass
class TinyVLM:
    family: str  # "smolvlm" or "paligemma"
    model_dir: Path  # config.json + safetensors + processor, as save_pretrained writes them
    out: Path  # convert --graphs vision,prefill,decode --target onert
    model: torch.nn.Module  # the same weights, unfused
    processor: object
    photo: Path  # 56 x 40: SmolVLM splits it into 4 tiles + the global image
    other: Path  # another image
    prefill: str  # the --seq-len it was converted with

    @property
    def chat(self) -> bool:
        """Whether the family chats (SmolVLM's chat template; PaliGemma has none)."""
        return self.family == "smolvlm"

    @property
    def tiles(self) -> int:
        """Runs of the vision graph for ``photo``."""
        return 5 if self.family == "smolvlm" else 1

    @property
    def image_tokens(self) -> int:
        return 4 if self.family == "smolvlm" else PALI_TOKENS

    def hf_greedy(self, ids: list[int], pixel_values, new: int = VLM_NEW, eos=None, *, token_type: int = 0) -> list[int]:
        """transformers' greedy tokens; PaliGemma's with the processor's ``token_type_ids``
        (0: the prompt is the prefix; ``token_type=1`` makes it a causal suffix instead)."""
        kw = {} if pixel_values is None else {"pixel_values": torch.as_tensor(pixel_values)}
        if self.family == "paligemma":
            kw["token_type_ids"] = torch.full((1, len(ids)), token_type, dtype=torch.long)
        with torch.no_grad(), one_torch_thread():
            out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      eos_token_id=eos, **kw)
        return out[0, len(ids):].tolist()

    def hf_logits(self, ids: list[int], pixel_values, *, token_type: int = 0):
        """transformers' logits of the last prompt token [V] (see hf_greedy)."""
        kw = {"token_type_ids": torch.full((1, len(ids)), token_type, dtype=torch.long)} \
            if self.family == "paligemma" else {}
        with torch.no_grad(), one_torch_thread():
            return self.model(input_ids=torch.tensor([ids]), pixel_values=torch.as_tensor(pixel_values),
                              **kw).logits[0, -1].numpy()


def _build(family: str, root: Path):
    """(model, processor) of ``family`` over SmolLM2's tokenizer."""
    from transformers import AutoTokenizer

    from circleops.recipes import vlm
    from circleops.sources.models import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    if family == "smolvlm":
        tokenizer.add_special_tokens({"additional_special_tokens": list(vlm.IMAGE_TOKENS)})
        model = tiny_vlm(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
        return model, vlm.build_processor(tokenizer, model)
    processor = vlm.paligemma_processor(tokenizer, image_size=TILE, image_seq_len=PALI_TOKENS)
    return tiny_paligemma(processor.tokenizer, processor.image_token_id), processor


@pytest.fixture(scope="session", params=VLM_FAMILIES)
def tiny_vlm_onert(request, tmp_path_factory) -> TinyVLM:
    from circleops.cli import main

    family = request.param
    root = tmp_path_factory.mktemp(family)
    model, processor = _build(family, root)
    model_dir = root / f"{family}-tiny"
    model.save_pretrained(str(model_dir))
    processor.save_pretrained(str(model_dir))
    photo, other = save_image(root / "photo.png", 40, 56, 0), save_image(root / "other.png", 30, 30, 1)
    out = root / "out"
    prefill = VLM_PREFILL if family == "smolvlm" else PALI_PREFILL
    with one_torch_thread():
        rc = main(["convert", str(model_dir), "--graphs", "vision,prefill,decode", "--target", "onert", "--verify",
                   "-q", "--seq-len", prefill, "--max-cache-len", str(VLM_CACHE), "-o", str(out)])
    assert rc == 0
    return TinyVLM(family, model_dir, out, copy.deepcopy(model), processor, photo, other, prefill)
