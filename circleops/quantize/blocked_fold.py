"""convert_pt2e's folding of weight quantization, a block of rows at a time, and without
the dequantized copies it throws away.

torchao's ``convert_pt2e`` folds ``quantize_per_channel(w, ...)`` / ``quantize_per_tensor``
of every constant weight by running the op on the whole fp32 weight: ``w * (1/s)``, its
rounding, the zero point's sum and the clamp are each a temporary as large as ``w``. On the
Llama-3.2-1B shape's 128256 x 2048 embedding and lm_head (1.05 GB each) that was +3.6 GB
above what the process held, per graph, the peak of the 16a4w convert's calibrate stage
(issue 32). The op is elementwise (per channel along its axis), so computing it on slices
of rows and writing each into the integer output gives the same integers.

The graphs of a set (an LLM's prefill and decode) are converted one after the other from
the same model: each folds the same quantization of the same weights. Within
:func:`shared_folds` a large weight's integers are made once and a later graph's fold
returns that very tensor: at the Llama-3.2-1B shape the decode graph's int16 embedding and
int8 lm_head (0.79 GB) are no longer made beside the prefill graph's before
circleops.quantize.integer.shared swaps them for those (issue 32).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

# elements quantized at a time (a block's fp32 temporaries: 4 bytes each, a few at once)
FOLD_BLOCK = 1 << 22


def _ops() -> dict[Any, bool]:
    """The folded quantize ops -> whether they take per-channel scales."""
    qd = torch.ops.quantized_decomposed
    return {qd.quantize_per_channel.default: True, qd.quantize_per_tensor.default: False}


def blocked_quantize(target: Any, args: tuple, kwargs: dict, per_channel: bool) -> torch.Tensor | None:
    """``target(*args, **kwargs)`` computed by blocks of rows, or None when it is small or
    not a plain [rows, ...] constant (the caller then runs it whole)."""
    x = args[0] if args else None
    if kwargs or not isinstance(x, torch.Tensor) or x.dim() < 1 or x.numel() <= FOLD_BLOCK \
            or x.device.type != "cpu" or not x.is_floating_point():
        return None
    if per_channel:
        _, scales, zps, axis, qmin, qmax, dtype = args[:7]
        if not (isinstance(scales, torch.Tensor) and isinstance(zps, torch.Tensor)):
            return None
    else:
        dtype = args[5] if len(args) > 5 else None
        if any(isinstance(a, torch.Tensor) for a in args[1:]) or not isinstance(dtype, torch.dtype):
            return None  # per-tensor parameters as tensors: not what convert_pt2e folds here
    if not isinstance(dtype, torch.dtype):
        return None
    rows = max(1, FOLD_BLOCK // max(1, x[0].numel()))
    out = torch.empty(x.shape, dtype=dtype)
    for i in range(0, x.shape[0], rows):
        r = slice(i, i + rows)
        if per_channel and axis % x.dim() == 0:  # the scales follow the rows
            block = target(x[r], scales[r], zps[r], *args[3:])
        else:
            block = target(x[r], *args[1:])
        out[r] = block
    return out


# the folds of the graphs converted so far (shared_folds): key -> [(the op's arguments, its integers)]
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("circleops_shared_folds", default=None)


@contextlib.contextmanager
def shared_folds() -> Iterator[dict]:
    """Within the block, a large weight's folded integers are made once: a later fold of the
    same op on the same weight (the same memory, not written since: its version counter)
    with equal parameters returns the same integer tensor. The memo holds the weights it
    saw, so that no other tensor can take their memory's address while it is open."""
    memo: dict = {}
    token = _SHARED.set(memo)
    try:
        yield memo
    finally:
        _SHARED.reset(token)


def _same_args(a: tuple, b: tuple) -> bool:
    """Whether two argument tuples of a quantize op are equal (tensors by value)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _folded(target: Any, args: tuple, kwargs: dict, per_channel: bool) -> torch.Tensor | None:
    """:func:`blocked_quantize`, through the open :func:`shared_folds` memo when there is one."""
    memo = _SHARED.get()
    x = args[0] if args else None
    if memo is None or kwargs or not isinstance(x, torch.Tensor) or x.numel() <= FOLD_BLOCK:
        return blocked_quantize(target, args, kwargs, per_channel)
    key = (target, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype,
           x._version)
    for seen, held, out in memo.get(key, ()):
        if _same_args(seen, args[1:]):
            return out
    out = blocked_quantize(target, args, kwargs, per_channel)
    if out is not None:
        memo.setdefault(key, []).append((args[1:], x, out))
    return out


@contextlib.contextmanager
def blocked_folding() -> Iterator[None]:
    """Within the block, torchao's ConstantFolder (convert_pt2e's constant folding) computes
    a large weight's quantize op by blocks of rows (:func:`blocked_quantize`)."""
    from torchao.quantization.pt2e.constant_fold import ConstantFolder

    ops = _ops()
    qd = torch.ops.quantized_decomposed
    dequantize = {qd.dequantize_per_channel.default, qd.dequantize_per_tensor.default}
    original = ConstantFolder.call_function

    def call_function(self: Any, target: Any, args: tuple, kwargs: dict) -> Any:
        if target in dequantize and args and isinstance(args[0], torch.Tensor) and args[0].numel() > FOLD_BLOCK:
            # a dequantized weight is never kept (convert_pt2e replaces quantize nodes only):
            # computing it was a float copy of the table and its temporaries, thrown away
            return self.unknown_value
        if target in ops:
            out = _folded(target, tuple(args), dict(kwargs), ops[target])
            if out is not None:
                return out
        return original(self, target, args, kwargs)

    ConstantFolder.call_function = call_function
    try:
        yield
    finally:
        ConstantFolder.call_function = original
