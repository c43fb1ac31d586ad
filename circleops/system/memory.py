"""Resident memory given back without loss (issue 32): a file this process has memory-mapped
and no longer reads (the safetensors weights after the write; a .tflite file's weights once
LiteRT has packed them into its XNNPACK cache) keeps its pages counted in the process's RSS
until the kernel needs them. ``madvise(MADV_PAGEOUT)`` reclaims them now. It only takes what
it can without loss: clean file pages are dropped (a later read maps them again from the
file); a page written since is anonymous and, without swap, stays. Standard library only.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from typing import Any, Callable

MADV_PAGEOUT = 21  # linux/mman.h, Linux 5.4+


def mapped_files(keep: Callable[[str], bool]) -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file mappings whose path ``keep`` accepts."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() and keep(parts[5].strip()):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    out.append((start, end, parts[5].strip()))
    except OSError:
        pass
    return out


def page_out(keep: Callable[[str], bool]) -> int:
    """MADV_PAGEOUT over the file mappings whose path ``keep`` accepts; the bytes advised (0
    where there is no /proc or madvise refuses: the pages then stay, nothing else changes)."""
    pager = Pager(keep)
    return sum(pager.release(start, end - start) for start, end in pager.ranges)


def trim_heap() -> bool:
    """glibc's malloc_trim(0): the free pages inside the C heap given back to the kernel.
    torch allocates tensors under 32 MiB from that heap once glibc's mmap threshold has
    grown to them (a freed mapped block raises it), and a freed block between live ones
    stays resident: the 16a4w recipe's rotation and rounding interleave such temporaries
    with the integers and scales they keep, and the heap grew through them to 1-1.5 GB
    resident above what it held (issue 32), so they trim it after each layer or linear.
    False where there is no glibc (nothing else changes)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """libc's malloc_trim, looked up once (find_library runs ldconfig: ~10 ms a call), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise(addr, length, advice), or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


class Pager:
    """The file mappings of this process that ``keep`` accepts, as they were when made, whose
    pages are given back a range at a time (:meth:`release`): a weight the conversion has
    read for the last time (quantized, or run through by a reference forward) leaves the
    resident set at once instead of when the whole file is paged out (issue 32)."""

    def __init__(self, keep: Callable[[str], bool] = lambda path: True):
        self.ranges = sorted((start, end) for start, end, _ in mapped_files(keep))
        self._madvise = _madvise() if self.ranges else None

    def __bool__(self) -> bool:
        return self._madvise is not None

    def release(self, start: int, length: int) -> int:
        """MADV_PAGEOUT over the pages of [start, start + length) inside the mappings (whole
        pages: a neighbour's clean page dropped with it is read again when used); the bytes advised."""
        if self._madvise is None or length <= 0:
            return 0
        page, end, advised = mmap.PAGESIZE, start + length, 0
        for lo, hi in self.ranges:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            a -= a % page
            b = min(hi, b + (-b) % page)
            if self._madvise(a, b - a, MADV_PAGEOUT) == 0:
                advised += b - a
        return advised

    def release_tensor(self, tensor: Any) -> int:
        """:meth:`release` over a CPU tensor's (or numpy array's) bytes."""
        if hasattr(tensor, "data_ptr"):
            if getattr(tensor, "device", None) is not None and tensor.device.type != "cpu":
                return 0
            return self.release(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        iface = getattr(tensor, "__array_interface__", None)
        return self.release(iface["data"][0], tensor.nbytes) if iface else 0


MADV_DONTNEED = 4  # linux/mman.h: a private file mapping's written pages dropped, the file's read again
# Documentation/admin-guide/mm/pagemap.rst: a page in RAM, in swap, a file's (or shared) page
_PAGEMAP_PRESENT, _PAGEMAP_SWAP, _PAGEMAP_FILE = 1 << 63, 1 << 62, 1 << 61


def unwritten_file_range(start: int, length: int) -> bool:
    """Whether [start, start + length) lies in one private file mapping of this process and
    none of its pages has been written since it was mapped (each page is absent or the
    file's own: /proc/self/pagemap), so that dropping those pages (:func:`discard_written`)
    gives back exactly the values it holds now. False where that cannot be read."""
    end = start + length
    inside = False
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= start and end <= hi:
                    inside = len(parts) == 6 and parts[1].endswith("p") and parts[5].strip().startswith("/")
                    break
        if not inside:
            return False
        page = mmap.PAGESIZE
        first, last = start // page, (end - 1) // page
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            data = f.read((last - first + 1) * 8)
    except (OSError, ValueError):
        return False
    import array

    entries = array.array("Q", data)
    return len(entries) == last - first + 1 and all(
        bool(e & _PAGEMAP_FILE) if e & _PAGEMAP_PRESENT else not e & _PAGEMAP_SWAP for e in entries)


def discard_written(start: int, length: int) -> bool:
    """MADV_DONTNEED over the whole pages of [start, start + length) (a private file
    mapping's: what was written there is dropped and the file's values are read again);
    whether madvise took it."""
    madvise = _madvise()
    return madvise is not None and length > 0 and madvise(start, length, MADV_DONTNEED) == 0


def machine_memory() -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; (None, None) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
    except (OSError, ValueError, IndexError):
        return None, None
    return info.get("MemTotal"), info.get("MemAvailable")


__all__ = ["MADV_DONTNEED", "MADV_PAGEOUT", "Pager", "discard_written", "unwritten_file_range", "machine_memory", "mapped_files", "page_out"]
