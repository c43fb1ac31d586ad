"""GPTQ: error-compensating rounding of integer weights (Frantar et al., 2022).

Round-to-nearest quantizes every weight on its own. GPTQ quantizes a linear's weight W
[rows, cols] one input column at a time and moves each column's rounding error onto the
columns not yet quantized, weighted by the inverse Hessian of the layer's squared output
error, H = 2·XᵀX over calibration inputs X: the output X·Wᵀ, not W, stays close. The
standard algorithm: H damped by 1 % of its mean diagonal, the upper Cholesky factor of
H⁻¹, blocks of 128 columns with lazy updates of the rest.

The grid is the one the integer file uses (circleops.quantize.quantizer): symmetric per
output channel, scale = max|W_row| / qmax, values in [-qmax, qmax]. Each row's largest
weight is pinned to ±qmax (its rounding error compensated like any other), so that the
PT2E weight observer, which takes max|W_row| / qmax of the GPTQ weights, finds exactly the
same scale and re-rounds them to the same integers.

    with gptq_applied(model, samples, bits=4) as report:   # weights ← scale · q, restored on exit
        ...export, prepare_pt2e, calibrate, convert...
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Any, Iterator, Sequence

import torch

DAMP = 0.01
BLOCK = 128

# the grid's helpers live in circleops.quantize.grouped (which GPTQ's group rule uses too)
from circleops.quantize.grouped import eligible_linears, qmax_for, rtn  # noqa: E402,F401


def gptq(w: torch.Tensor, h: torch.Tensor, bits: int, *, block: int = BLOCK, damp: float = DAMP
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of ``w`` [rows, cols] with the Hessian ``h`` [cols, cols] (XᵀX, any positive
    multiple): (integers [rows, cols] as float, scale [rows]); scale · q approximates w."""
    q, scale, _ = _gptq(w, h, bits, 0, block, damp)
    return q, scale


def gptq_grouped(w: torch.Tensor, h: torch.Tensor, bits: int, group: int, *, damp: float = DAMP,
                 act_order: bool = False, clip_search: bool = False, refine: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ on the per-group grid of circleops.quantize.grouped: each group's scale s_r · m[r, g]
    (m an integer in [1, 255]) comes from its weights as the error compensation has left them
    when the algorithm reaches it, in column order (GPTQ's group rule). ``act_order``: the
    group scales are fixed first (static groups) and the columns go in the order of
    decreasing Hessian diagonal. ``clip_search``: each group's scale is the clipping ratio
    (grouped.CLIP_GRID) of least squared rounding error weighted by the Hessian's diagonal
    (the output error, not the weight's); without it, min-max. Measured on SmolLM2
    (bench/results/36-npu-16a4w.yaml): act order with the weighted search is the better pair.
    ``refine``: that many passes of :func:`refine_grouped` after (4-bit only).
    (integers [rows, cols] as float, row scale s_r [rows], m [rows, groups])."""
    block = max(BLOCK // group, 1) * group  # a group never straddles two blocks
    q, row_scale, mult = _gptq(w, h, bits, group, block, damp, act_order=act_order, clip_search=clip_search)
    if refine and bits == 4:
        q = refine_grouped(w, h, q, row_scale[:, None] * mult, group, passes=refine, damp=damp)
    return q, row_scale, mult


def compensate(w: torch.Tensor, h: torch.Tensor, level: Callable[..., tuple[torch.Tensor, torch.Tensor]], *,
               block: int = BLOCK, damp: float = DAMP, act_order: bool = False) -> torch.Tensor:
    """GPTQ's loop: the columns of ``w`` [rows, cols] rounded one at a time by
    ``level(column, j, w1, i) -> (levels, scale)`` (j: the column's index in ``w``; w1, i: the
    current block of columns as compensation has left it, and the column's place in it), each
    column's rounding error moved onto the columns not yet rounded through the inverse of the
    Hessian ``h`` [cols, cols]. ``act_order``: the columns in order of decreasing Hessian
    diagonal (valid when the scales are fixed before). The levels [rows, cols], in w's order."""
    w = w.detach().to(torch.float32).clone()
    h = h.detach().to(torch.float32).clone()
    cols = w.shape[1]
    dead = torch.diagonal(h) == 0  # inputs that were always 0: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(cols)
    if act_order:
        w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diagonal(h).mean() * torch.eye(cols)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            qc, scale = level(col, int(perm[i1 + i]), w1, i)
            q[:, i1 + i] = qc
            e = (col - qc * scale) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q[:, torch.argsort(perm)] if act_order else q


def _gptq(w: torch.Tensor, h: torch.Tensor, bits: int, group: int, block: int, damp: float, *,
          act_order: bool = False, clip_search: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    from circleops.quantize.grouped import CLIP_GRID, row_scales, search_mult  # noqa: F811

    w = w.detach().to(torch.float32)
    rows, cols = w.shape
    qmax = qmax_for(bits)
    mult = None
    static = None  # act order: every column's scale [rows, cols], fixed before
    row_scale = None
    clips = CLIP_GRID if clip_search else (1.0,)
    diag = torch.diagonal(h).detach().to(torch.float32)  # E[x²] of each input column, up to a factor
    if group:
        row_scale = row_scales(w, bits)
        if act_order:
            mult = search_mult(w.reshape(rows, cols // group, group), row_scale, bits, clips,
                               diag.reshape(cols // group, group))
            static = (row_scale[:, None] * mult).repeat_interleave(group, dim=1)
        else:
            mult = torch.zeros(rows, cols // group, dtype=torch.int64)
        scale = row_scale
    else:
        scale = w.abs().amax(1).clamp_min(1e-12) / qmax
    pinned = w.abs().argmax(1)  # each row's largest weight keeps ±qmax (see the module docstring)
    sign = torch.sign(w[torch.arange(rows), pinned])
    current = [scale]  # the group rule's scale, carried from a group's first column to its others

    def level(col: torch.Tensor, j: int, w1: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if static is not None:
            current[0] = static[:, j]
        elif group and j % group == 0:  # a new group: its scale from the weights as they are now
            m = search_mult(w1[:, None, i:i + group], row_scale, bits, clips, diag[None, j:j + group])[:, 0]
            mult[:, j // group] = m
            current[0] = row_scale * m
        qc = torch.clamp(torch.round(col / current[0]), -qmax, qmax)
        if not group:  # per channel: the PT2E observer must find the same scale (module docstring)
            qc = torch.where(pinned == j, sign * qmax, qc)
        return qc, current[0]

    q = compensate(w, h, level, block=block, damp=damp, act_order=static is not None)
    return q, (row_scale if group else scale), mult


def refine_grouped(w: torch.Tensor, h: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int, *,
                   passes: int = 2, damp: float = DAMP, block: int = BLOCK) -> torch.Tensor:
    """Coordinate descent after GPTQ on the per-group grid: GPTQ rounds each column once, in
    one order, so a later column's rounding can leave an earlier choice no longer the best.
    Each pass visits every column (by decreasing Hessian diagonal) and moves its integers (all
    rows at once) to the level that minimises the layer's output error (w - ŵ) H (w - ŵ)ᵀ given
    the other columns (H damped as GPTQ damps it); the error never rises. ``scales`` [rows,
    cols / group] (a row's scale times the group's multiplier) stay; the new integers [rows, cols].

    The gradient (w - ŵ)·H is kept blockwise, as GPTQ keeps its error: within a block of
    ``block`` columns each move updates only the block's columns, and the block's moves reach
    the other columns in one matrix product when it ends. The same arithmetic as updating
    every column after every move (the definition, which
    tests/quantize/test_grouped_int4.py holds it to), but one [rows, block] x [block, cols] product per block instead of ``block``
    rank-one updates of the whole [rows, cols] gradient (measured, one thread, a random
    [576, 1536] layer: 0.46 s against 1.45 s for two passes)."""
    from circleops.quantize.grouped import qmax_for

    w = w.detach().to(torch.float32)
    qmax = qmax_for(4)
    h = h.detach().to(torch.float32).clone()
    cols = w.shape[1]
    h += damp * torch.diagonal(h).mean().clamp_min(1e-12) * torch.eye(cols)
    # visit order by decreasing diagonal: permute once so that each block is contiguous; and
    # transposed, [cols, rows], so that a column's integers and gradient are contiguous rows
    perm = torch.argsort(torch.diagonal(h), descending=True)
    h = h[perm][:, perm]
    diag = torch.diagonal(h).clone()
    scale = scales.to(torch.float32).repeat_interleave(group, dim=1)
    scale = scale[:, perm].T.contiguous()
    q = q.detach().to(torch.float32)[:, perm].T.contiguous()
    g = h @ (w[:, perm].T - q * scale)  # the gradient's half, transposed: H · (residual)ᵀ (H symmetric)
    for _ in range(passes):
        for i1 in range(0, cols, block):
            i2 = min(i1 + block, cols)
            gb = g[i1:i2].clone()  # the block's gradient, kept exact move by move
            hb = h[i1:i2, i1:i2]
            moved = torch.zeros_like(gb)  # scale · step of each move in the block
            for i in range(i2 - i1):
                qi = q[i1 + i]
                step = torch.clamp(qi + torch.round(gb[i] / (scale[i1 + i] * diag[i1 + i])), -qmax, qmax) - qi
                if not bool(step.any()):
                    continue
                qi += step
                torch.mul(scale[i1 + i], step, out=moved[i])
                gb.addr_(hb[i], moved[i], alpha=-1)
            g.addmm_(h[:, i1:i2], moved, alpha=-1)  # the block's moves reach every column's gradient at once
    return q.T[:, torch.argsort(perm)].contiguous()


@dataclass
class GPTQReport:
    bits: int
    linears: int = 0
    tokens: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    skipped: str | None = None
    wider: list[str] = field(default_factory=list)  # linears rounded to more bits (an LLM's lm_head)
    grouped: Any = None  # circleops.quantize.grouped.GroupedReport: the linears on the per-group grid
    held_bytes: int = 0  # of the weights before, what is kept in memory to restore them (their files hold the rest)
    spilled_bytes: int = 0  # ... and in a temporary file (circleops.system.snapshot.SpillFile)

    def summary_line(self) -> str:
        if self.linears:
            groups = f", groups of {self.grouped.group} columns" if self.grouped is not None else ""
            return (f"GPTQ ({self.bits}-bit weights{groups}, damp {DAMP:g}, blocks of {BLOCK}, Hessians over {self.tokens} "
                    f"calibration tokens): {self.linears} linears, {self.seconds:.1f} s"
                    + (f"; {', '.join(self.wider)} at 8 bits" if self.wider else ""))
        return f"no GPTQ: {self.skipped}"


# GPTQ per output channel rounds each row on its own (its scale, its compensation): a large
# weight goes a block of this many elements' rows at a time (the same values: the Llama-3.2-1B
# shape's 128256 x 2048 lm_head whole held ~3.2 GB of copies beside the model, its 16a4w
# convert's peak, issue 32)
GPTQ_ROW_ELEMENTS = 1 << 24


def row_blocks(w: torch.Tensor) -> list[slice]:
    """Slices of ``w``'s rows of about GPTQ_ROW_ELEMENTS elements each."""
    rows = max(1, GPTQ_ROW_ELEMENTS // max(1, w.shape[1]))
    return [slice(i, min(i + rows, w.shape[0])) for i in range(0, w.shape[0], rows)]


class Hessians:
    """XᵀX per linear (name -> [cols, cols]), made when read: each linear's inputs are kept as
    they came, per sample (the linears reading one tensor, q/k/v or gate/up, keep that one
    tensor), while they are fewer rows than columns, and summed into XᵀX once they are not.
    A [cols, cols] matrix per linear held at once was the Llama-3.2-1B shape's 16 down_proj
    Hessians alone (8192² fp32 each) 4.3 GB, 5.9 GB in all, for 512 calibration tokens whose
    inputs are 0.47 GB (issue 32). ``pop`` / ``[]`` give each the same sum in the same order
    as accumulating it sample by sample (bit for bit); linears of the same inputs share it
    until the last of them is popped."""

    def __init__(self):
        self.xs: dict[str, list[torch.Tensor]] = {}  # linear -> its inputs' rows not summed yet, in order
        self.sums: dict[str, torch.Tensor | None] = {}  # linear -> XᵀX of the inputs before those
        self.shared: dict[tuple, torch.Tensor] = {}  # the inputs' ids -> their XᵀX, while a linear of them is left

    def add(self, name: str, x: torch.Tensor) -> None:
        xs = self.xs.setdefault(name, [])
        self.sums.setdefault(name, None)
        xs.append(x)
        if sum(t.shape[0] for t in xs) >= x.shape[1]:  # as many rows as XᵀX holds: summed now
            self.sums[name] = self._sum(self.sums[name], xs)
            xs.clear()

    @staticmethod
    def _sum(h: torch.Tensor | None, xs: list[torch.Tensor]) -> torch.Tensor:
        for x in xs:  # in sample order, as the sum was always made
            p = x.T @ x
            h = p if h is None else h + p
        return h

    def _key(self, name: str) -> tuple | None:
        return None if self.sums[name] is not None else tuple(id(x) for x in self.xs[name])

    def __contains__(self, name: object) -> bool:
        return name in self.sums

    def __len__(self) -> int:
        return len(self.sums)

    def __iter__(self):
        return iter(self.sums)

    def keys(self):
        return self.sums.keys()

    def __getitem__(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key is None:
            return self._sum(self.sums[name], self.xs[name])
        if key not in self.shared:
            self.shared[key] = self._sum(None, self.xs[name])
        return self.shared[key]

    def pop(self, name: str, *default: Any) -> torch.Tensor:
        if name not in self.sums and default:
            return default[0]
        h, key = self[name], self._key(name)
        del self.xs[name], self.sums[name]
        if key is not None and not any(self._key(n) == key for n in self.sums):
            self.shared.pop(key, None)  # its last reader
        return h

    def held_bytes(self) -> int:
        """What is held now (each input tensor once)."""
        tensors = {id(t): t for xs in self.xs.values() for t in xs}
        tensors.update({id(h): h for h in self.sums.values() if h is not None})
        tensors.update({id(h): h for h in self.shared.values()})
        return sum(t.numel() * t.element_size() for t in tensors.values())


def hessians(model: torch.nn.Module, linears: dict[str, torch.nn.Linear], samples: Sequence[Sequence[Any]],
             ) -> tuple[Hessians, int]:
    """XᵀX of every linear's input over ``samples`` (one forward each), linears reading the
    same tensor (q/k/v, gate/up) keeping it once (:class:`Hessians`: each sum made when
    read); and the token count."""
    by_input: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, kept alive: ids stay unique; x)
    result = Hessians()
    tokens = [0]
    hooks = []

    def hook_for(name: str):
        def hook(module, args):
            key = id(args[0])
            if key not in by_input:  # the first reader of this tensor in this forward
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
                if x.untyped_storage().nbytes() > x.numel() * x.element_size():
                    x = x.clone()  # kept past this forward: not the larger tensor it is a view of
                by_input[key] = (args[0], x)
                if name == first:
                    tokens[0] += x.shape[0]
            result.add(name, by_input[key][1])
        return hook

    first = next(iter(linears))
    for name, lin in linears.items():
        hooks.append(lin.register_forward_pre_hook(hook_for(name)))
    try:
        with torch.no_grad():
            for args in samples:
                by_input.clear()
                model(*args)
    finally:
        for h in hooks:
            h.remove()
    return result, tokens[0]


@contextlib.contextmanager
def gptq_applied(model: torch.nn.Module, samples: Sequence[Sequence[Any]], bits: dict[str, int] | int,
                 *, progress: bool = False, group: int = 0, act_order: bool = False,
                 clip_search: bool = False, refine: int = 0) -> Iterator[GPTQReport]:
    """Replace each linear's weight of ``model`` by its GPTQ rounding scale · q (in place,
    restored on exit). ``bits``: per module name (names missing are left alone) or one for
    all; ``group``: 4-bit linears get per-group scales (circleops.quantize.grouped), recorded
    in the report's ``grouped`` for the lowering; ``act_order`` / ``clip_search`` / ``refine``:
    as :func:`gptq_grouped` takes them, for those."""
    from circleops.quantize.grouped import GroupedReport
    linears = eligible_linears(model)
    if isinstance(bits, int):
        bits = {name: bits for name in linears}
    linears = {n: m for n, m in linears.items() if n in bits}
    report = GPTQReport(bits=min(bits.values()) if bits else 0)
    report.wider = sorted(n for n, b in bits.items() if b > report.bits)
    if group:
        how = ", ".join(w for w, on in (("act order", act_order), ("clipping search", clip_search),
                                        (f"{refine} passes of coordinate descent", refine)) if on)
        report.grouped = GroupedReport(4, group, f"GPTQ, {how}" if how else "GPTQ")
    from circleops.system.snapshot import Snapshot, SpillFile

    saved: list[tuple[torch.Tensor, Snapshot]] = []  # each linear's weight before: its file's, or spilled
    spill = SpillFile()
    try:
        if not linears:
            report.skipped = "no linear layer"
        else:
            t = time.perf_counter()
            from circleops.quantize.ggml import one_thread

            # many small ops: on busy cores a second torch thread makes them ~40x slower (measured:
            # SmolLM2's GPTQ had done 14 of 30 layers after 45 min at load 18 on two threads)
            with one_thread(), torch.no_grad():
                _round_all(model, linears, samples, bits, report, saved=saved, spill=spill,
                           how=dict(group=group, act_order=act_order, clip_search=clip_search, refine=refine,
                                    progress=progress))
            report.linears = len(report.names)
            report.seconds = time.perf_counter() - t
            report.held_bytes = sum(snap.held_bytes for _, snap in saved)
            report.spilled_bytes = spill.size
        yield report
    finally:
        try:
            for param, snap in saved:
                snap.restore(param)
        finally:
            spill.close()


def _round_all(model: torch.nn.Module, linears: dict[str, torch.nn.Linear], samples: Sequence[Sequence[Any]],
               bits: dict[str, int], report: GPTQReport, *, saved: list, spill: Any, how: dict[str, Any]) -> None:
    """gptq_applied's rounding (``how``: its keywords group, act_order, clip_search, refine,
    progress), in a frame of its own: its last linear's integers and Hessian are not kept
    alive by the generator's locals while the rounding stays applied."""
    from circleops.quantize.grouped import record
    from circleops.system.memory import trim_heap
    from circleops.system.snapshot import Snapshot

    group = how["group"]
    hs, report.tokens = hessians(model, linears, samples)
    items = [(n, m) for n, m in linears.items() if n in hs]
    if how["progress"]:
        from tqdm import tqdm

        items = tqdm(items, desc="GPTQ", unit="linear", leave=False)
    for name, lin in items:
        saved.append((lin.weight, Snapshot(lin.weight, spill)))
        if group and bits[name] == 4 and lin.weight.shape[1] % group == 0:
            q, row_scale, mult = gptq_grouped(lin.weight, hs.pop(name), 4, group,
                                              act_order=how["act_order"],
                                              clip_search=how["clip_search"],
                                              refine=how["refine"])
            lin.weight.copy_(record(report.grouped, name, lin, q, row_scale, mult))
        else:
            h = hs.pop(name)
            for rows in row_blocks(lin.weight):  # per channel: each row on its own
                block = lin.weight[rows]
                q, scale = gptq(block, h, bits[name])
                block.copy_((q * scale[:, None]).to(lin.weight.dtype))
        report.names.append(name)
        trim_heap()  # this linear's temporaries, between the scales kept
