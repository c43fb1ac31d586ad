"""The torch modules a vision-language model's graphs are exported from (circleops.recipes.vlm),
built from one declarative row per family (:class:`VLMFamily`): where its vision tower,
projector and text model are, how many embeddings an image gives, and what its prefill
mask is. Rows: SmolVLM / Idefics3, PaliGemma, Gemma 3, Qwen2-VL / Qwen2.5-VL (``converted``
says which families circleops.recipes.vlm writes graphs for: all four rows).

* the vision graph: ``projector(vision(pixel_values).last_hidden_state)`` on one image
  (:class:`VisionTower`): SmolVLM's connector (pixel shuffle + linear), PaliGemma's linear
  ``multi_modal_projector``, Gemma 3's pooled, RMS-normed projection; Qwen's patch tower with
  window attention and patch merger is adapters.qwen_vision's (``tower="qwen"``);
* the merge (:class:`ImagePrefill`): each image token takes its image embedding instead of its
  token embedding, as both families' ``masked_scatter`` / ``inputs_merger`` do; the text tokens'
  embedding is the text model's own, with its scale (Gemma's ``sqrt(hidden)`` is inside its
  ``embed_tokens``: transformers 5 no longer divides PaliGemma's image features by it);
* the prefill mask: causal (SmolVLM), or a prefix-LM (PaliGemma: the image and prompt tokens,
  ``token_type_ids == 0``, attend to each other both ways): the prefill graph then takes
  ``prefix_len`` and builds the mask from it and ``pos`` (DecoderWithCache's ``prefix_len``);
  or causal with each image block attended both ways (Gemma 3: the blocks come from the
  image tokens in-graph, DecoderWithCache's ``blocks``);
* positions: the cache slots, or (``mrope``) Qwen's 3-D t/h/w positions computed on the host
  as transformers' get_rope_index does (adapters.qwen_vision.mrope_positions), an input of the
  prefill; the decode step (:class:`MRopeDecode`) adds the prompt's delta to ``pos``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor


@dataclass(frozen=True)
class VLMFamily:
    """One vision-language family: dotted attribute paths from the transformers model."""

    name: str  # "paligemma"
    classes: dict[str, str]  # config model_type -> the transformers class
    vision: str  # the vision tower: (pixel_values=...) -> .last_hidden_state
    projector: str  # vision features -> text embeddings
    text: str  # the text body (embed_tokens, layers, norm, rotary_emb)
    image_seq_len: str  # embeddings (image tokens) per image or tile; "": by the image's size (Qwen)
    prefix_lm: bool = False  # bidirectional over the prompt prefix: the prompt in one prefill run
    position_offset: int = 0  # the RoPE position of cache slot 0 (PaliGemma counts from 1)
    image_blocks: bool = False  # each image's tokens attend to each other both ways (Gemma 3)
    mrope: bool = False  # 3-D rotary positions (t, h, w) from the host: Qwen2-VL's M-RoPE
    tower: str = "pooled"  # "pooled": VisionTower on a tile; "qwen": adapters.qwen_vision's patches tower
    converted: bool = True  # circleops convert/generate take it (recipes.vlm); False: the torch side only so far

    def text_body(self, vlm: Any) -> torch.nn.Module:
        body = _path(vlm, self.text)
        return _ShiftedBody(body, self.position_offset) if self.position_offset else body

    def tokens_per_image(self, vlm: Any) -> int:
        if not self.image_seq_len:
            raise ValueError(f"{self.name}: the image tokens depend on each image's size (its grid)")
        return int(_path(vlm, self.image_seq_len))

    @contextlib.contextmanager
    def explicit_mask(self, vlm: Any) -> Iterator[None]:
        """While exporting: a prefix-LM's text layers count as causal layers. PaliGemma's
        Gemma layers say ``is_causal = False`` (``use_bidirectional_attention``), which only
        tells SDPA what to do when no mask is given; the graphs always pass the prefix-LM
        mask, which decides. Restored afterwards: the model's own forward is unchanged."""
        layers = [m for m in _path(vlm, self.text).modules() if getattr(m, "is_causal", True) is False]
        if not self.prefix_lm:
            layers = []
        for m in layers:
            m.is_causal = True
        try:
            yield
        finally:
            for m in layers:
                m.is_causal = False


SMOLVLM = VLMFamily(
    name="smolvlm", classes={"idefics3": "Idefics3ForConditionalGeneration", "smolvlm": "SmolVLMForConditionalGeneration"},
    vision="model.vision_model", projector="model.connector", text="model.text_model",
    image_seq_len="model.image_seq_len")
PALIGEMMA = VLMFamily(
    name="paligemma", classes={"paligemma": "PaliGemmaForConditionalGeneration"},
    vision="model.vision_tower", projector="model.multi_modal_projector", text="model.language_model",
    image_seq_len="config.text_config.num_image_tokens", prefix_lm=True, position_offset=1)
GEMMA3 = VLMFamily(
    name="gemma3", classes={"gemma3": "Gemma3ForConditionalGeneration"}, vision="model.vision_tower",
    projector="model.multi_modal_projector", text="model.language_model", image_seq_len="config.mm_tokens_per_image",
    image_blocks=True)
QWEN2_VL = VLMFamily(
    name="qwen2_vl", classes={"qwen2_vl": "Qwen2VLForConditionalGeneration",
                              "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"},
    vision="model.visual", projector="model.visual.merger", text="model.language_model",
    image_seq_len="", mrope=True, tower="qwen")
FAMILIES: tuple[VLMFamily, ...] = (SMOLVLM, PALIGEMMA, GEMMA3, QWEN2_VL)
BY_MODEL_TYPE: dict[str, VLMFamily] = {t: f for f in FAMILIES for t in f.classes}


def family_of(vlm: Any) -> VLMFamily:
    """The family of a transformers vision-language model (KeyError if none)."""
    return BY_MODEL_TYPE[str(vlm.config.model_type)]


def _path(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


class _ShiftedRotary(torch.nn.Module):
    """The model's rotary embedding at ``position + offset`` (PaliGemma's positions are
    1-indexed: ``position_ids = cache_position + 1``)."""

    def __init__(self, rotary: torch.nn.Module, offset: int):
        super().__init__()
        self.rotary = rotary
        self.offset = int(offset)

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary(x, position_ids + self.offset)


class _ShiftedBody(torch.nn.Module):
    """The text body's own modules, its rotary embedding shifted (see _ShiftedRotary)."""

    def __init__(self, body: torch.nn.Module, offset: int):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = body.embed_tokens, body.layers, body.norm
        self.rotary_emb = _ShiftedRotary(body.rotary_emb, offset)
        self.config = body.config


class TextLM(torch.nn.Module):
    """The text model of a vision-language model as a causal LM (``model`` = the text body,
    ``lm_head``, ``config`` = its text config): what DecoderWithCache takes. It holds the
    model's own modules: fusing it fuses them."""

    def __init__(self, vlm: Any):
        super().__init__()
        fam = family_of(vlm)
        self.model = fam.text_body(vlm)
        self.lm_head = vlm.lm_head
        self.config = vlm.config.text_config
        self.generation_config = getattr(vlm, "generation_config", None)
        self._body = [_path(vlm, fam.text)]  # the text model's own forward (a list: not a second submodule)

    def get_output_embeddings(self) -> torch.nn.Module:
        """The lm_head: what makes it a causal LM to the calibration (circleops.quantize)."""
        return self.lm_head

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        """The text model's own forward on text alone, then the lm_head: what a weight
        format's calibration (circleops.quantize: input importance, SmoothQuant) runs."""
        return self.lm_head(self._body[0](input_ids=input_ids, **kwargs).last_hidden_state)


class VisionTower(torch.nn.Module):
    """``pixel_values [1, 3, S, S]`` (one image or tile) -> ``image_embeds [1, T, H]``: the
    vision model and the projector, as ``get_image_features`` runs them on an image without
    padding (every patch attended)."""

    def __init__(self, vlm: Any):
        super().__init__()
        fam = family_of(vlm)
        self.vision_model = _path(vlm, fam.vision)
        self.connector = _path(vlm, fam.projector)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.connector(self.vision_model(pixel_values=pixel_values).last_hidden_state)


class ImagePrefill(torch.nn.Module):
    """A prefill of ``step`` (DecoderWithCache) that merges image embeddings in:
    ``forward(input_ids [1, N], pos [1], logits_row [1], image_embeds [1, N, H], *caches)``
    (a prefix-LM: ``prefix_len [1]`` after ``image_embeds``); a row whose id is the image
    token takes its ``image_embeds`` row (what the model's merge does with the image
    features), every other row its token embedding. Returns what the step's one-row prefill
    returns."""

    def __init__(self, step: Any, image_token_id: int, *, prefix_lm: bool = False, image_blocks: bool = False,
                 mrope: bool = False):
        super().__init__()
        self.mrope = bool(mrope)
        self.model = step.model  # registered under the decode step's name: the same parameter names
        self._run = step.run
        self.image_token_id = int(image_token_id)
        self.prefix_lm = bool(prefix_lm)
        self.image_blocks = bool(image_blocks)
        # an image token past the vocabulary (PaliGemma's may be) is looked up as token 0, as
        # the model does, before its row is replaced
        self._oov = self.image_token_id >= int(self.model.model.embed_tokens.num_embeddings)

    def forward(self, input_ids: Tensor, pos: Tensor, row: Tensor, image_embeds: Tensor, *rest: Tensor):
        rope, rest = (rest[0], rest[1:]) if self.mrope else (None, rest)  # [3, 1, S]
        prefix_len, caches = (rest[0], rest[1:]) if self.prefix_lm else (None, rest)
        is_image = input_ids == self.image_token_id
        ids = torch.where(is_image, torch.zeros_like(input_ids), input_ids) if self._oov else input_ids
        embeds = self.model.model.embed_tokens(ids)
        embeds = torch.where(is_image.unsqueeze(-1), image_embeds.to(embeds.dtype), embeds)
        blocks = image_blocks(is_image[0]) if self.image_blocks else None
        return self._run(input_ids, pos, caches, row, inputs_embeds=embeds, prefix_len=prefix_len, blocks=blocks,
                         rope_positions=rope)


class MRopeDecode(torch.nn.Module):
    """The decode step of an M-RoPE model: ``forward(input_ids [1, 1], pos [1], rope_delta [1],
    *caches)``; the token's rotary position is ``pos + rope_delta`` on all three axes (after the
    prompt, transformers counts on from the prompt's largest position: get_rope_index's delta)."""

    def __init__(self, step: Any):
        super().__init__()
        self.model = step.model
        self._run = step.run

    def forward(self, input_ids: Tensor, pos: Tensor, rope_delta: Tensor, *caches: Tensor):
        p = (pos.reshape(1, 1, 1) + rope_delta.reshape(1, 1, 1)).to(torch.int64) + torch.arange(input_ids.shape[1])
        # three copies by concatenation: onert's BROADCAST_TO takes no int64
        return self._run(input_ids, pos, caches, rope_positions=torch.cat([p, p, p]))


def image_blocks(is_image: Tensor) -> Tensor:
    """Each token's image block [S] (int64): -1 for a text token, else the count of text
    tokens before it, shared by a run of image tokens (transformers' block_sequence_ids up to
    numbering: one run of image tokens is one block)."""
    text_before = torch.cumsum((~is_image).to(torch.int64), 0)
    return torch.where(is_image, text_before, torch.full_like(text_before, -1))
