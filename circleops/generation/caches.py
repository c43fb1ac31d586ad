"""The self-attention caches a generation keeps between steps, as numpy arrays in the
layout the graphs take, and how a step's cache outputs are written into them.

A graph's ``cache_update`` says what its cache outputs are: "full", the whole updated caches
(they become the next step's inputs), or "rows", only the step's new k/v rows, which
:func:`store_caches` writes into the caches at the step's position in place (no cache is
copied per step). The layouts (k caches then v caches, one per layer each):

* :data:`~circleops.options.SLOT_MAJOR`: caches [1, C, Hkv, D], rows [1, S, Hkv, D];
* :data:`~circleops.options.HEAD_MAJOR`: k [1, Hkv, C, D], v [1, Hkv, D, C], rows [1, S, Hkv, D];
* :data:`HEADS_ROWS` (encoder-decoder graphs: Whisper's): k and v [1, H, C, D], rows [1, H, S, D].
"""
from __future__ import annotations

from typing import Any, Sequence

from circleops.errors import ModelLoadError
from circleops.options import HEAD_MAJOR, HEADS_ROWS, SLOT_MAJOR


def empty_caches(manifest: Any) -> list[Any]:
    """Zero caches for the manifest's graphs (k caches then v caches, in its cache_layout and
    float type: :func:`float_dtype`)."""
    return zero_caches(manifest.cache_shapes, float_dtype(manifest))


def float_dtype(manifest: Any) -> str:
    """The numpy dtype of the float inputs the manifest's graphs take (caches, image
    embeddings): float16 for files converted with --dtype fp16 (they compute in fp16, the
    caches included), else float32 (fp32 and the weight formats, whose activations are fp32)."""
    return "float16" if getattr(manifest, "dtype", None) == "fp16" else "float32"


def zero_caches(shapes: Sequence[Sequence[int]], dtype: str = "float32") -> list[Any]:
    """One array of zeros per shape (float32, or ``dtype``)."""
    import numpy as np

    return [np.zeros(shape, dtype=dtype) for shape in shapes]


def _slot_axis(layout: str, i: int, half: int) -> int:
    """The axis of the cache slots in cache ``i`` of ``layout``."""
    if layout == HEAD_MAJOR:
        return 2 if i < half else 3
    return 2 if layout == HEADS_ROWS else 1


def check_cache_outputs(caches: list[Any], outputs: Sequence[Any], cache_layout: str) -> None:
    """ModelLoadError unless a graph's new k/v rows fit the caches (a damaged or foreign graph
    file, or a manifest that does not describe it)."""
    ok = len(outputs) == len(caches)
    half = len(caches) // 2
    for i, (cache, out) in enumerate(zip(caches, outputs)):
        if not ok:
            break
        shape = tuple(getattr(out, "shape", ()))
        c = tuple(cache.shape)
        if cache_layout == HEADS_ROWS:  # rows [1, H, S, D] of caches [1, H, C, D]
            ok = len(shape) == 4 and shape[0] == 1 and (shape[1], shape[3]) == (c[1], c[3])
            continue
        heads_dim = c[2:] if cache_layout != HEAD_MAJOR else (c[1], c[3]) if i < half else (c[1], c[2])
        ok = len(shape) == 4 and shape[0] == 1 and shape[2:] == heads_dim
    if not ok:
        raise ModelLoadError(f"the graph returned caches of shapes {[list(getattr(o, 'shape', ())) for o in outputs]}, "
                             f"which do not fit the manifest's {len(caches)} caches of shapes "
                             f"{sorted({tuple(c.shape) for c in caches})}; the graph file or its "
                             f"manifest.json is damaged. Convert again with --graphs.")


def store_caches(caches: list[Any], outputs: Sequence[Any], pos: int, cache_update: str,
                 cache_layout: str = SLOT_MAJOR) -> list[Any]:
    """The caches after a step whose cache outputs are ``outputs`` (manifest ``cache_update``):
    "full" -> the outputs themselves (whole updated caches); "rows" -> ``caches``, each with
    its output's S new rows written at slots pos..pos+S-1 in place, in the caches'
    ``cache_layout`` (no cache is copied; slots past the end are dropped, as the "full"
    form drops them)."""
    if cache_update != "rows":
        return list(outputs)  # the next run's input check (check_inputs) sees their shapes
    check_cache_outputs(caches, outputs, cache_layout)
    half = len(caches) // 2
    for i, (cache, rows) in enumerate(zip(caches, outputs)):
        if cache_layout == HEAD_MAJOR:
            if i < half:  # k [1, Hkv, C, D]
                n = min(rows.shape[1], cache.shape[2] - pos)
                cache[0, :, pos:pos + n, :] = rows[0, :n].transpose(1, 0, 2)
            else:  # v [1, Hkv, D, C]
                n = min(rows.shape[1], cache.shape[3] - pos)
                cache[0, :, :, pos:pos + n] = rows[0, :n].transpose(1, 2, 0)
        elif cache_layout == HEADS_ROWS:  # [1, H, C, D] <- [1, H, S, D]
            n = min(rows.shape[2], cache.shape[2] - pos)
            cache[:, :, pos:pos + n] = rows[:, :, :n]
        else:
            n = min(rows.shape[1], cache.shape[1] - pos)
            cache[:, pos:pos + n] = rows[:, :n]
    return caches


def clear_slots(caches: list[Any], n: int, cache_layout: str = SLOT_MAJOR) -> None:
    """Zero cache slots 0..n-1 of ``caches`` (k caches then v caches) in place, in their
    ``cache_layout``: they are then as :func:`empty_caches` makes them."""
    half = len(caches) // 2
    for i, cache in enumerate(caches):
        index = [slice(None)] * cache.ndim
        index[_slot_axis(cache_layout, i, half)] = slice(0, n)
        cache[tuple(index)] = 0


def cache_window(caches: list[Any], window: int, cache_layout: str = SLOT_MAJOR) -> list[Any]:
    """Views of the first ``window`` slots of ``caches`` (k caches then v caches, in their
    ``cache_layout``): the cache inputs of a prefill graph that reads only those slots."""
    half = len(caches) // 2
    views = []
    for i, cache in enumerate(caches):
        index = [slice(None)] * cache.ndim
        index[_slot_axis(cache_layout, i, half)] = slice(0, window)
        views.append(cache[tuple(index)])
    return views
