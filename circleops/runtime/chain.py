"""One generation graph run as a chain of sessions, one per consecutive layer range.

A model past what one file of its target can hold (onert: 2 GiB, circleops.package.split) is
written as parts: the first takes the token ids and looks up the embeddings, each passes
its hidden state [1, S, hidden] to the next, the last computes the logits. Each part takes
only its own layers' caches and returns their new rows (or whole caches). A
:class:`ChainSession` presents the chain as the one graph it replaces: the inputs
``ids, pos, [logits_row,] *k_caches, *v_caches`` of every layer and the outputs
``logits, *k_rows, *v_rows``, so generation and verify run a split graph unchanged.

Where the first part takes the embeddings (the manifest's ``part_embedding`` "head": a tied
table stored once, as the last part's lm_head, or, onert's quantized heads, not at all),
:class:`HeadEmbedding` looks the token ids' rows up in that weight, read from the last part's
file where it lies (mapped, not copied): fp32 rows as they are, an INT8 head's rows times
the scales of the MUL after its product (w8), a GGML head's rows unpacked from their blocks
(Q8_0); the first part scales them where the model's embedding does (Gemma's sqrt(hidden)).
A one-file graph that takes the embeddings runs as a chain of one.
"""
from __future__ import annotations

from typing import Any, Sequence

from circleops.errors import ModelLoadError
from circleops.runtime import TensorSpec


# ops between the lm_head's product and the logits output that only reshape
_RESHAPES = ("RESHAPE", "SQUEEZE", "EXPAND_DIMS")
_PRODUCTS = ("FULLY_CONNECTED", "CONV_2D")
# the head's weight types whose rows the generator reads (FLOAT32 as stored; INT8 times the
# scales the MUL after the product applies; GGML blocks unpacked)
_HEAD_TYPES = ("FLOAT32", "INT8", "GGML_Q8_0", "GGML_Q4_0")


class HeadEmbedding:
    """The embeddings of token ids: rows of the tied lm_head weight [vocab, hidden] of a split
    graph's last part (or a one-file graph) ``path`` (the FULLY_CONNECTED that computes its
    ``logits`` output, in the subgraph of ``signature``, or the first), read from a view of
    the file's mapped bytes: only the rows asked for are touched (and dequantized)."""

    def __init__(self, path: str | Any, signature: str | None = None):
        import numpy as np

        from circleops.serialize import read_model

        model = read_model(str(path))
        index = next((s.subgraph_index for s in model.signatures if s.key == signature), 0) if signature else 0
        sub = model.subgraphs[index]
        made = {o: op for op in sub.operators for o in op.outputs}
        t, op = sub.outputs[0] if sub.outputs else -1, None
        while t in made and made[t].opcode in _RESHAPES:
            t = made[t].inputs[0]
        scale = None
        if t in made and made[t].opcode == "MUL":  # w8: the per-channel scales after the INT8 product
            mul = made[t]
            consts = [i for i in mul.inputs if i >= 0 and sub.tensors[i].data is not None]
            if len(consts) == 1:
                scale = sub.tensors[consts[0]]
                t = next(i for i in mul.inputs if i != consts[0])
        op = made.get(t)
        # FULLY_CONNECTED [vocab, hidden], or the 1x1 CONV_2D [vocab, 1, 1, hidden] onert's
        # profile writes a widening linear as (circleops.targets.Conv1x1Rule)
        w = sub.tensors[op.inputs[1]] if op is not None and op.opcode in _PRODUCTS else None
        ok = (w is not None and w.data is not None and w.dtype in _HEAD_TYPES and len(w.shape) in (2, 4)
              and tuple(w.shape[1:-1]) in ((), (1, 1)))
        vocab = int(w.shape[0]) if ok else 0
        if ok and w.dtype == "INT8":  # onert's hybrid form: scale [1.0] in the weight, the rows' in the MUL
            q = w.quant
            ok = (scale is not None and scale.dtype == "FLOAT32" and int(np.asarray(scale.data).size) == vocab
                  and q is not None and np.all(np.asarray(q.scale) == 1.0) and not np.any(np.asarray(q.zero_point)))
        elif ok:
            ok = scale is None
        if not ok:
            raise ModelLoadError(f"{path} should compute its logits with the tied lm_head, a [vocab, hidden] weight "
                                 f"(FLOAT32, INT8 with its scales after the product, or GGML_Q8_0) whose rows are the "
                                 f"first part's embeddings; it does not. The directory is damaged: convert again.")
        self.dtype = w.dtype
        self.shape = (vocab, int(w.shape[-1]))
        if w.dtype in ("FLOAT32", "INT8"):
            self.table = w.data.reshape(self.shape)  # a view of the mapped file
        else:
            from circleops.quantize.ggml import BlockTensor

            self.table = BlockTensor(w.data, w.dtype, self.shape)
        self.scale = np.asarray(scale.data, dtype=np.float32).reshape(-1) if scale is not None else None

    def __call__(self, ids: Any) -> Any:
        """[1, S] token ids -> their rows [1, S, hidden] float32, as the file's head computes with
        them (the same products as circleops.quantize's decoders: verify's torch reference
        looks its embeddings up in exactly these values)."""
        import numpy as np

        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise ModelLoadError(f"token ids must be in [0, {self.shape[0]}) (the head's rows); got "
                                 f"{int(ids.min())}..{int(ids.max())}.")
        if self.dtype == "FLOAT32":
            return self.table[ids]
        if self.dtype == "INT8":
            return self.table[ids].astype(np.float32) * self.scale[ids][..., None]
        import torch

        rows = self.table.rows(torch.from_numpy(ids.reshape(-1)))
        return rows.numpy().reshape(*ids.shape, self.shape[1])


class ChainSession:
    """``sessions[j]`` runs layers ``ranges[j]`` (start, stop); ``one_row``: the graph takes a
    ``logits_row`` input after ``pos`` (the prefill), which only the last part reads;
    ``embed``: the first part takes embeddings, ``embed(ids)`` (a :class:`HeadEmbedding`).

    ``lazy``: ``sessions`` are callables that open each part's session; a run opens part j,
    runs it and closes it before part j + 1 opens, so one part's weights are in memory at a
    time (a one-shot check's way: the 1B shape's fp32 verify held every part's onert child at
    once, bench/results/39). ``paths``: the parts' files then (for messages)."""

    def __init__(self, sessions: Sequence[Any], ranges: Sequence[Sequence[int]], *, one_row: bool = False,
                 embed: Any = None, lazy: bool = False, paths: Sequence[str] = ()):
        if not sessions or len(sessions) != len(ranges):
            raise ModelLoadError(f"a split graph needs one file per layer range; got {len(sessions)} files for "
                                 f"{len(ranges)} ranges. Convert again.")
        self.lazy = lazy
        self.sessions = list(sessions)
        self.ranges = [(int(a), int(b)) for a, b in ranges]
        self.one_row = one_row
        self.embed = embed
        self.num_layers = self.ranges[-1][1]
        self._specs: tuple[list[TensorSpec], list[TensorSpec]] | None = None
        if lazy:
            self.path = str(paths[0]) if paths else "a split graph"
            self.signature = None
            return
        self.path = self.sessions[0].path
        self.signature = getattr(self.sessions[0], "signature", None)
        for j, s in enumerate(self.sessions):
            self._check(j, s)

    def _check(self, j: int, s: Any) -> None:
        """ModelLoadError unless part ``j``'s session takes and gives what its layer range needs."""
        a, b = self.ranges[j]
        want = 2 + (1 if self.one_row and j == len(self.ranges) - 1 else 0) + 2 * (b - a)
        got = len(s.inputs)
        if got != want or len(s.outputs) != 1 + 2 * (b - a):
            raise ModelLoadError(f"{s.path} is part {j} of a split graph (layers {a}..{b - 1}) and should take "
                                 f"{want} inputs and give {1 + 2 * (b - a)} outputs; it takes {got} and gives "
                                 f"{len(s.outputs)}. The directory is damaged: convert again.")

    def _part(self, j: int) -> Any:
        """Part ``j``'s session: the open one, or (lazy) a new one, checked."""
        if not self.lazy:
            return self.sessions[j]
        s = self.sessions[j]()
        try:
            self._check(j, s)
        except ModelLoadError:
            _close(s)
            raise
        return s

    def _done(self, s: Any) -> None:
        if self.lazy:
            _close(s)

    def _part_specs(self) -> tuple[list[list[TensorSpec]], list[list[TensorSpec]]]:
        """Each part's input and output specs (lazy: each part opened and closed in turn)."""
        ins, outs = [], []
        for j in range(len(self.ranges)):
            s = self._part(j)
            ins.append(list(s.inputs))
            outs.append(list(s.outputs))
            self._done(s)
        return ins, outs

    @property
    def inputs(self) -> list[TensorSpec]:
        if not self.lazy:  # the sessions' own, now (a runtime may report shapes after a run)
            return self._io()[0]
        if self._specs is None:  # opening each part costs its load: once
            self._specs = self._io()
        return self._specs[0]

    @property
    def outputs(self) -> list[TensorSpec]:
        if not self.lazy:  # the sessions' own, now (a runtime may report shapes after a run)
            return self._io()[1]
        if self._specs is None:  # opening each part costs its load: once
            self._specs = self._io()
        return self._specs[1]

    def _io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The inputs and outputs of the one graph the parts replace."""
        part_ins, part_outs = self._part_specs()
        first, last = part_ins[0], part_ins[-1]
        ids = TensorSpec("input_ids", tuple(first[0].shape[:2]), "int64") if self.embed is not None else first[0]
        head = [ids, first[1]] + ([last[2]] if self.one_row else [])
        ks, vs, ko, vo = [], [], [], []
        for j, (a, b) in enumerate(self.ranges):
            skip = 3 if self.one_row and j == len(self.ranges) - 1 else 2
            specs = part_ins[j][skip:]
            ks += specs[:b - a]
            vs += specs[b - a:]
            ko += part_outs[j][1:1 + b - a]
            vo += part_outs[j][1 + b - a:]
        return head + ks + vs, [part_outs[-1][0], *ko, *vo]

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        """The inputs and outputs of the unsplit graph; the hidden state goes from part to part."""
        n = self.num_layers
        head = 3 if self.one_row else 2
        if len(inputs) != head + 2 * n:
            raise ModelLoadError(f"{self.path}: the split graph takes {head + 2 * n} inputs, got {len(inputs)}.")
        x, pos = (inputs[0] if self.embed is None else self.embed(inputs[0])), inputs[1]
        row = inputs[2] if self.one_row else None
        k_caches, v_caches = inputs[head:head + n], inputs[head + n:]
        k_out: list[Any] = []
        v_out: list[Any] = []
        last = len(self.ranges) - 1
        for j, (a, b) in enumerate(self.ranges):
            extra = [row] if row is not None and j == last else []
            s = self._part(j)
            try:
                outs = s.run([x, pos, *extra, *k_caches[a:b], *v_caches[a:b]])
            finally:
                self._done(s)
            x = outs[0]
            k_out += outs[1:1 + b - a]
            v_out += outs[1 + b - a:]
        return [x, *k_out, *v_out]


def _close(session: Any) -> None:
    """End ``session`` now (an isolated one's child exits), not when it is collected."""
    close = getattr(session, "close", None)
    if close is not None:
        close()
