"""Per-group (blockwise) int4 weights for the integer (PT2E) graphs.

One int4 scale per output channel is too coarse for an LLM's linears (SmolLM2-135M: 7 dB
with GPTQ, bench/results/12-integer-llm.yaml); ExecuTorch's 16a4w preset and LiteRT's
blockwise int4 give every ``group`` consecutive input columns of a row their own scale.
PT2E's QuantizationSpec has no per-group scheme, so the weights are rounded here, before
PT2E (by round to nearest or GPTQ, circleops.quantize.gptq), CircleQuantizer leaves those
linears' weights unobserved (weight scheme ``int4-grouped``), the converted module computes
with the rounded float weights, and the integer lowering writes them back as the integers
they are (:func:`blockwise_params`), found by their content (:func:`key`).

The grid, for a weight [rows, cols] and groups of G columns:

* row scale s_r = max|W_r| / (qmax · 255);
* group multiplier m[r, g] = clamp(round(max|W_r,g| / qmax / s_r), 1, 255), an integer;
* weight W[r, c] ≈ s_r · m[r, c // G] · q[r, c], q in [-qmax, qmax] (int4: [-7, 7]).

In the file (Circle, schema 0.10): the weight is an INT4 tensor whose QuantizationParameters
have details BlockwiseQuantization {scales: the index of a UINT8 tensor [rows, cols / G]
holding m, with per-row QuantizationParameters scale s_r, zero point 0; zero_points: -1;
block_size: G}. Dequantizing the scales tensor gives the group scales (what LiteRT carries
in FLOAT16); as integers they let an NPU compute the layer in fixed point: the int32/int64
sum of each group, weighted by m, summed over the groups, then one requantization per row
with s_in · s_r / s_out (the reference interpreter's FULLY_CONNECTED does exactly that).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

GROUPED = "int4-grouped"  # CircleQuantizer's weight scheme: rounded here, not observed by PT2E
MULT_MAX = 255  # the group multipliers are UINT8
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 32
# an LLM's default (the 16a4w NPU recipe): groups of 16 measured +1.5 dB on SmolLM2's hold-out window
# for a file 3 MiB larger (bench/results/41-npu-16a4w-ideas.yaml, 43-npu-16a4w-default.yaml)
LLM_GROUP = 16


def qmax_for(bits: int) -> int:
    """The largest integer of the symmetric grid (int8: 127, int4: 7)."""
    return 2 ** (bits - 1) - 1


def rtn(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round to nearest on the same grid: (integers [rows, cols], scale [rows])."""
    qmax = qmax_for(bits)
    scale = w.abs().amax(1).clamp_min(1e-12) / qmax
    return torch.clamp(torch.round(w / scale[:, None]), -qmax, qmax), scale


def eligible_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every nn.Linear of ``model`` by module name (each weight once)."""
    seen: set[int] = set()
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out[name] = m
    return out


def row_scales(w: torch.Tensor, bits: int) -> torch.Tensor:
    """s_r = max|W_r| / (qmax · 255): the largest group of a row gets m = 255."""
    qmax = 2 ** (bits - 1) - 1
    return (w.detach().to(torch.float32).abs().amax(1).clamp_min(1e-12) / (qmax * MULT_MAX))


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # group ranges tried, as fractions of max|W_r,g|
# GPTQ's clipping search (gptq.gptq_grouped clip_search): 1.0 down to 0.6 in steps of 0.025,
# finer than CLIPS (SmolLM2, act order: 74.9 % top-1 against 72.7 %, bench/results/36-npu-16a4w.yaml)
CLIP_GRID = tuple(round(1.0 - 0.025 * k, 3) for k in range(17))


def search_mult(groups: torch.Tensor, row_scale: torch.Tensor, bits: int, clips: tuple = CLIPS,
                importance: torch.Tensor | None = None) -> torch.Tensor:
    """m [rows, n] for weights [rows, n, G]: per group, the ``clips`` ratio of least rounding
    error; ``importance`` [n, G] (e.g. the GPTQ Hessian's diagonal, E[x²] of each input
    column) weights each column's squared error: the output error, not the weight's."""
    qmax = 2 ** (bits - 1) - 1
    amax = groups.abs().amax(2)  # [rows, n]
    if len(clips) == 1:  # nothing to choose between: no rounding error to measure (4 weight-sized temporaries)
        return torch.clamp(torch.round(clips[0] * amax / qmax / row_scale[:, None]), 1, MULT_MAX).to(torch.int64)
    weight = None if importance is None else importance.to(torch.float32)[None]
    best, best_err = None, None
    for c in clips:
        m = torch.clamp(torch.round(c * amax / qmax / row_scale[:, None]), 1, MULT_MAX)
        s = (row_scale[:, None] * m)[:, :, None]
        err = (groups - torch.clamp(torch.round(groups / s), -qmax, qmax) * s).pow(2)
        err = (err if weight is None else err * weight).sum(2)
        if best is None:
            best, best_err = m, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, m, best), torch.where(better, err, best_err)
    return best.to(torch.int64)


def rtn_grouped(w: torch.Tensor, bits: int, group: int, clips: tuple = (1.0,)
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest on the grid: (q [rows, cols] as float, s_r [rows], m [rows, groups]).
    ``clips``: the group ranges tried (search_mult); min-max by default: on SmolLM2 the
    clipping search (CLIPS) gave the file 3.5 dB / 15 of 32 tokens against 3.7 dB / 18."""
    w = w.detach().to(torch.float32)
    rows, cols = w.shape
    qmax = 2 ** (bits - 1) - 1
    s_r = row_scales(w, bits)
    g = w.reshape(rows, cols // group, group)
    m = search_mult(g, s_r, bits, clips)
    scale = s_r[:, None] * m
    q = torch.clamp(torch.round(g / scale[:, :, None]), -qmax, qmax).reshape(rows, cols)
    return q, s_r, m


def dequantize(q: torch.Tensor, row_scale: torch.Tensor, mult: torch.Tensor, group: int) -> torch.Tensor:
    """s_r · m[r, c // G] · q[r, c] in float32 (the weight the converted module computes with)."""
    scale = (row_scale[:, None].to(torch.float32) * mult.to(torch.float32))  # [rows, groups]
    return (q.to(torch.float32) * scale.repeat_interleave(group, dim=1))


def key(data: Any) -> tuple:
    """A float weight's identity by content (shape and bytes): the lowering meets copies and
    views of the parameter the rounding wrote, never the parameter object itself."""
    t = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data))
    a = np.ascontiguousarray(t.to(torch.float32).numpy())
    # the bytes hashed where they are (tobytes() was a copy of every weight rounded or looked up)
    return tuple(a.shape), hashlib.blake2b(a.reshape(-1).view(np.uint8), digest_size=16).hexdigest()


# weights read back at a time by GroupedWeight.integers (a few float32 temporaries of this size)
INTEGERS_BLOCK = 1 << 20


@dataclass
class GroupedWeight:
    """One linear's weight as rounded before PT2E: int4 in groups (integers, row scales,
    group multipliers), or, for a linear measured too sensitive for 4 bits (``group`` 0),
    int8 per output channel (integers, row scales).

    The integers are not kept from the rounding on: the float weight the model computes
    with is s_r·m·q rounded once to float32, and q is read back from it exactly where the
    lowering meets it (:meth:`integers`), then kept for the other graphs. Kept from the
    rounding they were 0.97 GB of int8 at the Llama-3.2-1B shape through export and
    calibration, the 16a4w convert's peak (issue 32)."""

    q: torch.Tensor | None  # int8 [rows, cols], in [-qmax, qmax]; None until the lowering reads them
    row_scale: torch.Tensor  # float32 [rows]
    mult: torch.Tensor | None  # uint8 [rows, groups]; None per channel
    group: int
    bits: int = 4

    def scales(self, rows: slice = slice(None)) -> torch.Tensor:
        """Each weight's float32 scale in ``rows``, [rows, cols] (s_r·m, as :func:`dequantize`
        and :func:`record` compute it; s_r per channel)."""
        if self.mult is None:
            return self.row_scale[rows, None]
        return (self.row_scale[rows, None] * self.mult[rows].to(torch.float32)).repeat_interleave(self.group, dim=1)

    def integers(self, data: Any) -> torch.Tensor:
        """q of the float weight ``data`` this rounding wrote (found by :func:`key`): w / scale
        rounded, by blocks of rows (their float temporaries small beside the lowering).
        Exact: w = fl(q · s) is within a relative 2^-24 of q · s, so w / s is within
        |q| · 2^-23 <= 127 · 2^-23 of the integer q. Computed once, then kept."""
        if self.q is None:
            w = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(np.asarray(data))
            qmax = qmax_for(self.bits)
            if w.dim() != 2 or w.shape[0] != self.row_scale.shape[0]:
                raise ValueError(f"internal: a grouped weight {tuple(w.shape)} is not s_r·m·q with |q| <= {qmax}")
            q = torch.empty(w.shape, dtype=torch.int8)
            step = max(1, INTEGERS_BLOCK // max(1, w.shape[1]))
            for i in range(0, w.shape[0], step):
                rows = slice(i, i + step)
                block = torch.round(w[rows].to(torch.float32) / self.scales(rows))
                if block.shape != q[rows].shape or bool((block.abs() > qmax).any()):
                    raise ValueError(f"internal: a grouped weight {tuple(w.shape)} is not s_r·m·q with |q| <= {qmax}")
                q[rows] = block.to(torch.int8)
            self.q = q
        return self.q


@dataclass
class GroupedReport:
    bits: int
    group: int
    rounding: str  # "round to nearest" / "GPTQ"
    names: list[str] = field(default_factory=list)
    weights: dict[tuple, GroupedWeight] = field(default_factory=dict)  # key(float weight) -> integers
    seconds: float = 0.0
    int8: list[str] = field(default_factory=list)  # linears kept int8 per channel by measurement
    int8_params: int = 0
    int4_params: int = 0
    sensitivity: str = ""  # how the int8 linears were chosen

    def summary_line(self) -> str:
        line = (f"{len(self.names)} linears int{self.bits} in groups of {self.group} columns ({self.rounding}; "
                f"per-group scales s_r·m, m uint8, as Circle BlockwiseQuantization), {self.seconds:.1f} s")
        if self.int8:
            share = self.int8_params / max(self.int8_params + self.int4_params, 1)
            line += (f"; {len(self.int8)} linears int8 per channel ({share:.0%} of the linear weights; "
                     f"{self.sensitivity})")
        return line


def record(report: GroupedReport, name: str, lin: torch.nn.Linear, q: torch.Tensor, row_scale: torch.Tensor,
           mult: torch.Tensor | None) -> torch.Tensor:
    """The float weight s_r·m·q (or s_r·q per channel, ``mult`` None) written into ``lin``
    (returned), its integers remembered."""
    if mult is None:
        w = (q.to(torch.float32) * row_scale.to(torch.float32)[:, None]).to(lin.weight.dtype)
        report.weights[key(w)] = GroupedWeight(None, row_scale.to(torch.float32).clone(), None, 0, 8)
        report.int8.append(name)
        report.int8_params += q.numel()
        return w
    w = dequantize(q, row_scale, mult, report.group).to(lin.weight.dtype)
    report.weights[key(w)] = GroupedWeight(None, row_scale.to(torch.float32).clone(),
                                           mult.to(torch.uint8), report.group, report.bits)
    report.names.append(name)
    report.int4_params += q.numel()
    return w


@contextlib.contextmanager
def rtn_applied(model: torch.nn.Module, bits: dict[str, int], group: int) -> Iterator[GroupedReport]:
    """Round the linears of ``model`` named in ``bits`` with 4 bits to the grouped grid (in
    place, restored on exit); the others are left to PT2E."""
    from circleops.system.snapshot import Snapshot, SpillFile

    report = GroupedReport(4, group, "round to nearest")
    saved: list[tuple[torch.Tensor, Snapshot]] = []  # the weights before: their files', or spilled (no clone)
    spill = SpillFile()
    t = time.perf_counter()
    try:
        _round_linears(model, bits, report, saved, spill)
        report.seconds = time.perf_counter() - t
        yield report
    finally:
        try:
            for param, snap in saved:
                snap.restore(param)
        finally:
            spill.close()


def _round_linears(model: torch.nn.Module, bits: dict[str, int], report: GroupedReport, saved: list, spill: Any) -> None:
    """rtn_applied's rounding, in a frame of its own: its last linear's float integers and
    weight (0.13 GB at the Llama-3.2-1B shape's MLP width) are not kept alive by the
    generator's locals while the rounding stays applied."""
    from circleops.system.memory import trim_heap
    from circleops.system.snapshot import Snapshot

    with torch.no_grad():
        for name, lin in eligible_linears(model).items():
            if bits.get(name) != 4 or lin.weight.shape[1] % report.group:
                continue
            q, s_r, m = rtn_grouped(lin.weight, 4, report.group)
            w = record(report, name, lin, q, s_r, m)
            saved.append((lin.weight, Snapshot(lin.weight, spill)))
            lin.weight.copy_(w)
            del q, w
            trim_heap()  # this linear's temporaries, between the scales kept (heap: 1-1.5 GB at the 1B shape)


def blockwise_params(name: str, gw: GroupedWeight, data: Any = None) -> tuple[np.ndarray, str, Any]:
    """(the integer values [rows, cols], their dtype, their ir.QuantParams): INT4 with the
    Blockwise scales tensor, or INT8 per channel for a linear kept at 8 bits. ``data``: the
    float weight the lowering found ``gw`` by, which the integers are read from
    (:meth:`GroupedWeight.integers`) unless an earlier graph read them."""
    from circleops import ir

    rows = gw.row_scale.shape[0]
    s_r = gw.row_scale.numpy().astype(np.float32)
    zeros = np.zeros(rows, np.int64)
    # the integers themselves, read-only (no copy per graph: the prefill and decode graphs of the
    # Llama-3.2-1B shape held 0.88 GB of int8 each beside the report's, issue 32; the writer stores them once)
    if gw.q is None and data is None:
        raise ValueError(f"internal: the grouped weight {name} has no integers yet and no float weight to read them from")
    q = _read_only(gw.integers(data) if gw.q is None else gw.q, np.int8)
    if gw.mult is None:
        return q, "INT8", ir.QuantParams(s_r, zeros, 0)
    scales = ir.Tensor(f"{name}_block_scales", tuple(gw.mult.shape), "UINT8", _read_only(gw.mult, np.uint8),
                       ir.QuantParams(s_r, zeros, 0))
    return q, "INT4", ir.QuantParams(s_r, zeros.copy(), 0, ir.Blockwise(gw.group, scales))


def _read_only(t: torch.Tensor, dtype: Any) -> np.ndarray:
    """``t``'s values as a read-only array of ``dtype``: a view when it has that dtype already."""
    a = np.asarray(t.numpy(), dtype=dtype).view()
    a.flags.writeable = False
    return a


# the int8 rule before issue 34 (each linear's RTN int4 rounding alone, the worst first), kept for
# bench/npu_weights.py's comparison: convert measures the gain after the rounding (int8_chosen_by_gain)
INT8_TARGET = 0.15  # keep int8 the linears carrying the most measured error until this share is left
INT8_BUDGET = 0.25  # of the linear weights at most (SmolLM2: the file stays under 0.3x fp32)


def linear_sensitivity(model: torch.nn.Module, samples: Sequence[Sequence[Any]], names: Sequence[str],
                       group: int) -> dict[str, float]:
    """For each linear named: the squared error its grouped int4 rounding (round to nearest)
    alone causes in the model's logits over ``samples``, relative to Σ logits²: the measured
    sensitivity that chooses the int8 linears. For a decoder (model.model.layers, .norm,
    lm_head) each measurement reruns only the layers from the linear's own on, from their
    inputs recorded once (the same logits at a fraction of the cost)."""
    from circleops.quantize.ggml import one_thread

    linears = eligible_linears(model)
    result = {}
    with one_thread(), torch.no_grad():
        replay = _Replay(model, samples)
        energy = sum(float(b.pow(2).sum()) for b in replay.base)
        for name in names:
            lin = linears[name]
            original = lin.weight.detach().clone()
            q, s_r, m = rtn_grouped(original, 4, group, CLIPS)  # the probe as measured (bench results)
            lin.weight.copy_(dequantize(q, s_r, m, group).to(original.dtype))
            try:
                result[name] = sum(float((got - b).pow(2).sum())
                                   for got, b in zip(replay.logits(name), replay.base)) / energy
            finally:
                lin.weight.copy_(original)
    return result


class _Replay:
    """The fp32 logits of ``samples``, and the logits again from the decoder layer holding a
    given module on (each layer's inputs recorded once); the whole model where the layout
    is not a decoder's."""

    def __init__(self, model: torch.nn.Module, samples: Sequence[Sequence[Any]]):
        self.model, self.samples = model, list(samples)
        inner = getattr(model, "model", None)
        self.layers = getattr(inner, "layers", None)
        self.norm, self.head = getattr(inner, "norm", None), getattr(model, "lm_head", None)
        self.inputs: list[list[tuple]] = []  # per sample, per layer: (args, kwargs)
        decoder = isinstance(self.layers, torch.nn.ModuleList) and self.norm is not None and self.head is not None
        hooks = []
        if decoder:
            def record(k):
                def hook(module, args, kwargs):
                    self.inputs[-1].append((args, dict(kwargs)))
                return hook
            hooks = [layer.register_forward_pre_hook(record(k), with_kwargs=True) for k, layer in enumerate(self.layers)]
        try:
            self.base = []
            for args in self.samples:
                self.inputs.append([])
                self.base.append(self._full(args))
        finally:
            for h in hooks:
                h.remove()
        self.where = {}
        if decoder and all(len(x) == len(self.layers) for x in self.inputs):
            for k, layer in enumerate(self.layers):
                for n, _ in layer.named_modules():
                    self.where[id(_)] = k
        self.names = dict(model.named_modules())

    def _full(self, args) -> torch.Tensor:
        return self._logits(self.model(*args))

    @staticmethod
    def _logits(out: Any) -> torch.Tensor:
        return (out.logits if hasattr(out, "logits") else out[0]).detach().to(torch.float64)

    def logits(self, name: str) -> list[torch.Tensor]:
        k = self.where.get(id(self.names[name]))
        if k is None:
            return [self._full(args) for args in self.samples]
        outs = []
        for per_layer in self.inputs:
            args, kwargs = per_layer[k]
            h = args[0]
            for j in range(k, len(self.layers)):
                a, kw = per_layer[j]
                out = self.layers[j](h, *a[1:], **kw)
                h = out[0] if isinstance(out, tuple) else out
            outs.append(self.head(self.norm(h)).detach().to(torch.float64))
        return outs


def choose_int8(noise: dict[str, float], sizes: dict[str, int], *, target: float = INT8_TARGET,
                budget: float = INT8_BUDGET) -> list[str]:
    """The linears to keep int8: the largest measured errors first, until the error left is
    ``target`` of the total or the int8 weights would pass ``budget`` of all of them."""
    total, total_size = sum(noise.values()), sum(sizes[n] for n in noise)
    chosen, left, size = [], total, 0
    for name in sorted(noise, key=noise.get, reverse=True):
        if left <= target * total or size + sizes[name] > budget * total_size:
            break
        chosen.append(name)
        left -= noise[name]
        size += sizes[name]
    return chosen


INT8_SHARE = 0.10  # measured int8 linears after GPTQ: at most this share of the 4-bit linears' weights


def logits_of(model: torch.nn.Module, samples: Sequence[Sequence[Any]]) -> list[torch.Tensor]:
    """The model's logits (float64) on each sample: the reference :func:`int8_gains` measures against."""
    with torch.no_grad():
        return [_Replay._logits(model(*args)) for args in samples]


def int8_rounding(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 per output channel, round to nearest: (integers as int8 [rows, cols], scale [rows])."""
    q, s = rtn(w.detach().to(torch.float32), 8)
    return q.to(torch.int8), s


def int8_gains(model: torch.nn.Module, samples: Sequence[Sequence[Any]], reference: Sequence[torch.Tensor],
               int8: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """For each linear of ``int8`` (name -> its int8 rounding, :func:`int8_rounding`): how much the squared error of the
    model's logits against ``reference`` (the fp32 logits of ``samples``) falls when that
    linear alone takes its int8 weight instead of its present (4-bit) one, relative to
    Σ reference². The model's other weights stay as they are, so what is measured is what
    keeping the linear at 8 bits buys in the rounded model (each rerun from its layer on)."""
    from circleops.quantize.ggml import one_thread

    linears = eligible_linears(model)
    gains = {}
    with one_thread(), torch.no_grad():
        replay = _Replay(model, samples)
        energy = sum(float(r.pow(2).sum()) for r in reference)
        base = sum(float((b - r).pow(2).sum()) for b, r in zip(replay.base, reference)) / energy
        for name, (q, scale) in int8.items():
            lin = linears[name]
            present = lin.weight.detach().clone()
            lin.weight.copy_((q.to(torch.float32) * scale[:, None]).to(present.dtype))
            try:
                err = sum(float((got - r).pow(2).sum()) for got, r in zip(replay.logits(name), reference)) / energy
            finally:
                lin.weight.copy_(present)
            gains[name] = base - err
    return gains


def choose_by_gain(gains: dict[str, float], sizes: dict[str, int], share: float = INT8_SHARE) -> list[str]:
    """The linears to keep int8: the largest measured gain per weight first, while their
    weights stay within ``share`` of all of ``sizes``' (a linear that does not fit is passed
    over for smaller ones); none whose gain is not positive."""
    total = sum(sizes.values())
    chosen, used = [], 0
    for name in sorted(gains, key=lambda n: gains[n] / sizes[n], reverse=True):
        if gains[name] <= 0:
            break
        if used + sizes[name] <= share * total:
            chosen.append(name)
            used += sizes[name]
    return chosen


@contextlib.contextmanager
def int8_chosen_by_gain(model: torch.nn.Module, report: GroupedReport, samples: Sequence[Sequence[Any]],
                        reference: Sequence[torch.Tensor], int8: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        share: float = INT8_SHARE) -> Iterator[list[str]]:
    """After the 4-bit rounding of ``report``: the linears (of ``int8``, name -> the int8
    rounding of its weight before the 4-bit one) whose int8 weights gain the logits most per
    weight (:func:`int8_gains`), within ``share`` of their weights, set to int8 (in place,
    restored on exit) and recorded as such in ``report``. (bench/npu_weights.py's
    alternative: convert chooses by :func:`linear_sensitivity`, which measured better.)"""
    gains = int8_gains(model, samples, reference, int8)
    chosen = choose_by_gain(gains, {n: q.numel() for n, (q, _) in int8.items()}, share)
    with int8_kept(model, report, {n: int8[n] for n in chosen}):
        yield chosen


@contextlib.contextmanager
def int8_kept(model: torch.nn.Module, report: GroupedReport,
              int8: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[list[str]]:
    """After the 4-bit rounding of ``report``: the linears of ``int8`` (name -> the int8
    rounding of its weight before the 4-bit one) set to those int8 weights (in place,
    restored on exit) and recorded as int8 in ``report``."""
    from circleops.system.snapshot import Snapshot, SpillFile

    linears = eligible_linears(model)
    saved = []  # the weights before: spilled, no clone (circleops.system.snapshot)
    spill = SpillFile()
    try:
        with torch.no_grad():
            for name, (q, s) in int8.items():
                lin = linears[name]
                report.weights.pop(key(lin.weight), None)
                report.names.remove(name)
                report.int4_params -= lin.weight.numel()
                saved.append((lin.weight, Snapshot(lin.weight, spill)))
                lin.weight.copy_(record(report, name, lin, q, s, None))
        yield list(int8)
    finally:
        try:
            for param, snap in saved:
                snap.restore(param)
        finally:
            spill.close()


_ACTIVE: contextvars.ContextVar[dict[tuple, GroupedWeight] | None] = contextvars.ContextVar(
    "circleops_grouped_weights", default=None)


@contextlib.contextmanager
def written_as_blockwise(weights: dict[tuple, GroupedWeight]) -> Iterator[None]:
    """While open, the integer lowering writes float weights found in ``weights`` (by
    :func:`key`) as blockwise INT4: the conversion that rounded them holds it open until its
    file is written (the rounding lives in the model's parameters until then too)."""
    merged = {**(_ACTIVE.get() or {}), **weights}
    token = _ACTIVE.set(merged)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def forget_integers() -> int:
    """Drop the integers the lowering read back (:meth:`GroupedWeight.integers`) of every
    rounding open (:func:`written_as_blockwise`): once the files are written nothing reads
    them, and verify's torch runs and runtime come after (0.97 GB of int8 at the
    Llama-3.2-1B shape, issue 32); a later lowering reads them back again. The bytes dropped."""
    dropped = 0
    for gw in (_ACTIVE.get() or {}).values():
        if gw.q is not None:
            dropped += gw.q.numel() * gw.q.element_size()
            gw.q = None
    return dropped


def lookup(data: Any) -> GroupedWeight | None:
    """The grouped integers of a float weight the lowering meets, if a rounding made it."""
    active = _ACTIVE.get()
    if not active or data is None or len(getattr(data, "shape", ())) != 2:
        return None
    return active.get(key(data))
