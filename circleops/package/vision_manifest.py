"""The manifest's ``vision`` entry of a vision-language model's directory: what
``circleops convert --graphs vision,prefill,decode`` (circleops.recipes.vlm) writes and
``circleops generate DIR --image`` (circleops.generation.vision) reads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circleops.errors import CircleOpsError, ModelLoadError

VISION_GRAPH = "vision"
VLM_GRAPH_NAMES = (VISION_GRAPH, "prefill", "decode")
IMAGE_EMBEDS = "image_embeds"
PIXEL_VALUES = "pixel_values"
PREFIX_LEN = "prefix_len"  # a prefix-LM's prefill input: the prompt positions that attend both ways
ROPE_POSITIONS = "rope_positions"  # an M-RoPE prefill's input [3, 1, N]: each row's t/h/w rotary position
ROPE_DELTA = "rope_delta"  # an M-RoPE decode's input [1]: the prompt's rotary position less its length
# the config model_types circleops converts with --graphs vision,prefill,decode: the keys of
# circleops.recipes.vlm.VLM_MODEL_TYPES (the converted rows of circleops.adapters.vlm), named
# here so that telling a VLM directory from an LLM's imports no torch (a convert's refusals
# come before torch's import: tests/cli/test_light_imports.py checks the two agree)
VLM_MODEL_TYPE_NAMES = ("idefics3", "smolvlm", "paligemma", "gemma3", "qwen2_vl", "qwen2_5_vl")
# a patch tower's vision graph inputs after pixel_values (adapters.qwen_vision.VisionIndex.inputs)
PATCH_INDEX = ("vision_rope", "window_index", "reverse_index", "full_segment", "window_segment")


@dataclass
class VisionSpec:
    """The manifest's ``vision`` entry: how the host feeds images to the graphs."""

    graph: str  # the vision graph (a key of the manifest's files)
    image_token_id: int
    image_seq_len: int  # embeddings (and <image> tokens) per tile
    tile_size: int  # the vision graph's pixel_values is [1, 3, tile_size, tile_size]
    hidden_size: int  # the text model's: image_embeds rows
    family: str  # model_type
    prefix_lm: bool = False  # the prefill takes prefix_len: the prompt prefix attends both ways
    image_blocks: bool = False  # each image's tokens attend both ways (Gemma 3): a block is never split in runs
    mrope: bool = False  # 3-D rotary positions: the prefill takes rope_positions, the decode rope_delta
    # a patch tower (Qwen): {"grid": [t, h, w], "patch_dim", "merge_size", "patch_size", "window_size"}; every
    # image is resized to tile_size x tile_size pixels first (circleops.generation.patch_images)
    patches: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"graph": self.graph, "image_token_id": self.image_token_id, "image_seq_len": self.image_seq_len,
                "tile_size": self.tile_size, "hidden_size": self.hidden_size, "family": self.family,
                "prefill_input": IMAGE_EMBEDS, "prefix_lm": self.prefix_lm,
                **({"image_blocks": True} if self.image_blocks else {}),
                **({"mrope": True} if self.mrope else {}), **({"patches": self.patches} if self.patches else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> "VisionSpec":
        try:
            spec = cls(graph=str(data["graph"]), image_token_id=int(data["image_token_id"]),
                       image_seq_len=int(data["image_seq_len"]), tile_size=int(data["tile_size"]),
                       hidden_size=int(data["hidden_size"]), family=str(data.get("family", "")),
                       prefix_lm=bool(data.get("prefix_lm", False)),
                       image_blocks=bool(data.get("image_blocks", False)), mrope=bool(data.get("mrope", False)),
                       patches=_patches(data.get("patches")))
        except (KeyError, TypeError, ValueError) as err:
            raise ModelLoadError(f"{where}: the vision entry is incomplete ({type(err).__name__}: {err}). Convert "
                                 f"again with --graphs vision,prefill,decode.") from None
        if min(spec.image_seq_len, spec.tile_size, spec.hidden_size) < 1 or spec.image_token_id < 0:
            raise ModelLoadError(f"{where}: the vision entry's sizes must be positive. Convert again.")
        if spec.mrope and not spec.patches:
            raise ModelLoadError(f"{where}: the vision entry has 3-D positions (mrope) and no patch grid (patches): "
                                 f"convert again.")
        return spec


def _patches(data: Any) -> dict[str, Any] | None:
    """The ``patches`` entry, its numbers checked (KeyError / TypeError / ValueError when not)."""
    if data is None:
        return None
    grid = [int(x) for x in data["grid"]]
    out = {"grid": grid, **{k: int(data[k]) for k in ("patch_dim", "merge_size", "patch_size")},
           "window_size": int(data.get("window_size", 0))}
    merge = out["merge_size"]
    if len(grid) != 3 or min(grid) < 1 or min(out["patch_dim"], merge, out["patch_size"]) < 1 or \
            grid[1] % merge or grid[2] % merge or out["window_size"] < 0:
        raise ValueError(f"patches {data} is not a grid of whole merge units")
    return out


def vlm_model_type(model: str | os.PathLike | None = None, config: str | os.PathLike | None = None) -> str | None:
    """The model_type of a vision-language model directory (or config.json) circleops
    converts with ``--graphs vision,prefill,decode``; None for anything else (no torch)."""
    path = Path(config) if config else Path(model) / "config.json" if model else None
    if path is None or not path.is_file():
        return None
    from circleops.inputs.user_files import read_json

    try:
        cfg = read_json(path)
    except CircleOpsError:  # not JSON, or damaged: not a VLM directory (read again, with the error, later)
        return None
    kind = cfg.get("model_type") if isinstance(cfg, dict) else None
    return kind if kind in VLM_MODEL_TYPE_NAMES else None
