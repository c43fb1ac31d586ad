"""Matrix products: linear -> FULLY_CONNECTED, matmul/bmm -> BATCH_MATMUL."""
from __future__ import annotations

from typing import Any

import torch

from circleops.lowering.context import const_value
from circleops.lowering.reduce import reduce
from circleops.lowering.registry import lower

aten = torch.ops.aten


# A 1x1 CONV_2D over [1, 1, rows, in] with the weight as its [out, 1, 1, in] filter is the
# same product as FULLY_CONNECTED; where a runtime's CONV_2D kernel is the faster one
# (onert's, per shape: TargetProfile.linear_as_conv says when), linears are written so.


def _conv_1x1(ctx, x, weight, bias, dtype):
    """x [..., in] · weightᵀ as CONV_2D [1, 1, rows, in] * [out, 1, 1, in], or None when
    FULLY_CONNECTED is the faster (or the only memory-neutral) choice on the target."""
    rows, (out, inner) = x.numel // x.shape[-1], weight.shape
    rule = ctx.profile.linear_as_conv
    if (rule is None or not weight.is_const or not rule.applies(rows, inner, out)
            or not weight.const.is_contiguous()):  # the filter must be a view of the weight, not a copy
        return None
    if bias is None:
        bias = ctx.const(torch.zeros(out, dtype=dtype))  # onert's CONV_2D needs its bias input
    kernel = const_value(weight.const.view(out, 1, 1, inner), weight.name)  # OHWI, the weight's own memory
    y = ctx.emit("CONV_2D", [ctx.reshape(x, (1, 1, rows, inner)), kernel, bias],
                 "Conv2DOptions", out_shape=(1, 1, rows, out), out_dtype=dtype, padding="VALID", strideW=1,
                 strideH=1, dilationWFactor=1, dilationHFactor=1, fusedActivationFunction=0)
    return ctx.reshape(y, x.shape[:-1] + (out,))


def fully_connected(ctx, x, weight, bias=None):
    """x [..., in] · weightᵀ [out, in] (+ bias), torch Linear layout = TFLite's FC layout."""
    dtype = ctx.out_dtype
    x, weight = ctx.cast(x, dtype), ctx.cast(weight, dtype)
    bias = ctx.cast(bias, dtype) if bias is not None else None
    out_shape = x.shape[:-1] + (weight.shape[0],)
    conv = _conv_1x1(ctx, x, weight, bias, dtype)
    if conv is not None:
        return conv
    if x.rank == 2 or not ctx.profile.fc_keep_num_dims:
        # onert ignores keepNumDims and returns [N, out]: flatten explicitly and restore.
        flat = ctx.reshape(x, (-1, x.shape[-1]))
        y = ctx.emit("FULLY_CONNECTED", [flat, weight, bias], "FullyConnectedOptions",
                     out_shape=(flat.shape[0], weight.shape[0]), out_dtype=dtype,
                     fusedActivationFunction=0, keepNumDims=False)
        return ctx.reshape(y, out_shape)
    return ctx.emit("FULLY_CONNECTED", [x, weight, bias], "FullyConnectedOptions", out_shape=out_shape,
                    out_dtype=dtype, fusedActivationFunction=0, keepNumDims=True)


@lower(aten.linear)
def _(ctx, node, x, weight, bias=None):
    if x.rank == 1:
        return ctx.reshape(fully_connected(ctx, ctx.reshape(x, (1, -1)), weight, bias), ctx.out_shape)
    return fully_connected(ctx, x, weight, bias)


# BatchMatMulOptions' "b is transposed" field: the Circle and TFLite schemas name it differently.
_ADJOINT_RHS = {"circle": "adjointRhs", "tflite": "adjY"}


# _elementwise_product's bound on a one-column product's [M, K] left operand: the MUL writes it
# whole once more (a decode step's own-key score: G x D = 192 elements for SmolLM2)
_ELEMENTWISE_MAX = 1 << 14


# the targets of the FX nodes that mark their input as stored quantized (PT2E's integer graphs):
# circleops.quantize.integer.qdq adds its marker when imported, so the lowering below it in
# the layers needs no import of it (an integer graph's nodes hold the marker, so it is imported)
QUANTIZE_MARKERS: set[Any] = set()


def _integer_node(ctx) -> bool:
    """Whether the node being lowered feeds a PT2E quantize marker (an integer graph, whose
    passes quantize only the ops the calibrated graph observed)."""
    if ctx.node is None:
        return False
    return any(user.target in QUANTIZE_MARKERS for user in ctx.node.users)


def _elementwise_product(ctx, a, b, shape):
    """a @ b as MUL (+ SUM) where the runtime packs a non-constant right operand on every run
    (``TargetProfile.matmul_packs_rhs``: XNNPACK) and the product is an outer product (inner
    dimension 1: a decode step's attention weight times its own new value row) or one column
    of a few rows (its query times its own new key): two BATCH_MATMULs a layer whose packing
    and dispatch cost more than the elementwise ops. None: write the BATCH_MATMUL."""
    if not ctx.profile.matmul_packs_rhs or a.is_const or b.is_const or not ctx.out_dtype.is_floating_point:
        return None
    k = a.shape[-1]
    if k == 1:  # [.., M, 1] * [.., 1, N]: each output one product, exactly the BATCH_MATMUL's
        return None if _integer_node(ctx) else ctx.mul(a, b, ctx.out_dtype)
    if b.shape[-1] == 1 and a.shape[-2] * k <= _ELEMENTWISE_MAX and not _integer_node(ctx):
        # [.., M, K] @ [.., K, 1]: the column as a row [.., 1, K] (a reshape), MUL, SUM over K;
        # in fp32 for an fp16 graph, rounded once at the end as torch's fp16 matmul is
        dtype = ctx.out_dtype
        wide = torch.float32 if dtype == torch.float16 else dtype
        row = ctx.cast(ctx.reshape(b, b.shape[:-2] + (1, k)), wide)
        total = reduce(ctx, "SUM", ctx.mul(ctx.cast(a, wide), row, wide), [-1], True, wide)
        return ctx.reshape(ctx.cast(total, dtype), shape)
    return None


def batch_matmul(ctx, a, b):
    """a @ b for ranks >= 2 with broadcast batch dims."""
    dtype = ctx.out_dtype
    a, b = ctx.cast(a, dtype), ctx.cast(b, dtype)
    if b.rank == 2 and b.is_const:
        # a constant right-hand matrix is a FULLY_CONNECTED weight, stored transposed
        return fully_connected(ctx, a, ctx.transpose(b, (1, 0)))
    if a.is_const and not b.is_const:
        # onert refuses a constant left operand at load ("OperationValidator failed"):
        # a @ b = (bᵀ @ aᵀ)ᵀ puts the constant on the right (a FULLY_CONNECTED weight when 2-D)
        swap = list(range(b.rank - 2)) + [b.rank - 1, b.rank - 2]
        bt = ctx.transpose(b, swap)
        if a.rank == 2:
            y = fully_connected(ctx, bt, a)
        else:
            at = ctx.transpose(a, list(range(a.rank - 2)) + [a.rank - 1, a.rank - 2])
            y = batch_matmul(ctx, bt, at)
        return ctx.transpose(y, list(range(y.rank - 2)) + [y.rank - 1, y.rank - 2])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = tuple(batch) + (a.shape[-2], b.shape[-1])
    elementwise = _elementwise_product(ctx, a, b, shape)
    if elementwise is not None:
        return elementwise
    if a.shape[:-2] == b.shape[:-2] and not ctx.supports("BATCH_MATMUL", rank=len(shape)):
        # onert: rank 5+ fails at prepare; equal batch dims fold into one (SSM hybrids' [1, H, 1, L, L])
        merged = [ctx.reshape(v, (-1,) + v.shape[-2:]) for v in (a, b)]
        return ctx.reshape(batch_matmul(ctx, *merged), shape)
    if ctx.transposed(b) is not None:
        # q·Kᵀ: onert's and LiteRT's kernels take the right operand as [..., N, K] and
        # transpose any other layout themselves (a copy per call). So b = TRANSPOSE(src) is
        # written as its [..., N, K] form with the adjoint flag: the transposes compose
        # (to none when b only swapped its last two dims) and the kernel copies nothing.
        bt = ctx.transpose(b, list(range(b.rank - 2)) + [b.rank - 1, b.rank - 2])
        return ctx.emit("BATCH_MATMUL", [a, bt], "BatchMatMulOptions", out_shape=shape, out_dtype=dtype,
                        **{_ADJOINT_RHS[ctx.profile.format]: True})
    return ctx.emit("BATCH_MATMUL", [a, b], "BatchMatMulOptions", out_shape=shape, out_dtype=dtype)


@lower(aten.matmul)
def _(ctx, node, a, b):
    if a.rank >= 2 and b.rank >= 2:
        return batch_matmul(ctx, a, b)
    a2 = ctx.reshape(a, (1, a.shape[0])) if a.rank == 1 else a
    b2 = ctx.reshape(b, (b.shape[0], 1)) if b.rank == 1 else b
    return ctx.reshape(batch_matmul(ctx, a2, b2), ctx.out_shape)


@lower(aten.mm, aten.bmm)
def _(ctx, node, a, b):
    return batch_matmul(ctx, a, b)


@lower(aten.addmm)
def _(ctx, node, bias, a, b, beta=1, alpha=1):
    y = batch_matmul(ctx, a, b)
    if alpha != 1:
        y = ctx.mul(y, alpha)
    if beta == 0:
        return y
    return ctx.add(y, bias if beta == 1 else ctx.mul(bias, beta))


@lower(aten.addmv)
def _(ctx, node, bias, mat, vec, beta=1, alpha=1):
    y = ctx.reshape(batch_matmul(ctx, mat, ctx.reshape(vec, (vec.shape[0], 1))), (mat.shape[0],))
    if alpha != 1:
        y = ctx.mul(y, alpha)
    if beta == 0:
        return y
    return ctx.add(y, bias if beta == 1 else ctx.mul(bias, beta))


def _bilinear(x1, x2, w, b):
    o, i, j = w.shape
    t = torch.matmul(x1, w.permute(1, 0, 2).reshape(i, o * j)).reshape(*x1.shape[:-1], o, j)
    y = (t * x2.unsqueeze(-2)).sum(-1)
    return y if b is None else y + b


@lower(aten.bilinear)
def _(ctx, node, x1, x2, weight, bias=None):
    return ctx.call(_bilinear, x1, x2, weight, bias)


def _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """scaled_dot_product_attention's math, in the ops of an eager HF attention."""
    d, s, c = q.shape[-1], q.shape[-2], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (scale if scale is not None else d ** -0.5)
    if is_causal:
        keep = torch.ones(s, c, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@lower(aten.scaled_dot_product_attention)
def _(ctx, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if dropout_p:
        raise ctx.unsupported(f"applies attention dropout (p={dropout_p})", "Call model.eval() before export.")
    return ctx.call(_sdpa, q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)
