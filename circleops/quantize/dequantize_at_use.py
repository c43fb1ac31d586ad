"""torch's runs of PT2E's converted modules with each integer weight dequantized where it is
used, and a table only as far as it is read.

convert_pt2e leaves the dequantize of every constant weight (``dequantize_per_channel`` of a
linear's int8 weight, ``dequantize_per_tensor`` of an int16 embedding table) beside the
weight's get_attr, at the top of the graph: a forward computes every float weight first and
holds each until its user runs. For the Llama-3.2-1B shape's 16a4w graphs that is the int16
embedding and the int8 lm_head dequantized together, 2 x 1.05 GB of float32 through the whole
forward (verify's torch references and quality, the 16a4w convert's peak with --verify:
bench/results/69-npu-1b-prepare-memory.yaml); for uint8's, every linear's as well (issue 32).
Within :func:`dequantized_at_use`:

* a dequantized table read only by ``aten.embedding`` is dequantized at the gathered rows
  alone (parameters per tensor or per row: each row's float values depend on that row only,
  so they are the very floats the whole table gives);
* a dequantized weight read only by ``aten.linear`` is dequantized and multiplied a block of
  rows (output channels) at a time (:data:`LINEAR_BLOCK_ROWS`), never whole: the same
  products, which BLAS may sum in another order for another shape (measured the same floats
  for the 1B shape's 2048 columns, a few float32 ulps apart for 576 columns in blocks of 64);
  a weight of at most that many rows is dequantized whole as before, the very same outputs;
* any other dequantize is moved to just before its first user, so it is made when needed
  and freed after its last use (torch.fx frees a value after its last use).

The graphs are restored on exit (torch.export of them must still see the op where it was).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch

# output channels of a dequantized linear computed at a time: a block's float32 weight is
# 8192 x 2048 x 4 = 64 MB at the 1B shape's width (its lm_head: 16 blocks, not 1.05 GB)
LINEAR_BLOCK_ROWS = 8192


def _rows(params: tuple, per_channel: bool, r: Any) -> tuple:
    """The dequantize's parameters (after its input) for the rows ``r`` of its input: per
    channel along the rows, the scales and zero points of those rows; per tensor, the same."""
    if not per_channel:
        return params
    scales, zero_points, *rest = params
    zps = zero_points[r] if isinstance(zero_points, torch.Tensor) and zero_points.numel() > 1 else zero_points
    return (scales[r], zps, *rest)


def _gathered(dequantize: Callable, per_channel: bool, q: torch.Tensor, *args: Any) -> torch.Tensor:
    """``aten.embedding(dequantize(q, *params), indices)`` (args: params then indices): the
    rows gathered first, then dequantized with their own parameters (the same float values:
    the dequantization is elementwise, its parameters per tensor or per row)."""
    *params, indices = args
    flat = indices.reshape(-1)
    rows = dequantize(q[flat].contiguous(), *_rows(tuple(params), per_channel, flat))
    return rows.reshape(*indices.shape, *q.shape[1:])


def _blocked_linear(dequantize: Callable, per_channel: bool, x: torch.Tensor, q: torch.Tensor,
                    *args: Any) -> torch.Tensor:
    """``aten.linear(x, dequantize(q, *params), bias)`` (args: params then the bias, None
    without) a block of LINEAR_BLOCK_ROWS output channels at a time (each block's weight
    dequantized with its rows' parameters)."""
    *params, bias = args
    rows = q.shape[0]
    if rows <= LINEAR_BLOCK_ROWS:
        return torch.nn.functional.linear(x, dequantize(q, *params), bias)
    out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype)
    for i in range(0, rows, LINEAR_BLOCK_ROWS):
        r = slice(i, i + LINEAR_BLOCK_ROWS)
        w = dequantize(q[r], *_rows(tuple(params), per_channel, r))
        out[..., r] = torch.nn.functional.linear(x, w, None if bias is None else bias[r])
    return out


def _of_rows(node: Any, per_channel: bool) -> bool:
    """A dequantize of a constant (get_attr) with no keyword arguments, per tensor or per
    channel along its rows (axis 0 of a 2-d weight)."""
    args = node.args
    if not args or getattr(args[0], "op", None) != "get_attr" or node.kwargs:
        return False
    if not per_channel:
        return True
    meta = args[0].meta.get("val")
    return len(args) == 7 and args[3] in (0, -2) and (meta is None or meta.dim() == 2)


@contextlib.contextmanager
def dequantized_at_use(modules: Iterable[Any], targets: dict[Any, bool]) -> Iterator[None]:
    """Within the block, the dequantize nodes of constants in ``modules`` (torch.fx
    GraphModules) whose target is a key of ``targets`` (-> whether it takes per-channel
    parameters, with the signature of ``quantized_decomposed.dequantize_per_channel``; else
    that of ``dequantize_per_tensor``) compute where they are used (see the module)."""
    embedding, linear = torch.ops.aten.embedding.default, torch.ops.aten.linear.default
    rewritten: list[tuple[Any, Any, tuple, dict]] = []  # (node, target, args, kwargs) as they were
    moved: list[tuple[Any, Any]] = []  # (node, the node it followed), in the order moved
    touched = []
    for module in modules:
        nodes = list(module.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        changed = False
        for d in nodes:
            if d.op != "call_function" or d.target not in targets or not d.users or \
                    getattr(d.args[0] if d.args else None, "op", None) != "get_attr":
                continue
            per_channel = targets[d.target]
            users = list(d.users)
            rows = _of_rows(d, per_channel)
            if rows and all(u.target is embedding and u.args[0] is d and d not in u.args[1:2]
                            and not u.kwargs for u in users):
                for u in users:
                    rewritten.append((u, u.target, u.args, dict(u.kwargs)))
                    u.target, u.args = _bound(_gathered, d.target, per_channel), (*d.args, u.args[1])
            elif rows and all(u.target is linear and u.args[1] is d and u.args[0] is not d
                              and d not in u.args[2:] and not u.kwargs for u in users):
                for u in users:
                    rewritten.append((u, u.target, u.args, dict(u.kwargs)))
                    bias = u.args[2] if len(u.args) > 2 else None
                    u.target, u.args = _bound(_blocked_linear, d.target, per_channel), (u.args[0], *d.args, bias)
            if not d.users:  # its users compute from the integers themselves: not made whole at all
                rewritten.append((d, d.target, d.args, dict(d.kwargs)))
                d.target, d.args, d.kwargs = _nothing, (), {}
            else:
                first = min(users, key=order.__getitem__)
                if d.next is not first:
                    moved.append((d, d.prev))
                    first.prepend(d)
            changed = True
        if changed:
            touched.append(module)
            module.recompile()
    try:
        yield
    finally:
        for u, target, args, kwargs in reversed(rewritten):
            u.target, u.args, u.kwargs = target, args, kwargs
        for d, prev in reversed(moved):
            prev.append(d)
        for module in touched:
            module.recompile()


def _nothing() -> None:
    """What a dequantize whose users all compute from the integers themselves runs instead."""
    return None


_BOUND: dict[tuple, Callable] = {}


def _bound(fn: Callable, dequantize: Callable, per_channel: bool) -> Callable:
    """``fn`` with its dequantize bound, one function object per triple (a graph's call target)."""
    key = (fn, dequantize, per_channel)
    if key not in _BOUND:
        def call(*args: Any) -> torch.Tensor:
            return fn(dequantize, per_channel, *args)
        call.__name__ = call.__qualname__ = f"{fn.__name__.lstrip('_')}_of_dequantized"
        call.__module__ = __name__
        _BOUND[key] = call
    return _BOUND[key]
