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


def decode_attributes(data: Any, max_items: int | None = None) -> dict[str, Any]:
    """The dict encoded by :func:`encode_attributes` (or by any other writer).

    The flexbuffer comes from a file, and its references may point at the same vector
    many times over (a few hundred bytes can describe 2^30 elements), so the walk counts
    the elements it produces and stops past ``max_items`` (default: 4 per byte + 1000)."""
    if data is None or len(data) == 0:
        return {}
    raw = bytes(data) if isinstance(data, (bytes, bytearray, memoryview)) else bytes(np.asarray(data, dtype=np.uint8))
    budget = [max_items if max_items is not None else 4 * len(raw) + 1000]
    value = _value(flexbuffers.GetRoot(raw), budget, 0)
    return value if isinstance(value, dict) else {"value": value}


def _value(ref: Any, budget: list[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > 64:
        raise ValueError("the composite attributes describe more elements than their bytes can hold "
                         "(shared or cyclic references)")
    if ref.IsMap:
        m = ref.AsMap
        keys, values = m.Keys, m.Values
        budget[0] -= 2 * len(keys)
        if budget[0] < 0:
            raise ValueError("composite attribute map too large for its bytes")
        return {_value(k, budget, depth + 1): _value(v, budget, depth + 1) for k, v in zip(keys, values)}
    if ref.IsVector:
        vec = ref.AsVector
        budget[0] -= len(vec)
        if budget[0] < 0:
            raise ValueError("composite attribute vector too large for its bytes")
        return [_value(e, budget, depth + 1) for e in vec]
    if ref.IsTypedVector or ref.IsFixedTypedVector:
        vec = ref.AsTypedVector if ref.IsTypedVector else ref.AsFixedTypedVector
        budget[0] -= len(vec)
        if budget[0] < 0:
            raise ValueError("composite attribute vector too large for its bytes")
        return vec.Value
    return ref.Value  # scalars, strings, keys, blobs: bounded by the buffer
