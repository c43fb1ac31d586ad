"""The torch modules a vision-language model's graphs are exported from (circleops.vlm):
its text model as a causal LM for :class:`~circleops.adapters.decode.DecoderWithCache`, its
vision tower + connector on one image tile, and a prefill that merges image embeddings in
at the image tokens (Idefics3 / SmolVLM: ``model.model.vision_model``, ``.connector``,
``.text_model``, ``model.lm_head``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class TextLM(torch.nn.Module):
    """The text model of a vision-language model as a causal LM (``model`` = the Llama
    body, ``lm_head``, ``config`` = its text config): what DecoderWithCache takes. It holds
    the model's own modules: fusing it fuses them."""

    def __init__(self, vlm: Any):
        super().__init__()
        self.model = vlm.model.text_model
        self.lm_head = vlm.lm_head
        self.config = vlm.config.text_config
        self.generation_config = getattr(vlm, "generation_config", None)


class VisionTower(torch.nn.Module):
    """``pixel_values [1, 3, S, S]`` (one tile) -> ``image_embeds [1, T, H]``: the vision
    model and the connector (pixel shuffle, projection), as ``get_image_features`` runs them
    on a tile without padding (every patch attended)."""

    def __init__(self, vlm: Any):
        super().__init__()
        self.vision_model = vlm.model.vision_model
        self.connector = vlm.model.connector

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.connector(self.vision_model(pixel_values=pixel_values).last_hidden_state)


class ImagePrefill(torch.nn.Module):
    """A prefill of ``step`` (DecoderWithCache) that merges image embeddings in:
    ``forward(input_ids [1, N], pos [1], logits_row [1], image_embeds [1, N, H], *caches)``;
    a row whose id is the image token takes its ``image_embeds`` row (what the model's
    ``inputs_merger`` does with the image features), every other row its token embedding.
    Returns what the step's one-row prefill returns."""

    def __init__(self, step: Any, image_token_id: int):
        super().__init__()
        self.model = step.model  # registered under the decode step's name: the same parameter names
        self._run = step.run
        self.image_token_id = int(image_token_id)

    def forward(self, input_ids: Tensor, pos: Tensor, row: Tensor, image_embeds: Tensor, *caches: Tensor):
        embeds = self.model.model.embed_tokens(input_ids)
        is_image = (input_ids == self.image_token_id).unsqueeze(-1)
        embeds = torch.where(is_image, image_embeds.to(embeds.dtype), embeds)
        return self._run(input_ids, pos, caches, row, inputs_embeds=embeds)
