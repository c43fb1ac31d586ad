"""Resizing (torch.nn.functional.interpolate, every mode): separable per spatial axis.

Each axis's map is taken from torch itself (the op run on a one-hot basis, see
pool.axis_matrices), so align_corners, scale factors and antialiasing are torch's by
construction. Nearest modes become a GATHER per axis (an exact copy, inf and NaN
included); linear, bilinear, bicubic, trilinear and antialiased modes a FULLY_CONNECTED per
axis. RESIZE_BILINEAR / RESIZE_NEAREST_NEIGHBOR are written instead where they compute
exactly torch's map and the target runs them (a Circle file for an NPU keeps the resize).
"""
from __future__ import annotations

import torch

from circleops.lowering.pool import along, axis_matrices
from circleops.lowering.registry import lower

aten = torch.ops.aten
_TO_NHWC = (0, 2, 3, 1)
_TO_NCHW = (0, 3, 1, 2)


def _tf_index(n_in, n_out, align, half):
    """The source index / coordinates TFLite's resize kernels use (for the builtin check)."""
    scale = (n_in - 1) / (n_out - 1) if align and n_out > 1 else n_in / n_out
    pos = (torch.arange(n_out, dtype=torch.float32) + (0.5 if half else 0.0)) * scale - (0.5 if half else 0.0)
    return pos


def _bilinear_builtin(n_in, n_out, align, matrix):
    """Whether RESIZE_BILINEAR(alignCorners=align, halfPixelCenters=not align) is this matrix."""
    pos = _tf_index(n_in, n_out, align, not align).clamp(min=0)
    lo = pos.floor().long().clamp(max=n_in - 1)
    hi = (lo + 1).clamp(max=n_in - 1)
    frac = pos - pos.floor()
    want = torch.zeros(n_out, n_in)
    want[torch.arange(n_out), lo] += 1 - frac
    want[torch.arange(n_out), hi] += frac
    return torch.allclose(want, matrix, atol=1e-6)


def resize(ctx, x, k, op, align, scales, mode):
    """x [N, C, *spatial] resized to the node's output by the .default overload ``op``."""
    n_in, n_out = x.shape[-k:], ctx.out_shape[-k:]
    scales = list(scales) if scales else [None] * k

    def make_args(axis, sizes):
        picked = [scales[a] if a == axis else None for a in range(k)]
        return (sizes, align, *picked) if align is not None else (sizes, *picked)

    mats = axis_matrices(op, n_in, n_out, make_args)
    if mode == "nearest":
        idx = [m.argmax(1).tolist() for m in mats]
        if k == 2 and ctx.supports("RESIZE_NEAREST_NEIGHBOR", x.dtype) and all(
                i == _tf_index(a, b, False, False).floor().long().clamp(max=a - 1).tolist()
                for i, a, b in zip(idx, n_in, n_out)):
            return _builtin(ctx, x, "RESIZE_NEAREST_NEIGHBOR", "ResizeNearestNeighborOptions", False)
        for axis, i in enumerate(idx):
            if i != list(range(n_in[axis])):
                x = ctx.gather(x, i, x.rank - k + axis)
        return x
    if (mode == "bilinear" and k == 2 and align is not None and ctx.supports("RESIZE_BILINEAR", x.dtype)
            and all(_bilinear_builtin(a, b, bool(align), m) for a, b, m in zip(n_in, n_out, mats))):
        return _builtin(ctx, x, "RESIZE_BILINEAR", "ResizeBilinearOptions", bool(align))
    for axis, m in enumerate(mats):
        x = along(ctx, x, x.rank - k + axis, m)
    return x


def _builtin(ctx, x, opcode, options, align):
    n, c = x.shape[:2]
    oh, ow = ctx.out_shape[-2:]
    y = ctx.emit(opcode, [ctx.transpose(x, _TO_NHWC), ctx.i32([oh, ow])], options, out_shape=(n, oh, ow, c),
                 out_dtype=x.dtype, alignCorners=align, halfPixelCenters=not align and opcode == "RESIZE_BILINEAR")
    return ctx.transpose(y, _TO_NCHW)


# (overload packet, spatial dims, takes align_corners, mode); its .default and .vec overloads are lowered
_RESIZES = [
    *((getattr(aten, f"{name}{k}d"), k, False, "nearest") for name in ("upsample_nearest", "_upsample_nearest_exact")
      for k in (1, 2, 3)),
    (aten.upsample_linear1d, 1, True, "linear"),
    (aten.upsample_bilinear2d, 2, True, "bilinear"),
    (aten.upsample_bicubic2d, 2, True, "bicubic"),
    (aten.upsample_trilinear3d, 3, True, "trilinear"),
    (aten._upsample_bilinear2d_aa, 2, True, "aa"),
    (aten._upsample_bicubic2d_aa, 2, True, "aa"),
]


def _register(packet, k, has_align, mode):
    op = packet.default

    def vec(ctx, node, x, output_size, *rest):
        # .vec: (input, output_size, [align_corners,] scale_factors)
        align = rest[0] if has_align else None
        factors = rest[-1] if rest else None
        return resize(ctx, x, k, op, align, None if output_size is not None else factors, mode)

    def default(ctx, node, x, output_size, *rest):
        # .default: (input, output_size, [align_corners,] *scales)
        align = rest[0] if has_align else None
        scales = list(rest[1:] if has_align else rest)
        scales = scales + [None] * (k - len(scales))
        return resize(ctx, x, k, op, align, scales, mode)

    lower(packet.vec)(vec)
    lower(packet.default)(default)


for _row in _RESIZES:
    _register(*_row)
