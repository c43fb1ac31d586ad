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
from typing import Any, Iterator

import numpy as np
import torch

GROUPED = "int4-grouped"  # CircleQuantizer's weight scheme: rounded here, not observed by PT2E
MULT_MAX = 255  # the group multipliers are UINT8
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 32


def row_scales(w: torch.Tensor, bits: int) -> torch.Tensor:
    """s_r = max|W_r| / (qmax · 255): the largest group of a row gets m = 255."""
    qmax = 2 ** (bits - 1) - 1
    return (w.detach().to(torch.float32).abs().amax(1).clamp_min(1e-12) / (qmax * MULT_MAX))


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)  # group ranges tried, as fractions of max|W_r,g|


def group_scale(cols: torch.Tensor, row_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """m [rows] of one group of columns [rows, G]: the multiplier round(c · max|W_r,g| / qmax /
    s_r) in [1, 255] whose rounding of the group has the least squared error, over the
    clipping ratios c of CLIPS (clipping the largest weight a little buys the others a finer step)."""
    return search_mult(cols[:, None, :], row_scale, bits)[:, 0]


def search_mult(groups: torch.Tensor, row_scale: torch.Tensor, bits: int) -> torch.Tensor:
    """m [rows, n] for weights [rows, n, G]: per group, the CLIPS ratio of least rounding error."""
    qmax = 2 ** (bits - 1) - 1
    amax = groups.abs().amax(2)  # [rows, n]
    best, best_err = None, None
    for c in CLIPS:
        m = torch.clamp(torch.round(c * amax / qmax / row_scale[:, None]), 1, MULT_MAX)
        s = (row_scale[:, None] * m)[:, :, None]
        err = (groups - torch.clamp(torch.round(groups / s), -qmax, qmax) * s).pow(2).sum(2)
        if best is None:
            best, best_err = m, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, m, best), torch.where(better, err, best_err)
    return best.to(torch.int64)


def rtn_grouped(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest on the grid: (q [rows, cols] as float, s_r [rows], m [rows, groups])."""
    w = w.detach().to(torch.float32)
    rows, cols = w.shape
    qmax = 2 ** (bits - 1) - 1
    s_r = row_scales(w, bits)
    g = w.reshape(rows, cols // group, group)
    m = search_mult(g, s_r, bits)
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
    return tuple(a.shape), hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()


@dataclass
class GroupedWeight:
    """One linear's grouped int4 weight: integers, row scales, group multipliers."""

    q: torch.Tensor  # int8 [rows, cols], in [-qmax, qmax]
    row_scale: torch.Tensor  # float32 [rows]
    mult: torch.Tensor  # uint8 [rows, groups]
    group: int
    bits: int = 4


@dataclass
class GroupedReport:
    bits: int
    group: int
    rounding: str  # "round to nearest" / "GPTQ"
    names: list[str] = field(default_factory=list)
    weights: dict[tuple, GroupedWeight] = field(default_factory=dict)  # key(float weight) -> integers
    seconds: float = 0.0

    def summary_line(self) -> str:
        return (f"{len(self.names)} linears int{self.bits} in groups of {self.group} columns ({self.rounding}; "
                f"per-group scales s_r·m, m uint8, as Circle BlockwiseQuantization), {self.seconds:.1f} s")


def record(report: GroupedReport, name: str, lin: torch.nn.Linear, q: torch.Tensor, row_scale: torch.Tensor,
           mult: torch.Tensor) -> torch.Tensor:
    """The float weight s_r·m·q written into ``lin`` (returned), its integers remembered."""
    w = dequantize(q, row_scale, mult, report.group).to(lin.weight.dtype)
    report.weights[key(w)] = GroupedWeight(q.to(torch.int8), row_scale.to(torch.float32).clone(),
                                           mult.to(torch.uint8), report.group, report.bits)
    report.names.append(name)
    return w


@contextlib.contextmanager
def rtn_applied(model: torch.nn.Module, bits: dict[str, int], group: int) -> Iterator[GroupedReport]:
    """Round the linears of ``model`` named in ``bits`` with 4 bits to the grouped grid (in
    place, restored on exit); the others are left to PT2E."""
    from circleops.quantize.gptq import eligible_linears

    report = GroupedReport(4, group, "round to nearest")
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    t = time.perf_counter()
    try:
        with torch.no_grad():
            for name, lin in eligible_linears(model).items():
                if bits.get(name) != 4 or lin.weight.shape[1] % group:
                    continue
                q, s_r, m = rtn_grouped(lin.weight, 4, group)
                w = record(report, name, lin, q, s_r, m)
                saved.append((lin.weight, lin.weight.detach().clone()))
                lin.weight.copy_(w)
        report.seconds = time.perf_counter() - t
        yield report
    finally:
        with torch.no_grad():
            for param, original in saved:
                param.copy_(original)


def blockwise_params(name: str, gw: GroupedWeight) -> tuple[np.ndarray, Any]:
    """(the INT4 values [rows, cols], their ir.QuantParams with the Blockwise scales tensor)."""
    from circleops import ir

    rows = gw.q.shape[0]
    s_r = gw.row_scale.numpy().astype(np.float32)
    zeros = np.zeros(rows, np.int64)
    scales = ir.Tensor(f"{name}_block_scales", tuple(gw.mult.shape), "UINT8", gw.mult.numpy().astype(np.uint8),
                       ir.QuantParams(s_r, zeros, 0))
    return gw.q.numpy().astype(np.int8), ir.QuantParams(s_r, zeros.copy(), 0, ir.Blockwise(gw.group, scales))


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


def lookup(data: Any) -> GroupedWeight | None:
    """The grouped integers of a float weight the lowering meets, if a rounding made it."""
    active = _ACTIVE.get()
    if not active or data is None or len(getattr(data, "shape", ())) != 2:
        return None
    return active.get(key(data))
