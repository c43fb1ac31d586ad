"""A Hugging Face config.json read as a dict and checked, with the standard library only: the
size checks and the split plan read it before anything imports torch (circleops.sources.sizes,
circleops.package.files); circleops.sources.models builds the model from it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from circleops.errors import ModelLoadError
from circleops.inputs.user_files import read_json


def _checked(path: Path) -> dict[str, Any]:
    cfg = read_json(path, error=ModelLoadError)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelLoadError(f"{path} is not a Hugging Face model config: it has no model_type.")
    if not isinstance(cfg["model_type"], str):
        raise ModelLoadError(f"{path}: model_type is {cfg['model_type']!r}, not a name (such as \"llama\"). "
                             "Fix config.json or save the model again (save_pretrained).")
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelLoadError(f"{path}: architectures is {str(archs)[:80]!r}, not a list of class names (such as "
                             "[\"LlamaForCausalLM\"]). Fix config.json or save the model again (save_pretrained).")
    return cfg


def read_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """config.json as a dict, checked to be a Hugging Face config (a ModelLoadError if not)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a Hugging Face model directory holds config.json.")
    return _checked(path)


__all__ = ["read_config_dict"]
