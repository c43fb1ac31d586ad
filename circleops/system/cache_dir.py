"""circleops' cache directory, one for every module that keeps something on disk between
runs (the SmolLM2 directory made from its GGUF, Q4_0 input importances):
``$CIRCLEOPS_CACHE``, else ``~/.cache/circleops``. A module of the base layer: it imports
only the standard library.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

_CACHE_STAMP = "circleops-cache.json"


def cache_dir() -> Path:
    """circleops' cache root: $CIRCLEOPS_CACHE, else ~/.cache/circleops."""
    env = os.environ.get("CIRCLEOPS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "circleops"


def cached_dir(name: str, stamp: dict[str, Any], build: Callable[[Path], None]) -> Path:
    """``cache_dir()/name``, built by ``build(tmp)`` unless a copy made with the same
    ``stamp`` is there. It is built under a temporary name and renamed into place, so that
    parallel processes (pytest -n) never see half a directory; when two build at once,
    one rename wins and the other's copy is dropped."""
    target = cache_dir() / name
    if _cache_valid(target, stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        tmp.chmod(0o755)
        build(tmp)
        with open(tmp / _CACHE_STAMP, "w") as f:
            json.dump(stamp, f)
        if target.exists() and not _cache_valid(target, stamp):  # stale: move it aside
            old = target.with_name(f".{name}-old-{uuid.uuid4().hex}")
            with contextlib.suppress(OSError):
                os.rename(target, old)
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _cache_valid(target, stamp):  # not a lost race to a valid copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cache_valid(target: Path, stamp: dict[str, Any]) -> bool:
    try:
        with open(target / _CACHE_STAMP) as f:
            return json.load(f) == stamp
    except (OSError, ValueError):
        return False


__all__ = ["cache_dir", "cached_dir"]
