"""One storage for the integer tables several converted PT2E graphs hold alike.

Each graph of a set (an LLM's prefill and decode) is prepared, calibrated and converted on
its own (circleops.package.step), and convert_pt2e folds the quantization of every weight it
quantizes into a new integer tensor per graph: the same integers, since a weight's
parameters come from the weight alone (per channel). At the Llama-3.2-1B shape that is the
int16 embedding (0.53 GB) and the int8 lm_head (0.26 GB) again in every graph (issue 32).
:class:`SharedIntegers` replaces a graph's tensor by an earlier graph's equal one (same
dtype, shape, layout and values), in the converted module and its ExportedProgram alike, so
the later graph's copy is freed as soon as it is made (the written file is the same: its
writer stores equal buffers once anyway).
"""
from __future__ import annotations

from typing import Any

import torch

# the name convert_pt2e gives the buffers of the integers it folds (never written in place,
# unlike a model's own buffers: only these are shared)
FOLDED = "_frozen_param"


class SharedIntegers:
    """The folded integer weights of the graphs converted so far, by (dtype, shape, stride)."""

    def __init__(self) -> None:
        self.seen: dict[tuple, list[torch.Tensor]] = {}
        self.shared_bytes = 0  # bytes of later graphs' copies replaced by an earlier graph's

    def _same(self, t: Any) -> torch.Tensor | None:
        """An earlier graph's tensor equal to ``t`` (``t`` is remembered when there is none)."""
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.device.type != "cpu":
            return None
        key = (t.dtype, tuple(t.shape), t.stride())
        found = self.seen.setdefault(key, [])
        for cand in found:
            if cand.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                return None  # already the shared one
            if torch.equal(cand, t):
                return cand
        found.append(t)
        return None

    def share(self, module: torch.nn.Module | None, ep: Any) -> int:
        """Replace ``module``'s and ``ep``'s folded integer weights (buffers named FOLDED*)
        that equal an earlier graph's by that tensor; the bytes this graph no longer holds."""
        by_ptr: dict[int, torch.Tensor] = {}

        def swap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            ptr = t.untyped_storage().data_ptr()
            if ptr not in by_ptr:
                cand = self._same(t)
                by_ptr[ptr] = cand if cand is not None else t
            new = by_ptr[ptr]
            if new is t or new.shape != t.shape or new.stride() != t.stride():
                return t
            return torch.nn.Parameter(new, requires_grad=False) if isinstance(t, torch.nn.Parameter) else new

        freed = 0
        if ep is not None:
            for table in (ep.constants, ep._state_dict):  # noqa: SLF001 - state_dict returns this very dict
                for k, v in list(table.items()):
                    new = swap(v) if k.rpartition(".")[2].startswith(FOLDED) else v
                    if new is not v:
                        table[k] = new
        if module is not None:
            for sub in module.modules():
                for k, v in list(sub._buffers.items()):  # noqa: SLF001 - replaced in place, as register_buffer would
                    new = swap(v) if k.startswith(FOLDED) else v
                    if new is not v:
                        sub._buffers[k] = new  # noqa: SLF001
        for ptr, new in by_ptr.items():
            if new.untyped_storage().data_ptr() != ptr:
                freed += new.untyped_storage().nbytes()
        self.shared_bytes += freed
        return freed
