"""A Hugging Face model id as MODEL (``circleops convert HuggingFaceTB/SmolLM2-135M-Instruct``).

The id resolves to a directory of the Hugging Face cache (huggingface_hub's layout,
``models--org--name/snapshots/<rev>/`` with ``refs/main``), in this order:

1. the local cache, without touching the network: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
   else ``~/.cache/huggingface/hub`` — the same directories transformers uses;
2. unless ``HF_HUB_OFFLINE`` is set, a download with huggingface_hub (its progress bar; only
   the files a conversion reads: configs, safetensors weights, tokenizer and processor files);
3. otherwise a ModelLoadError that says where it looked and what to do.

The environment is read at each call (not when huggingface_hub is imported), so a process
can point HF_HOME somewhere else before converting.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from circleops.errors import ModelLoadError

# What a conversion reads: no PyTorch .bin / TF / Flax / ONNX copies of the weights, and no
# .py files (circleops never runs a model's code: circleops.inputs.remote_code).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
# org/name as the hub spells repository ids (one slash, no path-like parts)
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` reads as a hub id ``org/name`` (and is not an existing local path)."""
    return bool(_REPO_ID.match(spec)) and not os.path.exists(spec) and not spec.endswith(
        (".gguf", ".pt2", ".pt", ".json", ".circle", ".tflite"))


def hub_cache() -> Path:
    """The huggingface_hub cache directory, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(spec: str, *, revision: str | None = None) -> str:
    """``spec`` itself when it is not a hub id; else the local snapshot directory of the id
    (from the cache, or downloaded). Raises ModelLoadError when neither works."""
    if not is_repo_id(spec):
        return spec
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelLoadError(f"{spec} is not a local path; as a Hugging Face model id it needs huggingface_hub "
                             "(pip install huggingface_hub).") from None
    cache = hub_cache()
    try:  # the cache first: no network call at all when the model is there
        return huggingface_hub.snapshot_download(spec, revision=revision, cache_dir=str(cache),
                                                 local_files_only=True, allow_patterns=DOWNLOAD_PATTERNS)
    except LocalEntryNotFoundError:
        pass
    except Exception as err:  # a damaged cache entry
        raise ModelLoadError(f"{spec}: the Hugging Face cache {cache} holds a damaged copy "
                             f"({type(err).__name__}: {err}). Delete {cache / ('models--' + spec.replace('/', '--'))} "
                             "and convert again.") from None
    where = f"there is no such local path, and as a hub id it is not in the Hugging Face cache {cache} " \
            "(HF_HUB_CACHE / HF_HOME)"
    if _offline():
        raise ModelLoadError(f"model {spec} not found: {where}, and HF_HUB_OFFLINE is set, so it is not downloaded. "
                             "Unset HF_HUB_OFFLINE on a machine with network access, point HF_HOME at a cache that "
                             "has it, or pass a local model directory.")
    try:
        return huggingface_hub.snapshot_download(spec, revision=revision, cache_dir=str(cache),
                                                 allow_patterns=DOWNLOAD_PATTERNS,
                                                 endpoint=os.environ.get("HF_ENDPOINT") or None)
    except Exception as err:
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"model {spec} not found: {where}, and downloading it failed ({type(err).__name__}: "
                             f"{reason}). Check the id and your network (or log in with `hf auth login` for a gated "
                             "model), or pass a local model directory (config.json + *.safetensors).") from None
