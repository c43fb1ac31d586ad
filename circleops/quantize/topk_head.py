"""The two-stage output head of the int4 LiteRT formats (``WeightFormat.head_topk``), torch side:
what the file computes, and how verify compares a file's logits with it.

A decode step reads every weight once, and the tied head (49152 x 576 for SmolLM2) is the
largest single weight: 28.3 MB at INT8 per channel. The two-stage head reads a 4-bit copy of it
(blocks of 32, importance-weighted as the int4 linears: 15.9 MB) for every logit, then scores
the k best of those again with the INT8 rows the file holds anyway for the embedding lookup:

    approx = FC_int4(h)                          # every logit, h rounded to int8 per row (qd8)
    values, idx = TOPK_V2(approx, k)
    exact = EMBEDDING_LOOKUP(idx, table_int8) . h   # float product of the dequantized rows
    logits = approx + SCATTER_ND(idx, exact - values)

So the greedy token and the probability mass that matters are the int8 head's, the tail the
4-bit head's, and every reader of ``logits`` stays as it is (circleops.quantize.topk_head_tflite
writes it). The exact values are the int8 rows times the float ``h`` (no input rounding: the
product runs in float on rows the lookup dequantized).

verify: the file picks its k from its own approximate logits, which differ from torch's by the
approximate head's error. A candidate whose approximate logit lies that close to the k-th
largest can be in one set and not in the other, and there the two logits differ by the whole
int4-against-int8 error of that one logit. :func:`head_error` therefore compares each logit
with torch's two-stage value where the set membership is decided, and with the nearer of
torch's approximate and exact values inside that band (the band's width measured on the same
output: the approximate error where both agree it is approximate).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import numpy as np
import torch

# QuantReport.sources role of the head's 4-bit copy (verify runs the two-stage head on it)
HEAD_ROLE = "head4"

# a two-stage head only where the vocabulary far exceeds k (below, the rescoring's gather and
# scatter cost more than the 4-bit copy saves, and a tiny model's head is no large weight)
MIN_VOCAB_PER_K = 8

# torch's approximate and exact logits of the last two-stage head run inside recording()
_RECORD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("circleops_topk_head", default=None)


def applies(vocab: int, k: int) -> bool:
    """Whether a head of ``vocab`` outputs is written two-stage with ``k`` candidates."""
    return k > 0 and vocab >= MIN_VOCAB_PER_K * k


# rows of the 4-bit head decoded at a time for torch's reference (a 1B model's head in float32
# would be another 1.05 GB beside the verify's weights, issue 32)
_DECODE_ROWS = 8192


def two_stage(h: torch.Tensor, approx_weight: torch.Tensor | Any, exact_weight: torch.Tensor, k: int,
              rounding: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, approx, exact) of the two-stage head on ``h`` [..., H]: ``approx`` the product
    with ``approx_weight`` [V, H] (the 4-bit head's values, or its circleops.quantize.int4
    blocks, decoded a slice of rows at a time) of ``rounding(h)`` (the runtime's int8 rounding of
    a quantized linear's input; None: h), ``exact`` the product of the float ``h`` with
    ``exact_weight`` [V, H] (the INT8 table's values) at every logit, ``logits`` approx with its
    ``k`` largest replaced by their exact values as the file adds them (approx + (exact -
    approx), in float32)."""
    shape = h.shape
    x = h.reshape(-1, shape[-1]).to(torch.float32)
    xr = rounding(x).to(torch.float32) if rounding is not None else x
    if isinstance(approx_weight, torch.Tensor):
        approx = xr @ approx_weight.to(torch.float32).T
    else:
        from circleops.quantize import int4

        p, v = approx_weight, approx_weight.q.shape[0]
        approx = torch.cat([xr @ int4.dequantize(p._replace(q=p.q[a:a + _DECODE_ROWS],
                                                            scales=p.scales[a:a + _DECODE_ROWS])).T
                            for a in range(0, v, _DECODE_ROWS)], dim=-1)
    exact = x @ exact_weight.to(torch.float32).T
    values, idx = approx.topk(k, dim=-1)
    logits = approx.scatter_add(-1, idx, exact.gather(-1, idx) - values)
    out = (*shape[:-1], approx.shape[-1])
    return logits.reshape(out), approx.reshape(out), exact.reshape(out)


@contextlib.contextmanager
def recording() -> Iterator[dict]:
    """Inside: each two-stage head that torch runs (:func:`install`) leaves its approximate and
    exact logits in the yielded dict ("approx", "exact": numpy [..., V]; "k")."""
    record: dict = {}
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def recorded() -> dict | None:
    """The current :func:`recording`'s dict (None outside one)."""
    return _RECORD.get()


@contextlib.contextmanager
def install(head: torch.nn.Module, approx_weight: torch.Tensor | Any, k: int,
            rounding: Callable[[torch.Tensor], torch.Tensor] | None) -> Iterator[None]:
    """While inside, ``head`` (an ``nn.Linear`` whose weight, as it runs, holds the INT8 table's
    values: circleops.quantize.weights.dequantized_sources) returns the two-stage logits, with
    ``approx_weight`` the 4-bit copy's values or blocks (:func:`two_stage`), its input rounded by ``rounding`` for the 4-bit
    product only."""
    def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits, approx, exact = two_stage(args[0], approx_weight, mod.weight, k, rounding)
        record = _RECORD.get()
        if record is not None:
            record.update(approx=approx.numpy(), exact=exact.numpy(), k=k)
        return logits.to(out.dtype)

    # first among the forward hooks: the weight swap's own hook puts the float weight back after
    handle = head.register_forward_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()


def head_error(out: np.ndarray, approx: np.ndarray, exact: np.ndarray, k: int) -> float:
    """The largest error of a file's two-stage logits ``out`` [V] against torch's ``approx`` and
    ``exact`` [V] (:func:`two_stage`). Outside the boundary band, each logit against torch's
    two-stage value; inside it, against the nearer of the two. The band: the logits whose
    approximate value lies within 2 e of the midpoint between torch's k-th and (k+1)-th largest,
    e the largest |out - approx| over the logits neither torch's set nor the file's (those
    nearer their exact value) holds: the file's approximate values differ from torch's by at
    most e, so its k-th largest moves by at most e, and a logit outside the band is in both
    sets or in neither."""
    out, approx, exact = (np.asarray(a, np.float64).reshape(-1) for a in (out, approx, exact))
    order = np.argpartition(-approx, k)
    chosen = np.zeros(approx.shape, bool)
    chosen[order[:k]] = True
    ref = np.where(chosen, exact, approx)
    to_approx, to_exact = np.abs(out - approx), np.abs(out - exact)
    decided = ~chosen & ~(to_exact < to_approx)
    e = float(to_approx[decided].max()) if decided.any() else 0.0
    kth, next_ = float(approx[order[:k]].min()), float(approx[order[k:]].max())
    band = np.abs(approx - (kth + next_) / 2) <= 2 * e + (kth - next_) / 2
    err = np.abs(out - ref)
    err[band] = np.minimum(to_approx, to_exact)[band]
    return float(err.max())


def rows_error(out: np.ndarray, want: np.ndarray, record: dict | None, row: Any) -> float:
    """Verify's error of one output row ``out`` (a logits row) against torch's ``want``: with the
    two-stage head's record (:func:`recording`; ``row`` indexes its rows as ``want`` was taken
    from torch's logits), :func:`head_error`; else the plain largest difference."""
    if record is None or "approx" not in record:
        return float(np.abs(np.asarray(out) - want).max())
    approx, exact = record["approx"].reshape(-1, record["approx"].shape[-1]), record["exact"]
    exact = exact.reshape(-1, exact.shape[-1])
    return head_error(out, approx[row], exact[row], int(record["k"]))
