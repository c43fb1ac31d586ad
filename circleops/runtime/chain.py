"""One generation graph run as a chain of sessions, one per consecutive layer range.

A model past what one file of its target can hold (onert: 2 GiB, circleops.package.split) is
written as parts: the first takes the token ids and looks up the embeddings, each passes
its hidden state [1, S, hidden] to the next, the last computes the logits. Each part takes
only its own layers' caches and returns their new rows (or whole caches). A
:class:`ChainSession` presents the chain as the one graph it replaces: the inputs
``ids, pos, [logits_row,] *k_caches, *v_caches`` of every layer and the outputs
``logits, *k_rows, *v_rows``, so generation and verify run a split graph unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

from circleops.errors import ModelLoadError
from circleops.runtime import TensorSpec


class ChainSession:
    """``sessions[j]`` runs layers ``ranges[j]`` (start, stop); ``one_row``: the graph takes a
    ``logits_row`` input after ``pos`` (the prefill), which only the last part reads."""

    def __init__(self, sessions: Sequence[Any], ranges: Sequence[Sequence[int]], *, one_row: bool = False):
        if not sessions or len(sessions) != len(ranges):
            raise ModelLoadError(f"a split graph needs one file per layer range; got {len(sessions)} files for "
                                 f"{len(ranges)} ranges. Convert again.")
        self.sessions = list(sessions)
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        self.one_row = one_row
        self.num_layers = self.ranges[-1][1]
        self.path = self.sessions[0].path
        self.signature = getattr(self.sessions[0], "signature", None)
        for j, (s, (a, b)) in enumerate(zip(self.sessions, self.ranges)):
            want = 2 + (1 if one_row and j == len(self.sessions) - 1 else 0) + 2 * (b - a)
            got = len(s.inputs)
            if got != want or len(s.outputs) != 1 + 2 * (b - a):
                raise ModelLoadError(f"{s.path} is part {j} of a split graph (layers {a}..{b - 1}) and should take "
                                     f"{want} inputs and give {1 + 2 * (b - a)} outputs; it takes {got} and gives "
                                     f"{len(s.outputs)}. The directory is damaged: convert again.")

    @property
    def inputs(self) -> list[TensorSpec]:
        first, last = self.sessions[0].inputs, self.sessions[-1].inputs
        head = list(first[:2]) + ([last[2]] if self.one_row else [])
        ks, vs = [], []
        for j, (s, (a, b)) in enumerate(zip(self.sessions, self.ranges)):
            skip = 3 if self.one_row and j == len(self.sessions) - 1 else 2
            specs = s.inputs[skip:]
            ks += specs[:b - a]
            vs += specs[b - a:]
        return head + ks + vs

    @property
    def outputs(self) -> list[TensorSpec]:
        ks, vs = [], []
        for s, (a, b) in zip(self.sessions, self.ranges):
            specs = s.outputs[1:]
            ks += specs[:b - a]
            vs += specs[b - a:]
        return [self.sessions[-1].outputs[0], *ks, *vs]

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        """The inputs and outputs of the unsplit graph; the hidden state goes from part to part."""
        n = self.num_layers
        head = 3 if self.one_row else 2
        if len(inputs) != head + 2 * n:
            raise ModelLoadError(f"{self.path}: the split graph takes {head + 2 * n} inputs, got {len(inputs)}.")
        x, pos = inputs[0], inputs[1]
        row = inputs[2] if self.one_row else None
        k_caches, v_caches = inputs[head:head + n], inputs[head + n:]
        k_out: list[Any] = []
        v_out: list[Any] = []
        last = len(self.sessions) - 1
        for j, (s, (a, b)) in enumerate(zip(self.sessions, self.ranges)):
            extra = [row] if row is not None and j == last else []
            outs = s.run([x, pos, *extra, *k_caches[a:b], *v_caches[a:b]])
            x = outs[0]
            k_out += outs[1:1 + b - a]
            v_out += outs[1 + b - a:]
        return [x, *k_out, *v_out]
