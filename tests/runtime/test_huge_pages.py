"""The XNNPACK weight cache's page cache in 2 MiB folios before LiteRT maps it (issue 34).

A decode step streams every packed weight; mapped in 4 KiB pages they cost a TLB miss each
(SmolLM2 int4: 6.66 -> 5.43 ms of CPU per token once mapped with 2 MiB entries,
bench/results/71-int4-decode-step.yaml). circleops.system.huge_pages.huge_page_cache makes the
file's cached pages 2 MiB folios; circleops.runtime.litert calls it on a finished cache before
each load.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

from circleops.runtime import litert
from circleops.system import huge_pages


def _thp_for_files() -> bool:
    """Whether this kernel maps file pages with 2 MiB entries on request: transparent huge
    pages not off, and smaps reporting FilePmdMapped (Linux 6.x on the project's machines)."""
    try:
        enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return False
    return "[never]" not in enabled and "FilePmdMapped:" in smaps


def test_the_cache_file_ends_in_huge_pages_unchanged(tmp_path):
    path = tmp_path / "w.xnnpack"
    data = os.urandom(3 * huge_pages.HUGE + 12345)  # three whole 2 MiB spans and a tail
    path.write_bytes(data)
    _small_folios(path)
    result = huge_pages.huge_page_cache(path)
    assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()  # the bytes stay
    if _thp_for_files() and os.statvfs(tmp_path).f_bsize == 4096 and result is not None:
        before, after = result
        # read back in small folios (as a file paged out and faulted in again is), then mapped
        # with 2 MiB entries over (nearly) the whole aligned span
        assert before < huge_pages.ENOUGH * 3 * huge_pages.HUGE <= after, result
        assert huge_pages.huge_page_cache(path) == (after, after)  # done once: a second call reads only
    else:  # no such support here: nothing measured, nothing changed but the read
        assert result is None or result[1] <= 3 * huge_pages.HUGE


def _small_folios(path: Path) -> None:
    """The file's page cache dropped and faulted in again through a plain mapping, 4 KiB at a
    time: small folios, as a cache DAMON paged out and a later run read back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # a dirty page is not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            sum(m[i] for i in range(0, len(m), 4096))
    finally:
        os.close(fd)


def test_no_second_reread_where_it_gave_no_huge_pages(tmp_path, monkeypatch):
    """A kernel or file system that makes no 2 MiB folios: the first file is dropped and read
    again once, and no later file of that file system is (each would be a whole re-read from
    disk at every load, for nothing)."""
    monkeypatch.setattr(huge_pages, "_NO_GAIN", set())
    monkeypatch.setattr(huge_pages, "_thp_enabled", lambda: True)
    populated, dropped = [], []
    monkeypatch.setattr(huge_pages, "_populate", lambda libc, fd, size: populated.append(size) or 0)
    real_fadvise = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append(advice)
                        or real_fadvise(fd, off, n, advice))
    for name in ("a.xnnpack", "b.xnnpack"):
        (tmp_path / name).write_bytes(b"\1" * (2 * huge_pages.HUGE))
    assert huge_pages.huge_page_cache(tmp_path / "a.xnnpack") == (0, 0)
    assert len(populated) == 2 and dropped == [os.POSIX_FADV_DONTNEED]
    assert huge_pages.huge_page_cache(tmp_path / "b.xnnpack") == (0, 0)
    assert len(populated) == 3 and len(dropped) == 1  # mapped once, never dropped


def test_small_files_are_left_alone(tmp_path):
    path = tmp_path / "small.xnnpack"
    path.write_bytes(b"\0" * 4096)
    assert huge_pages.huge_page_cache(path) is None
    assert huge_pages.huge_page_cache(tmp_path / "missing") is None


def test_litert_asks_for_huge_pages_before_each_load(tmp_path, monkeypatch):
    """Before mapping a finished cache, and after building one (before its reload)."""
    calls, loads = [], []
    monkeypatch.setattr(huge_pages, "huge_page_cache", lambda path: calls.append(("huge", Path(path))))

    class Compiled:  # stands in for LiteRT's CompiledModel: the first load writes the cache
        def __init__(self, path, threads, cache):
            loads.append(("load", Path(cache)))
            calls.append(loads[-1])
            Path(cache).write_bytes(b"packed")

    monkeypatch.setattr(litert, "_Compiled", Compiled)
    cache = tmp_path / "m.xnnpack"
    litert._mapped_cache_model("m.tflite", 1, cache)  # builds it, then loads it again
    assert calls == [("load", cache), ("huge", cache), ("load", cache)]
    calls.clear()
    litert._mapped_cache_model("m.tflite", 1, cache)  # finished: huge pages, then the load
    assert calls == [("huge", cache), ("load", cache)]
