"""A tensor's values kept to be restored later, without a second copy where the file holds them.

In-place passes over a model's weights (SmoothQuant's fold, the rotation, verify's swap of
dequantized values) restore them afterwards. A clone of each doubles the weights' memory
(the Llama-3.2-1B shape's w8 convert: 3.4 GB of clones beside 3.4 GB of written pages, issue
32). A weight loaded from safetensors lives in a private (copy-on-write) file mapping: while
none of its pages has been written, the file holds its values, so the snapshot keeps only
the elements on the pages it shares with its neighbours, and restoring drops the written
pages (MADV_DONTNEED: the mapping reads the file again) and copies those few elements back.
Anything else (a model built in memory, a weight already written) is cloned, or, given a
:class:`SpillFile`, written to that unlinked temporary file and read back on restore: GPTQ
keeps every linear it rounds, and after the rotation has written them none is its file's
(the Llama-3.2-1B shape's 16a4w convert: 5 GB of clones beside the 6 GB of rotated weights,
issue 32). The file's pages are the page cache's, not the process's resident set.

    snap = Snapshot(weight)
    weight.mul_(m)          # in place
    snap.restore(weight)    # bit for bit the values it had

A pass whose changed weights are read once more and then no longer (SmoothQuant's fold:
each folded linear is quantized, and the file holds its blocks) registers them with
:func:`restored_once_read`; :func:`restore_read` then gives each its values back as soon
as its last reader is done, so the changed pages of the whole model are never resident at
once (the 1B shape's w8 convert: 3.6 GB of folded linears beside their int8 blocks, issue 32).
"""
from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Any, Iterable, Iterator

from circleops.system import memory


class Snapshot:
    """The values of a contiguous CPU tensor now (see the module docstring)."""

    def __init__(self, tensor: Any, spill: "SpillFile | None" = None):
        self.clone = None
        self.spilled: tuple[SpillFile, int] | None = None  # (the file, the offset of the values in it)
        self.done = False  # restored once (restore_read): the owner's own restore skips it
        self.inner: tuple[int, int] | None = None  # [start, stop) element indices of the whole pages the file holds
        t = tensor.detach()
        size = t.element_size()
        start, length = t.data_ptr(), t.numel() * size
        page = mmap.PAGESIZE
        a, b = start + (-start) % page, (start + length) // page * page  # the whole pages inside
        # the whole pages inside must be the file's; the two it shares with its neighbours
        # (which a neighbour's own fold may have written) are kept as elements
        if t.is_contiguous() and t.device.type == "cpu" and a < b and start % size == 0 \
                and memory.unwritten_file_range(a, b - a):
            flat = t.reshape(-1)
            self.inner = ((a - start) // size, (b - start) // size)
            self.head = flat[:self.inner[0]].clone()
            self.tail = flat[self.inner[1]:].clone()
            self.pages = (a, b - a)
        elif spill is not None and t.is_contiguous() and t.device.type == "cpu":
            self.spilled = (spill, spill.write(t))
        else:
            self.clone = t.clone()

    @property
    def held_bytes(self) -> int:
        """The bytes of its values this snapshot holds in memory."""
        held = [self.clone] if self.clone is not None else [self.head, self.tail] if self.inner is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def from_file(self) -> bool:
        """Whether the file holds its values (no clone of the whole tensor)."""
        return self.inner is not None

    def restore(self, tensor: Any) -> None:
        """``tensor`` (the same one) holds the snapshot's values again."""
        import torch

        self.done = True
        with torch.no_grad():
            t = tensor.detach()
            if self.spilled is not None:
                self.spilled[0].read_into(t, self.spilled[1])
                return
            if self.inner is None:
                t.copy_(self.clone)
                return
            if not memory.discard_written(*self.pages):
                raise RuntimeError("internal: madvise(MADV_DONTNEED) refused a file mapping's pages")
            flat = t.reshape(-1)
            flat[:self.inner[0]].copy_(self.head)
            flat[self.inner[1]:].copy_(self.tail)


class SpillFile:
    """An unlinked temporary file that tensors' values are written to and read back from
    (:class:`Snapshot` with ``spill``): memory the kernel may take back (the page cache), not
    the process's. Closed (and gone) on :meth:`close` or leaving its ``with``."""

    CHUNK = 1 << 30  # bytes per read / write call (Linux moves at most ~2 GiB per call)

    def __init__(self, directory: str | None = None):
        import tempfile

        self.file = tempfile.TemporaryFile(dir=directory, buffering=0)
        self.size = 0

    def write(self, tensor: Any) -> int:
        """``tensor``'s bytes (contiguous, on the CPU) appended; their offset."""
        view = memoryview(tensor.detach().reshape(-1).view(_bytes_dtype()).numpy())
        offset = self.size
        self.file.seek(offset)
        done = 0
        while done < len(view):
            done += self.file.write(view[done:done + self.CHUNK])
        self.size += len(view)
        return offset

    def read_into(self, tensor: Any, offset: int) -> None:
        """``tensor`` (contiguous, the size written at ``offset``) holds those bytes again."""
        view = memoryview(tensor.detach().reshape(-1).view(_bytes_dtype()).numpy())
        self.file.seek(offset)
        done = 0
        while done < len(view):
            n = self.file.readinto(view[done:done + self.CHUNK])
            if not n:
                raise RuntimeError("internal: a spilled tensor's bytes ended early")
            done += n

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "SpillFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _bytes_dtype() -> Any:
    import torch

    return torch.uint8


# (data_ptr, numel) -> (tensor, its Snapshot): the changed weights restore_read may restore
_ONCE_READ: dict[tuple[int, int], tuple[Any, Snapshot]] = {}
_LOCK = threading.Lock()


def _key(tensor: Any) -> tuple[int, int]:
    return int(tensor.data_ptr()), int(tensor.numel())


@contextlib.contextmanager
def restored_once_read(pairs: Iterable[tuple[Any, Snapshot]]) -> Iterator[None]:
    """Inside, :func:`restore_read` of one of ``pairs``' tensors restores it from its snapshot
    at once (its owner restores the others on its way out: a restored snapshot is ``done``)."""
    keys = []
    with _LOCK:
        for tensor, snap in pairs:
            keys.append(_key(tensor))
            _ONCE_READ[keys[-1]] = (tensor, snap)
    try:
        yield
    finally:
        with _LOCK:
            for key in keys:
                _ONCE_READ.pop(key, None)


def restore_read(tensor: Any) -> bool:
    """``tensor`` (a registered weight, or any view of its whole memory) has been read for the
    last time in its changed form: its snapshot's values again now, its written pages given
    back. Whether it was registered (and not restored before)."""
    if not _ONCE_READ or not hasattr(tensor, "data_ptr"):
        return False
    with _LOCK:
        found = _ONCE_READ.pop(_key(tensor), None)
    if found is None:
        return False
    found[1].restore(found[0])
    return True


__all__ = ["Snapshot", "SpillFile", "restored_once_read", "restore_read"]
