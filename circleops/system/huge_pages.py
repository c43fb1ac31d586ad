"""A weight file's page cache in huge pages, so that its mappings take fewer TLB misses (issue 34).

A LiteRT decode step streams every packed weight once from the XNNPACK weight cache, a file
LiteRT memory-maps (circleops.runtime.litert). Mapped in 4 KiB pages, SmolLM2 int4's 97 MB are
~25 000 pages, a TLB miss each per step; mapped with 2 MiB entries, ~50. The kernel maps a file
with 2 MiB entries where its page cache holds 2 MiB folios (``FilePmdMapped`` in smaps), and
whether it does depends on how the pages came into the cache: measured on this kind of machine
(Linux 6.18, ext4, transparent huge pages on madvise, DAMON paging out cold memory), a weight
cache written an hour before and read back in small pages decoded at 6.66 ms of CPU per token,
the same bytes in 2 MiB folios at 5.43 (bench/results/71-int4-decode-step.yaml).

:func:`huge_page_cache` makes it so before the file is mapped for use: it maps the file with
``MADV_HUGEPAGE`` and ``MADV_POPULATE_READ`` and, when that does not map most of it with 2 MiB
entries (its cached pages are small folios), drops the file's unmapped cached pages
(``POSIX_FADV_DONTNEED``: clean pages, read again from the file) and reads it again through
such a mapping, whose readahead fills the page cache with 2 MiB folios. Where the kernel has no
such support (no transparent huge pages for files, another OS, a file system without large
folios) nothing changes but the read. Standard library only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_READ = 22  # Linux 5.14+
HUGE = 2 << 20  # a PMD entry on x86-64 and arm64 (4 KiB pages)
ENOUGH = 0.9  # share of the file's 2 MiB-aligned span mapped with 2 MiB entries that is left as it is


def _libc():
    """libc with mmap, munmap and madvise typed, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def pmd_mapped(address: int) -> int | None:
    """Bytes of this process's mapping that starts at ``address`` mapped with 2 MiB entries
    (smaps' FilePmdMapped), or None where smaps does not say."""
    start = f"{address:x}-"
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                if not line.split(maxsplit=1)[0].endswith(":"):  # a mapping's header line
                    inside = line.startswith(start)
                elif inside and line.startswith("FilePmdMapped:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _populate(libc, fd: int, size: int) -> int | None:
    """Map ``fd`` read-only with MADV_HUGEPAGE, fault it all in (MADV_POPULATE_READ), and return
    the bytes mapped with 2 MiB entries (None: the kernel refused a step), unmapped again."""
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return None
    try:
        if libc.madvise(address, size, MADV_HUGEPAGE) != 0 or libc.madvise(address, size, MADV_POPULATE_READ) != 0:
            return None
        return pmd_mapped(address)
    finally:
        libc.munmap(address, size)


# file systems (st_dev) where dropping a file's cache and reading it again gave no 2 MiB
# folios (a kernel or file system without large folios): no further file of theirs is
# dropped and read again, which would cost a whole re-read from disk at every load
_NO_GAIN: set[int] = set()


def _thp_enabled() -> bool:
    """Whether transparent huge pages are not turned off on this system (Linux sysfs)."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def huge_page_cache(path: str | os.PathLike) -> tuple[int, int] | None:
    """Make ``path``'s page cache 2 MiB folios where it is not (see the module docstring); returns
    (bytes mapped with 2 MiB entries before, after), or None where this cannot be done or
    measured here (nothing is changed then). Files under 2 MiB are left alone."""
    libc = _libc()
    if libc is None or not hasattr(os, "posix_fadvise") or not _thp_enabled():
        return None
    try:
        fd = os.open(Path(path), os.O_RDONLY)
    except OSError:
        return None
    try:
        stat = os.fstat(fd)
        size = stat.st_size
        span = size // HUGE * HUGE
        if span == 0:
            return None
        before = _populate(libc, fd, size)
        if before is None or before >= ENOUGH * span or stat.st_dev in _NO_GAIN:
            return None if before is None else (before, before)
        # small folios: dropped (clean, unmapped pages only: a page another process maps
        # stays; written back first, a dirty page is not dropped) and read again through a
        # huge-page mapping, whose readahead makes 2 MiB folios
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        after = _populate(libc, fd, size)
        if after is None or after < ENOUGH * span:
            _NO_GAIN.add(stat.st_dev)
        return None if after is None else (before, after)
    except OSError:
        return None
    finally:
        os.close(fd)


__all__ = ["huge_page_cache", "pmd_mapped"]
