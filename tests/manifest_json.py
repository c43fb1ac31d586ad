"""A converted directory's manifest.json in tests, whatever its schema (circleops.package.manifest):
its fields as one flat dict, an edit of some of them where they live (the top or the kind's
section), and a flat manifest of an earlier version as that version wrote it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from circleops.package.manifest import COMMON_KEYS, MANIFEST_FORMAT, SPEECH_FORMAT, manifest_fields

TOP = {"format", "version", "kind", *COMMON_KEYS}


def _path(directory: str | Path) -> Path:
    d = Path(directory)
    return d if d.name == "manifest.json" else d / "manifest.json"


def read(directory: str | Path) -> dict[str, Any]:
    """The manifest.json as written."""
    return json.loads(_path(directory).read_text())


def fields(directory: str | Path) -> dict[str, Any]:
    """Every field of the manifest as one flat dict (a version-4 manifest's sections merged)."""
    return manifest_fields(read(directory))


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    """The dict of a version-4 manifest where ``key`` lives (the top for the common keys and
    a VLM's ``vision`` entry, else the kind's section); a flat manifest itself."""
    if data.get("version") != 4 or key in TOP or key == "vision":
        return data
    return data["speech" if data.get("kind") == "speech" else "text"]


def edit(directory: str | Path, changes: dict[str, Any] | None = None, drop: Iterable[str] = (),
         to: str | Path | None = None) -> dict[str, Any]:
    """Set ``changes`` and remove ``drop`` in the manifest where each field lives, and write it
    (to ``to``'s manifest.json if given); the edited JSON."""
    data = read(directory)
    for key, value in (changes or {}).items():
        _section(data, key)[key] = value
    for key in drop:
        _section(data, key).pop(key, None)
    _path(to if to is not None else directory).write_text(json.dumps(data))
    return data


def write_legacy(directory: str | Path, version: int, drop: Iterable[str] = (), **changes: Any) -> dict[str, Any]:
    """Rewrite the manifest flat, as circleops wrote it before version 4: format
    circleops-generate ``version`` (1-3), or circleops-speech version 1 for speech graphs."""
    data = read(directory)
    flat = manifest_fields(data)
    speech = data.get("kind") == "speech"
    if speech:
        flat.pop("one_file_per_graph", None)
    flat.update(format=SPEECH_FORMAT if speech else MANIFEST_FORMAT, version=version, **changes)
    for key in drop:
        flat.pop(key, None)
    _path(directory).write_text(json.dumps(flat))
    return flat
