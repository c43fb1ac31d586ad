"""A tiny random SmolVLM (Idefics3: SigLIP tower, pixel-shuffle connector, 2-layer Llama)
over the bundled SmolLM2 tokenizer, saved as a model directory is (save_pretrained + its
processor), converted once by the CLI for onert; transformers' greedy generate on the same
model is the expected output of every VLM test."""
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


def save_image(path: Path, height: int, width: int, seed: int) -> Path:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path)
    return path


@dataclass
class TinyVLM:
    model_dir: Path  # config.json + safetensors + processor, as save_pretrained writes them
    out: Path  # convert --graphs vision,prefill,decode --target onert
    model: torch.nn.Module  # the same weights, unfused
    processor: object
    photo: Path  # 56 x 40: split into 4 tiles + the global image
    other: Path  # another image

    def hf_greedy(self, ids: list[int], pixel_values, new: int = VLM_NEW, eos=None) -> list[int]:
        kw = {} if pixel_values is None else {"pixel_values": torch.as_tensor(pixel_values)}
        with torch.no_grad(), one_torch_thread():
            out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      eos_token_id=eos, **kw)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="session")
def tiny_vlm_onert(tmp_path_factory) -> TinyVLM:
    from transformers import AutoTokenizer

    from circleops import vlm
    from circleops.cli import main
    from circleops.models import smollm2_dir

    root = tmp_path_factory.mktemp("vlm")
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": list(vlm.IMAGE_TOKENS)})
    model = tiny_vlm(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
    model_dir = root / "smolvlm-tiny"
    model.save_pretrained(str(model_dir))
    processor = vlm.build_processor(tokenizer, model)
    processor.save_pretrained(str(model_dir))
    photo, other = save_image(root / "photo.png", 40, 56, 0), save_image(root / "other.png", 30, 30, 1)
    out = root / "out"
    with one_torch_thread():
        rc = main(["convert", str(model_dir), "--graphs", "vision,prefill,decode", "--target", "onert", "--verify",
                   "-q", "--seq-len", VLM_PREFILL, "--max-cache-len", str(VLM_CACHE), "-o", str(out)])
    assert rc == 0
    return TinyVLM(model_dir, out, copy.deepcopy(model), processor, photo, other)
