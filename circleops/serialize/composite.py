"""STABLEHLO_COMPOSITE attributes <-> flexbuffer map (StableHLOCompositeOptions.composite_attributes)."""
from __future__ import annotations

from typing import Any

import numpy as np
from flatbuffers import flexbuffers


def _plain(value: Any) -> Any:
    """numpy / torch scalars and tuples -> what flexbuffers.Dumps accepts."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def encode_attributes(attributes: dict[str, Any] | None) -> np.ndarray:
    """A flexbuffer map of ``attributes`` (keys sorted by flexbuffers: deterministic)."""
    return np.frombuffer(flexbuffers.Dumps(_plain(attributes or {})), dtype=np.uint8).copy()


def decode_attributes(data: Any) -> dict[str, Any]:
    """The dict encoded by :func:`encode_attributes` (or by any other writer)."""
    if data is None or len(data) == 0:
        return {}
    value = flexbuffers.Loads(bytes(np.asarray(data, dtype=np.uint8)))
    return value if isinstance(value, dict) else {"value": value}
