"""Bounds on work and memory that a test can assert without a clock (issue 25): timings
flake on a busy machine and a peak-RSS delta cannot fail once the worker has peaked higher,
so the hostile-file tests bound what they can count instead.

* :func:`address_space_limit`: the process may map at most ``extra`` more bytes while inside
  (RLIMIT_AS), so a big allocation fails at once (MemoryError or torch's RuntimeError)
  instead of passing unseen; restored on exit.
* :func:`reader_work`: the decoding work units the reader charged (circleops.serialize.decode.Budget).
"""
from __future__ import annotations

import contextlib
import resource
from typing import Iterator


def _mapped_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_limit(extra: int = 256 << 20) -> Iterator[None]:
    """Inside, the process can map at most ``extra`` bytes more than it has now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _mapped_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def reader_work(monkeypatch) -> Iterator[list[int]]:
    """A one-item list holding the work units the reader charged while inside."""
    from circleops.serialize import decode

    total = [0]
    charge = decode.Budget.charge

    def counted(self, units, what):
        total[0] += max(int(units), 0)
        return charge(self, units, what)

    monkeypatch.setattr(decode.Budget, "charge", counted)
    yield total
