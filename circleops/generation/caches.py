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


def slot_axis(layout: str, i: int, half: int) -> int:
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
    write_rows(caches, outputs, pos, cache_layout)
    return caches


def write_rows(caches: list[Any], outputs: Sequence[Any], pos: int, cache_layout: str = SLOT_MAJOR) -> None:
    """Write each of ``outputs``' S new rows into ``caches`` at slots pos..pos+S-1 in place, in
    ``cache_layout`` (slots past a cache's end are dropped: a cache window takes only its own);
    the outputs are taken as checked (:func:`check_cache_outputs`)."""
    half = len(caches) // 2
    if cache_layout != HEADS_ROWS and caches and outputs[0].shape[1] == 1 and pos < _slots(caches, cache_layout):
        # a decode step's one row, within the caches (the caches of a graph set all have the
        # same slots): no transpose, no clipping; SmolLM2's 60 rows in 55 us instead of 150,
        # and a LiteRT step writes them twice (WindowStore), ~3 % of an int4 step (issue 34)
        k_slot = (0, slice(None), pos) if cache_layout == HEAD_MAJOR else (0, pos)
        v_slot = (0, slice(None), slice(None), pos) if cache_layout == HEAD_MAJOR else k_slot
        for i, (cache, rows) in enumerate(zip(caches, outputs)):
            cache[k_slot if i < half else v_slot] = rows[0, 0]
        return
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


def row_slots(caches: list[Any], outputs: Sequence[Any], cache_layout: str = SLOT_MAJOR) -> list[tuple[Any, Any]]:
    """(slots, row) per cache for one-row ``outputs`` [1, 1, Hkv, D] (not HEADS_ROWS): ``slots``
    a view of the cache indexed by slot first ([C, Hkv, D], whatever the layout), ``row`` the
    output's [Hkv, D]; ``slots[pos] = row`` writes it at slot pos (:func:`write_rows`' work
    without making the views again: the arrays must stay the same)."""
    half = len(caches) // 2
    out = []
    for i, (cache, rows) in enumerate(zip(caches, outputs)):
        if cache_layout == HEAD_MAJOR:  # k [Hkv, C, D] -> [C, Hkv, D]; v [Hkv, D, C] -> [C, Hkv, D]
            slots = cache[0].transpose(1, 0, 2) if i < half else cache[0].transpose(2, 0, 1)
        else:
            slots = cache[0]
        out.append((slots, rows[0, 0]))
    return out


def clear_slots(caches: list[Any], n: int, cache_layout: str = SLOT_MAJOR) -> None:
    """Zero cache slots 0..n-1 of ``caches`` (k caches then v caches) in place, in their
    ``cache_layout``: they are then as :func:`empty_caches` makes them."""
    half = len(caches) // 2
    for i, cache in enumerate(caches):
        index = [slice(None)] * cache.ndim
        index[slot_axis(cache_layout, i, half)] = slice(0, n)
        cache[tuple(index)] = 0


def cache_window(caches: list[Any], window: int, cache_layout: str = SLOT_MAJOR) -> list[Any]:
    """Views of the first ``window`` slots of ``caches`` (k caches then v caches, in their
    ``cache_layout``): the cache inputs of a prefill graph that reads only those slots."""
    half = len(caches) // 2
    views = []
    for i, cache in enumerate(caches):
        index = [slice(None)] * cache.ndim
        index[slot_axis(cache_layout, i, half)] = slice(0, window)
        views.append(cache[tuple(index)])
    return views


IN_PLACE, COPIED = "in place", "copied"  # WindowStore.path: how a session's cache inputs reached it


class WindowStore:
    """The decode sessions' cache inputs kept in the runtime's own input memory, so that a
    decode step writes only its new rows there instead of its whole cache window (issue 34).

    LiteRT's Session gives writable arrays over the input buffers its run reads
    (``input_views``, circleops.runtime.litert). A session's views are made equal to the
    caches' window once (:meth:`inputs`: a copy of the window, as every step did before); from
    then on each step's rows go into them (:meth:`stored`) beside the caches, so they stay
    equal to the window the copying path would write. Any other change of the caches (a
    prefill, a reset, new arrays) makes every session copy its window again on its next step
    (:meth:`changed`). A session without views (onert, the reference interpreter, a split
    model's chain, LiteRT without the C API symbols or with non-host buffers) gets ``None``
    from :meth:`inputs`: the caller passes the window as before.

    While one session's views are current, a step's rows may go into them only
    (:meth:`stored` with ``defer``): the caches fall behind by those slots, which
    :meth:`flush` copies over before anything else reads the caches or another session's
    views are made. The caches' k/v rows are scattered writes (v [1, Hkv, D, C]: a cache line
    per element) into memory no graph reads between prefills, so writing them twice per step
    cost ~0.25 ms of a SmolLM2 int4 step (issue 34).
    """

    def __init__(self, layout: str):
        self.layout = layout
        self._views: dict[int, tuple[Any, list[Any] | None]] = {}  # id(session) -> (session, its cache views)
        self._current: int | None = None  # id of the session whose views equal the window, if any
        self._master: list[Any] | None = None  # the caches (list) they equal
        self.path: str = ""  # how the last step's caches reached its session: IN_PLACE, COPIED or "" (no views asked)
        # ids of the sessions whose runs return their output memory itself (outputs_in_place):
        # a step's new rows are read from there, its logits copied before the next run
        self._shared_outputs: set[int] = set()
        self._pending: tuple[int, int] | None = None  # slots lo..hi-1 in the current views only
        # id(session) -> (its first row output, row_slots of its views and outputs): for
        # sessions whose outputs are the same memory every step (outputs_in_place)
        self._pairs: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}

    def flush(self) -> None:
        """Copy the slots written into the current session's views only (:meth:`stored` with
        ``defer``) into the caches: the caches are then complete."""
        if self._pending is None:
            return
        lo, hi = self._pending
        self._pending = None
        bound = self._views.get(self._current) if self._current is not None else None
        if bound is None or bound[1] is None or self._master is None:
            raise RuntimeError("WindowStore: rows pending without the views that hold them")  # a bug, not input
        half = len(self._master) // 2
        for i, (view, cache) in enumerate(zip(bound[1], self._master)):
            index = [slice(None)] * cache.ndim
            index[slot_axis(self.layout, i, half)] = slice(lo, hi)
            cache[tuple(index)] = view[tuple(index)]

    def changed(self) -> None:
        """The caches changed other than through :meth:`stored`: no session's views are current
        (rows still pending in the old ones are copied into the caches first)."""
        self.flush()
        self._current = None

    def _bind(self, session: Any, first: int, windows: list[Any]) -> list[Any] | None:
        """``session``'s views of its cache inputs first..first+len(windows)-1, if it gives
        views of their shapes and dtypes, else None (made once per session)."""
        key = id(session)
        bound = self._views.get(key)
        if bound is None or bound[0] is not session:
            ask = getattr(session, "input_views", None)
            views = ask() if ask is not None else None
            if views is not None:
                views = views[first:first + len(windows)]
                if len(views) != len(windows) or any(v.shape != w.shape or v.dtype != w.dtype
                                                     for v, w in zip(views, windows)):
                    views = None
            ask_out = getattr(session, "outputs_in_place", None)
            if views is not None and ask_out is not None and ask_out():
                self._shared_outputs.add(key)
            else:
                self._shared_outputs.discard(key)
            self._views[key] = bound = (session, views)
            self.path = IN_PLACE if views is not None else COPIED if ask is not None else ""
        return bound[1]

    def inputs(self, session: Any, first: int, caches: list[Any], width: int, in_place: bool = True) -> list[Any] | None:
        """The cache inputs to give ``session`` (whose caches start at input ``first`` and span
        ``width`` slots of ``caches``): its own input memory, equal to the caches' first
        ``width`` slots (copied there when it is not already), or None where it has none (or
        not ``in_place``: the caller copies the window, as runtimes without views do)."""
        if not in_place:
            self.flush()
            self._current = None
            self.path = COPIED if getattr(session, "input_views", None) is not None else ""
            return None
        bound = self._views.get(id(session))
        if bound is not None and bound[0] is session and self._current == id(session) and self._master is caches:
            self.path = IN_PLACE
            return bound[1]
        self.flush()  # another session's (or stale) views: the caches must be whole before the copy
        windows = cache_window(caches, width, self.layout) if width < _slots(caches, self.layout) else caches
        views = self._bind(session, first, windows)
        if views is None:
            self._current = None
            self.path = COPIED if getattr(session, "input_views", None) is not None else ""
            return None
        for view, window in zip(views, windows):
            view[...] = window
        self._current, self._master, self.path = id(session), caches, IN_PLACE
        return views

    def outputs_shared(self, session: Any) -> bool:
        """Whether ``session``'s runs return arrays over its own output memory, which its next
        run overwrites (what a caller keeps, such as the logits, must be copied)."""
        return id(session) in self._shared_outputs and self._views.get(id(session), (None,))[0] is session

    def stored(self, session: Any, outputs: Sequence[Any], pos: int, defer: bool = False) -> bool:
        """A step of ``session`` at ``pos`` returned the rows ``outputs``: write them into its
        views (the other sessions' views are now stale). Without ``defer`` the caller has
        written them into the caches too; with it, rows that land in the views are left
        pending (:meth:`flush`) and True says the caller must not write the caches (False:
        it must: no current views here, or a slot past the views' window)."""
        bound = self._views.get(id(session))
        if bound is None or bound[1] is None or self._current != id(session):
            self.flush()
            self._current = None
            return False
        views = bound[1]
        pairs = self._pairs.get(id(session))
        if pairs is not None and pairs[0] is outputs[0] and pos < len(pairs[1][0][0]):
            for slots, row in pairs[1]:  # the same output memory every step: its rows' views made once
                slots[pos] = row
        else:
            write_rows(views, outputs, pos, self.layout)
            if id(session) in self._shared_outputs and outputs[0].shape[1] == 1 and self.layout != HEADS_ROWS:
                self._pairs[id(session)] = (outputs[0], row_slots(views, outputs, self.layout))
        if not defer or pos + outputs[0].shape[1 if self.layout != HEADS_ROWS else 2] > _slots(views, self.layout):
            return False  # written into the caches by the caller (slots past the window dropped here)
        lo, hi = self._pending or (pos, pos)
        if hi != pos:  # not the next slot after the pending ones: the caches take the old ones now
            self.flush()
            lo = pos
        self._pending = (lo, pos + outputs[0].shape[1 if self.layout != HEADS_ROWS else 2])
        return True


def _slots(caches: list[Any], layout: str) -> int:
    """How many slots ``caches`` hold."""
    return caches[0].shape[slot_axis(layout, 0, len(caches) // 2)] if caches else 0
