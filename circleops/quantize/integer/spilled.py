"""The lowering's float values of a large integer table, kept in an unlinked temporary file.

The integer lowering lowers a converted PT2E program as the float graph it computes: each
``dequantize(w_int)`` of a constant becomes the float constant scale · (w_int - zp)
(circleops.quantize.integer.markers), and the integer pass then writes ``w_int`` itself
back in its place (circleops.quantize.integer.qdq.QuantPlan.integers), so the float values
of a table are read only where a pass derives another constant from them (a transposed or
reshaped view). Made in memory, the Llama-3.2-1B shape's int16 embedding and int8 lm_head
were 2.1 GB of float32 per graph's lowering above everything else the conversion held
(issue 32). Here they are written, a block of rows at a time, to an unlinked temporary file
that is then mapped copy-on-write: the same values for whoever reads them (a page is read
from the file when touched), resident only where read, and otherwise the page cache's
(memory the kernel may write back and take), gone with the last reference to the tensor.
"""
from __future__ import annotations

import mmap
import tempfile
from typing import Any

import numpy as np
import torch

# a table of at least this many float32 bytes is spilled (smaller ones stay in memory: a
# file and a mapping per small constant would cost more than they hold)
SPILL_BYTES = 64 << 20


def dequantized_table(q: torch.Tensor, spec: Any) -> torch.Tensor:
    """``spec.dequantize(q)`` (circleops.quantize.integer.qdq.QSpec), contiguous float32: in
    memory for a small table, else backed by an unlinked temporary file (see the module)."""
    if q.numel() * 4 < SPILL_BYTES or q.dim() == 0:
        return spec.dequantize(q).contiguous()
    with tempfile.TemporaryFile() as f:
        for rows, block in spec.dequantize_blocks(q):
            view = memoryview(np.ascontiguousarray(block.numpy())).cast("B")
            done = 0
            while done < len(view):  # Linux writes at most ~2 GiB per call
                done += f.write(view[done:done + (1 << 30)])
        f.flush()
        mapped = mmap.mmap(f.fileno(), q.numel() * 4, access=mmap.ACCESS_COPY)
    # the mapping outlives the file's descriptor; the array keeps it, the tensor the array
    return torch.from_numpy(np.frombuffer(mapped, dtype=np.float32).reshape(tuple(q.shape)))
