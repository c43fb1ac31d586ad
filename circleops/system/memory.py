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
from typing import Callable

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
    ranges = mapped_files(keep)
    if not ranges:
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for start, end, _ in ranges:
        if libc.madvise(start, end - start, MADV_PAGEOUT) == 0:
            advised += end - start
    return advised


def machine_memory() -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo; (None, None) where there is none."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
    except (OSError, ValueError, IndexError):
        return None, None
    return info.get("MemTotal"), info.get("MemAvailable")


__all__ = ["MADV_PAGEOUT", "machine_memory", "mapped_files", "page_out"]
