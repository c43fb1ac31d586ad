"""No code from a model directory: what is checked before transformers reads one.

transformers imports Python files shipped in a model directory when a config names them
(``auto_map``: ``{"AutoTokenizer": "tokenization_x.XTokenizer", ...}``) and
``trust_remote_code`` allows it; left unset, it asks "Do you wish to run the custom code?
[y/N]" on stdin (in ``circleops chat`` stdin is the conversation) and, unanswered, fails
after a 15 s wait. circleops passes ``trust_remote_code=False`` to every ``from_pretrained``
and, before that, :func:`refuse_remote_code` reads the directory's configs and refuses one
that names code, with an error naming the file and the key: a model whose stock class would
be built in place of its custom one is a different model, not a working one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from circleops.errors import ModelLoadError

# The files transformers' Auto* classes read an ``auto_map`` (or a custom class name) from:
# the model config, the tokenizer's, the image processor's / feature extractor's, the
# processor's and the video processor's.
CODE_CONFIG_FILES = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json",
                     "feature_extractor_config.json", "image_processor_config.json",
                     "video_preprocessor_config.json")
# keys that make transformers import a module of the directory
CODE_KEYS = ("auto_map", "custom_pipelines")
_MAX_READ = 64 << 20  # a config is kilobytes; a bigger "config" is not one transformers reads either


def _read(path: Path) -> Any:
    """The JSON of ``path``, or None when it is not a readable JSON file (then transformers
    cannot read an auto_map from it either; its own loaders report the damage)."""
    try:
        if path.stat().st_size > _MAX_READ:
            return None
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def _code_key(data: Any) -> tuple[str, Any] | None:
    """(key path, value) of the first code-naming key in ``data``, nested configs included
    (a VLM's text_config / vision_config), searched without recursion."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                name = f"{where}.{key}" if where else str(key)
                if key in CODE_KEYS and value:
                    return name, value
                stack.append((name, value))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
    return None


def remote_code_entry(directory: str | os.PathLike) -> tuple[Path, str, Any] | None:
    """(file, key, value) of the first config in ``directory`` (or the one config file
    ``directory`` names) that names code to import, or None."""
    d = Path(directory)
    files = [d] if d.is_file() else [d / name for name in CODE_CONFIG_FILES] if d.is_dir() else []
    for path in files:
        if path.is_file():
            found = _code_key(_read(path))
            if found is not None:
                return path, found[0], found[1]
    return None


def refuse_remote_code(directory: str | os.PathLike) -> None:
    """ModelLoadError when a config in ``directory`` names Python code of the directory
    (``auto_map``, ``custom_pipelines``); called before every ``from_pretrained``.
    ``directory`` may also be one config file (``--config config.json``)."""
    found = remote_code_entry(directory)
    if found is None:
        return
    path, key, value = found
    shown = json.dumps(value)
    shown = shown if len(shown) <= 160 else shown[:157] + "..."
    raise ModelLoadError(
        f"{path}: refusing to load: its {key!r} ({shown}) names Python code shipped with the model, and circleops "
        f"never runs code from a model directory (transformers is called with trust_remote_code=False). Use a model "
        f"whose classes transformers itself provides, or, if the model does not need that code, remove {key!r} "
        f"from {path.name}.")
