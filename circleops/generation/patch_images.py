"""The host side of a patch-tower vision-language model (a VLMFamily row with ``tower="qwen"``:
Qwen2-VL, Qwen2.5-VL): images of one fixed size, their processor, and the vision graph's
integer inputs.

* One size per converted directory: transformers' processor resizes each image to its own
  grid (a multiple of patch x merge pixels near the image's size), so an image's patch and
  token counts vary. The graphs have static shapes, so every image is first resized to one
  square of ``side`` pixels (the manifest's ``vision.tile_size``; :func:`fixed_side` chooses
  it at convert time from the processor's pixel bounds, 448 px where they allow), which the
  processor's own resize then leaves as it is: one grid, one patch count, one token count.
* :class:`PatchImagesProcessor`: what Qwen2VLProcessor does for images (its constructor
  insists on a video processor, which needs torchvision): the image processor's patches and
  grids, each ``<|image_pad|>`` of the text expanded to ``grid.prod() / merge²`` tokens.
* :func:`graph_index`: the vision graph's integer inputs on that grid (rotary positions,
  Qwen2.5's window order and its inverse, the attention segments), computed by
  adapters.qwen_vision.vision_index from the numbers the manifest records.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

DEFAULT_SIDE = 448  # Qwen2-VL's 448 x 448: 32 x 32 patches of 14 px, 256 image tokens
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def fixed_side(image_processor: Any) -> int:
    """The side in pixels every image is resized to: a multiple of patch x merge whose square
    lies within the processor's ``[shortest_edge, longest_edge]`` pixel counts (its
    min_pixels / max_pixels), as close to :data:`DEFAULT_SIDE` as they allow."""
    factor = int(image_processor.patch_size) * int(image_processor.merge_size)
    size = image_processor.size
    # the pixel bounds: size's shortest/longest_edge (transformers 5), or min/max_pixels (older configs)
    lo = int(_get(size, "shortest_edge") or _get(size, "min_pixels") or getattr(image_processor, "min_pixels", None)
             or factor * factor)
    hi = int(_get(size, "longest_edge") or _get(size, "max_pixels") or getattr(image_processor, "max_pixels", None)
             or DEFAULT_SIDE * DEFAULT_SIDE)
    side = max(factor, math.isqrt(min(max(DEFAULT_SIDE ** 2, lo), hi)) // factor * factor)
    while side * side < lo:
        side += factor
    return side


def _get(size: Any, key: str) -> Any:
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


class PatchImagesProcessor:
    """Text and images -> ``input_ids``, ``pixel_values`` [patches, C*T*P*P], ``image_grid_thw``
    [images, 3] and ``mm_token_type_ids``, as Qwen2VLProcessor makes them, each image first
    resized to ``side`` x ``side`` (see the module docstring). ``image_marker`` is what one
    image is in a prompt (before its expansion)."""

    def __init__(self, image_processor: Any, tokenizer: Any, side: int, image_token: str = "<|image_pad|>"):
        self.image_processor, self.tokenizer, self.side = image_processor, tokenizer, int(side)
        self.image_token = image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(image_token))
        self.image_marker = VISION_START + image_token + VISION_END
        self.name_or_path = getattr(tokenizer, "name_or_path", "")

    @property
    def chat_template(self) -> Any:
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        """The tokenizer's chat template (Qwen's renders ``{"type": "image"}`` as the marker)."""
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def tokens_per_image(self) -> int:
        per = self.side // int(self.image_processor.patch_size) // int(self.image_processor.merge_size)
        return per * per

    def __call__(self, text: Sequence[str] = (), images: Any = None, return_tensors: str = "np", **_: Any) -> dict:
        import numpy as np

        pics = [p for group in (images or []) for p in (group if isinstance(group, (list, tuple)) else [group])]
        out: dict[str, Any] = {}
        text = list(text)
        if pics:
            resample = getattr(self.image_processor, "resample", None)
            sized = [p.resize((self.side, self.side), resample) for p in pics]
            out = dict(self.image_processor(images=sized, return_tensors="np"))
            merge = int(self.image_processor.merge_size) ** 2
            counts = iter(int(np.prod(g)) // merge for g in out["image_grid_thw"])
            parts = text[0].split(self.image_token)
            text = [parts[0] + "".join("\0" * next(counts, 0) + p for p in parts[1:])]
            text = [text[0].replace("\0", self.image_token)]
        out.update(self.tokenizer(text, return_tensors=return_tensors))
        out["mm_token_type_ids"] = (np.asarray(out["input_ids"]) == self.image_token_id).astype(np.int32)
        return out

    def save_pretrained(self, path: str) -> None:
        self.image_processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


def load_patch_processor(path: Path, side: int | None = None) -> PatchImagesProcessor:
    """The processor of a patch-tower model saved in ``path`` (its preprocessor_config.json
    and tokenizer files); ``side``: the directory's fixed image size (None: choose it,
    :func:`fixed_side`)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from circleops.errors import ModelLoadError
    from circleops.sources.models import quiet_transformers

    try:
        with quiet_transformers():
            images = Qwen2VLImageProcessorPil.from_pretrained(str(path), trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        return PatchImagesProcessor(images, tokenizer, fixed_side(images) if side is None else side)
    except Exception as err:  # noqa: BLE001 - transformers / tokenizers on a damaged or missing file
        raise ModelLoadError(f"cannot load the image processor and tokenizer saved in {path}: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:300]}. Convert again from a model directory that holds "
                             f"its preprocessor_config.json and tokenizer.") from None


def graph_index(patches: dict[str, Any]) -> Any:
    """adapters.qwen_vision.VisionIndex of the fixed grid the manifest's ``patches`` entry
    records (grid, merge_size, patch_size, window_size: 0 without windows)."""
    from circleops.adapters.qwen_vision import vision_index

    windows = int(patches.get("window_size", 0))
    visual = SimpleNamespace(spatial_merge_size=int(patches["merge_size"]), patch_size=int(patches["patch_size"]),
                             window_size=windows, fullatt_block_indexes=[] if windows else None)
    grid = [int(x) for x in patches["grid"]]
    return vision_index(visual, grid, grid[0] * grid[1] * grid[2])
