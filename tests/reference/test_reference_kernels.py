"""Reference interpreter kernels against TFLite semantics, twice over.

Each case builds a one-operator ir.Model by hand, runs it through the interpreter and
compares with an expectation computed another way (numpy indexing, explicit loops, torch
functional ops with the matching convention); then it writes the model as a .tflite file
and checks that LiteRT, a real runtime, computes the same as the interpreter.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from circleops.errors import RuntimeRunError
from circleops.runtime.reference import Interpreter
from refbuild import Const, Feed, one_op, write_and_run

rng = np.random.default_rng(0)


def randn(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def run1(opcode, operands, expected, options=None, options_type=None):
    """Run one op; return its outputs as numpy (expected declares the output tensors)."""
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    model, feeds = one_op(opcode, operands, [np.asarray(e) for e in expected], options, options_type)
    return Interpreter(model).run(feeds)


def _compare(got, want, atol, exact):
    want = np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if exact or not np.issubdtype(want.dtype, np.floating):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)


def check(opcode, operands, expected, options=None, atol=1e-6, exact=False, litert=True, onert=False):
    """Interpreter == expected; LiteRT == interpreter (unless litert=False); onert too if asked."""
    expected = expected if isinstance(expected, (list, tuple)) else [expected]
    model, feeds = one_op(opcode, operands, [np.asarray(e) for e in expected], options)
    outs = Interpreter(model).run(feeds)
    assert len(outs) == len(expected)
    for got, want in zip(outs, expected):
        _compare(got, want, atol, exact)
    for fmt in ("tflite",) * litert + ("circle",) * onert:
        with tempfile.TemporaryDirectory() as d:
            real = write_and_run(model, feeds, fmt, Path(d) / f"op.{fmt}")
        for got, want in zip(outs, real):
            _compare(got, want, max(atol, 1e-5), exact)


# ---- elementwise ----------------------------------------------------------------------

def test_add_broadcast_with_fused_relu():
    a, b = randn(2, 3, 4), randn(4)
    check("ADD", [Feed(a), Const(b)], np.maximum(a + b, 0), {"fusedActivationFunction": 1})


def test_fp16_ops_compute_in_fp16():
    a, b = randn(64, dtype=np.float16) * 300, randn(64, dtype=np.float16) * 300
    # fp16 overflow must happen exactly as an fp16 runtime computes it.
    check("MUL", [Feed(a), Feed(b)], a * b, exact=True)
    assert np.isinf(a * b).any() or np.abs(a * b).max() > 1000
    check("SUB", [Feed(a), Feed(b)], a - b, exact=True)
    check("RSQRT", [Feed(np.abs(a) + np.float16(1))], (1 / np.sqrt((np.abs(a) + 1).astype(np.float32))).astype(np.float16),
          atol=2e-3)


def test_integer_div_truncates_and_floor_mod_follows_divisor():
    a = np.array([-7, 7, -8, 9], np.int32)
    b = np.array([2, -2, 3, 4], np.int32)
    check("DIV", [Feed(a), Feed(b)], np.trunc(a / b).astype(np.int32))
    check("FLOOR_DIV", [Feed(a), Feed(b)], np.floor_divide(a, b))
    check("FLOOR_MOD", [Feed(a), Feed(b)], np.mod(a, b))


@pytest.mark.parametrize("opcode,fn", [
    ("LESS", np.less), ("LESS_EQUAL", np.less_equal), ("GREATER", np.greater),
    ("GREATER_EQUAL", np.greater_equal), ("EQUAL", np.equal), ("NOT_EQUAL", np.not_equal),
    ("MAXIMUM", np.maximum), ("MINIMUM", np.minimum), ("POW", None), ("SQUARED_DIFFERENCE", None)])
def test_binary(opcode, fn):
    a, b = np.round(randn(3, 4) * 2), np.round(randn(1, 4) * 2)
    if opcode == "POW":
        a, expected = np.abs(a) + 1, None
        expected = np.power(a, b)
    elif opcode == "SQUARED_DIFFERENCE":
        expected = (a - b) ** 2
    else:
        expected = fn(a, b)
    check(opcode, [Feed(a), Feed(b)], expected)


@pytest.mark.parametrize("opcode,fn", [
    ("NEG", np.negative), ("ABS", np.abs), ("EXP", np.exp), ("SQRT", lambda x: np.sqrt(np.abs(x))),
    ("SIN", np.sin), ("COS", np.cos), ("TANH", np.tanh), ("LOGISTIC", lambda x: 1 / (1 + np.exp(-x))),
    ("SQUARE", np.square), ("RELU", lambda x: np.maximum(x, 0)), ("RELU6", lambda x: np.clip(x, 0, 6)),
    ("FLOOR", np.floor), ("CEIL", np.ceil), ("ROUND", np.round), ("LOG", lambda x: np.log(np.abs(x))),
    ("ZEROS_LIKE", np.zeros_like), ("SIGN", np.sign)])
def test_unary(opcode, fn):
    x = randn(2, 5) * 4
    if opcode in ("SQRT", "LOG"):
        x = np.abs(x)
    if opcode == "ROUND":
        x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1.2], np.float32)  # half to even
    check(opcode, [Feed(x)], fn(x).astype(np.float32), atol=1e-5)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu(approximate):
    x = randn(3, 7)
    want = F.gelu(torch.from_numpy(x), approximate="tanh" if approximate else "none").numpy()
    check("GELU", [Feed(x)], want, {"approximate": approximate})


def test_cast_truncates_and_rounds_to_target_dtype():
    x = np.array([-1.7, -0.2, 0.0, 2.9, 1e5], np.float32)
    check("CAST", [Feed(x)], x.astype(np.int32))
    check("CAST", [Feed(x)], x.astype(np.float16), exact=True)
    check("CAST", [Feed(x)], x != 0)


def test_mixed_dtypes_are_refused_not_promoted():
    with pytest.raises(RuntimeRunError, match=r"operator 0 \(ADD\).*one dtype"):
        run1("ADD", [Feed(randn(4, dtype=np.float16)), Feed(randn(4))], randn(4))


def test_select_v2_broadcasts_and_select_v1_picks_rows():
    c = rng.random((3, 1)) > 0.5
    a, b = randn(3, 4), randn(1, 4)
    check("SELECT_V2", [Feed(c), Feed(a), Feed(b)], np.where(c, a, b))
    rows = np.array([True, False, True])
    a, b = randn(3, 2), randn(3, 2)
    check("SELECT", [Feed(rows), Feed(a), Feed(b)], np.where(rows[:, None], a, b))


# ---- matmul / conv ---------------------------------------------------------------------

@pytest.mark.parametrize("keep", [False, True])
def test_fully_connected(keep):
    x, w, b = randn(2, 3, 8), randn(5, 8), randn(5)
    y = np.clip(x @ w.T + b, 0, 6)
    check("FULLY_CONNECTED", [Feed(x), Const(w), Const(b)], y if keep else y.reshape(6, 5),
          {"keepNumDims": keep, "fusedActivationFunction": 3}, atol=1e-5)
    check("FULLY_CONNECTED", [Feed(x), Const(w), None], (x @ w.T).reshape(6, 5), atol=1e-5)


@pytest.mark.parametrize("names", [("adjX", "adjY"), ("adjointLhs", "adjointRhs")])
def test_batch_matmul_adjoints(names):
    a, b = randn(2, 1, 4, 3), randn(3, 5, 4)
    want = np.swapaxes(a, -1, -2) @ np.swapaxes(b, -1, -2)
    circle = names[0] == "adjointLhs"  # the Circle schema's spelling: check against onert
    check("BATCH_MATMUL", [Feed(a), Feed(b)], want, {names[0]: True, names[1]: True}, atol=1e-5,
          litert=not circle, onert=circle)


def _conv_nhwc(x, w, b, stride, pads, dilation=(1, 1), depthwise_mult=None):
    """Direct convolution loop: x NHWC, w OHWI (or 1HW(C·M) depthwise), explicit pads."""
    (pt, pb), (pl, pr) = pads
    x = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    n, h, wd, c = x.shape
    kh, kw = w.shape[1], w.shape[2]
    eh, ew = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    oh, ow = (h - eh) // stride[0] + 1, (wd - ew) // stride[1] + 1
    oc = w.shape[3] if depthwise_mult else w.shape[0]
    out = np.zeros((n, oh, ow, oc), np.float64)
    for i in range(oh):
        for j in range(ow):
            patch = x[:, i * stride[0]:i * stride[0] + eh:dilation[0], j * stride[1]:j * stride[1] + ew:dilation[1], :]
            if depthwise_mult:
                rep = np.repeat(patch, depthwise_mult, axis=3)  # channel c*M + m reads c
                out[:, i, j, :] = (rep * w[0]).sum((1, 2))
            else:
                out[:, i, j, :] = np.einsum("nhwc,ohwc->no", patch, w)
    return (out + b).astype(np.float32)


def test_conv_2d_same_stride_2_pads_after():
    x, w, b = randn(1, 6, 7, 3), randn(4, 3, 3, 3), randn(4)
    # TF SAME: out = ceil(6/2)=3 -> total pad 1, all of it after; width 7 -> out 4 -> pad 1+1.
    want = _conv_nhwc(x, w, b, (2, 2), ((0, 1), (1, 1)))
    check("CONV_2D", [Feed(x), Const(w), Const(b)], want,
          {"padding": 0, "strideH": 2, "strideW": 2, "dilationHFactor": 1, "dilationWFactor": 1}, atol=1e-4)


def test_conv_2d_valid_dilated_with_relu():
    x, w, b = randn(2, 7, 7, 2), randn(3, 2, 2, 2), randn(3)
    want = np.maximum(_conv_nhwc(x, w, b, (1, 1), ((0, 0), (0, 0)), dilation=(2, 2)), 0)
    check("CONV_2D", [Feed(x), Const(w), Const(b)], want,
          {"padding": "VALID", "strideH": 1, "strideW": 1, "dilationHFactor": 2, "dilationWFactor": 2,
           "fusedActivationFunction": "RELU"}, atol=1e-4)


def test_depthwise_conv_multiplier_2():
    x, w, b = randn(1, 5, 5, 3), randn(1, 3, 3, 6), randn(6)
    want = _conv_nhwc(x, w, b, (1, 1), ((1, 1), (1, 1)), depthwise_mult=2)
    check("DEPTHWISE_CONV_2D", [Feed(x), Const(w), Const(b)], want,
          {"padding": 0, "strideH": 1, "strideW": 1, "depthMultiplier": 2}, atol=1e-4)


def test_average_pool_same_excludes_padding():
    x = randn(1, 3, 3, 2)
    want = np.zeros((1, 2, 2, 2), np.float32)
    for i in range(2):
        for j in range(2):
            want[0, i, j] = x[0, 2 * i:2 * i + 2, 2 * j:2 * j + 2].mean((0, 1))  # windows clipped at the edge
    check("AVERAGE_POOL_2D", [Feed(x)], want,
          {"padding": 0, "strideH": 2, "strideW": 2, "filterHeight": 2, "filterWidth": 2}, atol=1e-6)
    check("MAX_POOL_2D", [Feed(x)], np.stack([np.stack([x[0, 2 * i:2 * i + 2, 2 * j:2 * j + 2].max((0, 1))
                                                        for j in range(2)]) for i in range(2)])[None],
          {"padding": 0, "strideH": 2, "strideW": 2, "filterHeight": 2, "filterWidth": 2})


def test_transpose_conv_valid_matches_torch():
    x, w = randn(1, 3, 3, 2), randn(4, 3, 3, 2)  # OHWI, O = output channels
    full = F.conv_transpose2d(torch.from_numpy(x).permute(0, 3, 1, 2), torch.from_numpy(w).permute(3, 0, 1, 2),
                              stride=2).permute(0, 2, 3, 1).numpy()
    check("TRANSPOSE_CONV", [Const(np.array([1, 7, 7, 4], np.int32)), Const(w), Feed(x)], full,
          {"padding": 1, "strideH": 2, "strideW": 2}, atol=1e-5)


# ---- resize ----------------------------------------------------------------------------

def _nhwc(t):
    return t.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("align,half,size", [(False, False, (7, 5)), (False, True, (7, 5)),
                                             (True, False, (7, 9)), (False, False, (2, 3))])
def test_resize_nearest(align, half, size):
    x = randn(1, 4, 6, 2)
    xt = torch.from_numpy(x).permute(0, 3, 1, 2)
    if align:  # round((i) * (in-1)/(out-1)), half away from zero
        iy = np.floor(np.arange(size[0]) * (4 - 1) / (size[0] - 1) + 0.5).astype(int)
        ix = np.floor(np.arange(size[1]) * (6 - 1) / (size[1] - 1) + 0.5).astype(int)
        want = x[:, iy][:, :, ix]
    else:  # torch 'nearest' is floor(i·scale); 'nearest-exact' is floor((i+0.5)·scale)
        want = _nhwc(F.interpolate(xt, size=size, mode="nearest-exact" if half else "nearest"))
    check("RESIZE_NEAREST_NEIGHBOR", [Feed(x), Const(np.array(size, np.int32))], want,
          {"alignCorners": align, "halfPixelCenters": half}, exact=True)


@pytest.mark.parametrize("align,half", [(False, True), (True, False)])
def test_resize_bilinear(align, half):
    x = randn(1, 4, 5, 3)
    want = _nhwc(F.interpolate(torch.from_numpy(x).permute(0, 3, 1, 2), size=(8, 7), mode="bilinear",
                               align_corners=align))
    check("RESIZE_BILINEAR", [Feed(x), Const(np.array([8, 7], np.int32))], want,
          {"alignCorners": align, "halfPixelCenters": half}, atol=1e-5)


# ---- shape and indexing ----------------------------------------------------------------

def _ss(x, begin, end, strides, want, litert=True, **masks):
    check("STRIDED_SLICE", [Feed(x), Const(np.array(begin, np.int32)), Const(np.array(end, np.int32)),
                            Const(np.array(strides, np.int32))], np.ascontiguousarray(want), masks or None,
          litert=litert)


def test_strided_slice_masks():
    x = randn(4, 5, 6)
    _ss(x, [1, 0, 0], [3, 5, 6], [1, 2, 3], x[1:3, 0:5:2, 0:6:3])
    _ss(x, [1, 4, 0], [0, 0, 0], [1, -1, 1], x[1:, 4:0:-1, :], beginMask=0b100, endMask=0b101)
    _ss(x, [0, 2, -1], [4, 3, 0], [1, 1, 1], x[:, 2:3, -1], shrinkAxisMask=0b100)
    _ss(x, [0, 0, 1], [0, 0, 2], [1, 1, 1], x[..., None, 1:2], ellipsisMask=0b001, newAxisMask=0b010)
    _ss(x, [-1, 0], [0, 0], [-1, 1], x[::-1], beginMask=0b11, endMask=0b11)
    _ss(x, [2, 1], [0, 0], [1, 1], x[2, 1], shrinkAxisMask=0b11)
    # LiteRT 2.3 crashes (SIGSEGV) on offset=True whatever the op version: checked against numpy only.
    _ss(x, [1, 2], [2, 3], [1, 1], x[1:3, 2:5], litert=False, offset=True)


def test_slice_gather_gather_nd():
    x = randn(4, 5, 6)
    check("SLICE", [Feed(x), Const(np.array([1, 0, 2], np.int32)), Const(np.array([2, -1, 3], np.int32))],
          x[1:3, :, 2:5])
    idx = np.array([[0, 3], [4, 4]], np.int64)
    check("GATHER", [Feed(x), Const(idx)], np.take(x, idx, axis=1), {"axis": 1})
    check("GATHER", [Feed(x), Const(idx.astype(np.int32))], np.take(x, idx[0], axis=-1)[..., None, :].repeat(1, -2)
          if False else np.take(x, idx.astype(np.int32), axis=-1), {"axis": -1})
    bidx = np.array([[1, 2], [0, 0], [4, 1], [3, 3]], np.int32)  # batch_dims=1 over the 4 rows
    want = np.stack([np.take(x[i], bidx[i], axis=0) for i in range(4)])
    check("GATHER", [Feed(x), Const(bidx)], want, {"axis": 1, "batchDims": 1})
    nd = np.array([[0, 1], [3, 4], [2, 0]], np.int32)
    check("GATHER_ND", [Feed(x), Const(nd)], x[nd[:, 0], nd[:, 1]])


def test_reshape_transpose_squeeze_expand():
    x = randn(2, 1, 6)
    check("RESHAPE", [Feed(x), Const(np.array([3, -1], np.int32))], x.reshape(3, 4))
    check("RESHAPE", [Feed(x)], x.reshape(12), {"newShape": [12]})
    check("TRANSPOSE", [Feed(x), Const(np.array([2, 0, 1], np.int32))], x.transpose(2, 0, 1))
    check("SQUEEZE", [Feed(x)], x[:, 0], {"squeezeDims": [-2]})
    check("SQUEEZE", [Feed(x[:1])], x[0, 0])
    check("EXPAND_DIMS", [Feed(x), Const(np.array(-1, np.int32))], x[..., None])


def test_concat_pack_unpack_split():
    a, b = randn(2, 3), randn(2, 4)
    check("CONCATENATION", [Feed(a), Feed(b)], np.concatenate([a, b], 1), {"axis": -1})
    c = randn(2, 3)
    check("PACK", [Feed(a), Feed(c)], np.stack([a, c], 1), {"axis": 1, "valuesCount": 2})
    check("UNPACK", [Feed(b)], list(b), {"axis": 0, "num": 2})
    x = randn(6, 4)
    check("SPLIT", [Const(np.array(0, np.int32)), Feed(x)], np.split(x, 3), {"numSplits": 3})
    check("SPLIT_V", [Feed(x), Const(np.array([1, -1, 2], np.int32)), Const(np.array([0], np.int32))],
          [x[:1], x[1:4], x[4:]], {"numSplits": 3})


@pytest.mark.parametrize("mode,np_mode", [(0, "reflect"), (1, "symmetric"), ("SYMMETRIC", "symmetric")])
def test_mirror_pad(mode, np_mode):
    x = randn(1, 4, 5, 2)
    pads = np.array([[0, 0], [2, 1], [1, 3], [0, 0]], np.int32)
    check("MIRROR_PAD", [Feed(x), Const(pads)], np.pad(x, pads, mode=np_mode), {"mode": mode})


def test_pad_broadcast_tile_fill_range():
    x = randn(2, 3)
    pads = np.array([[1, 0], [0, 2]], np.int32)
    check("PAD", [Feed(x), Const(pads)], np.pad(x, pads))
    check("PADV2", [Feed(x), Const(pads), Const(np.array(-5.0, np.float32))], np.pad(x, pads, constant_values=-5))
    check("BROADCAST_TO", [Feed(x[:1]), Const(np.array([2, 2, 3], np.int32))], np.broadcast_to(x[:1], (2, 2, 3)))
    check("TILE", [Feed(x), Const(np.array([2, 1], np.int32))], np.tile(x, (2, 1)))
    check("FILL", [Const(np.array([2, 3], np.int32)), Feed(np.array(1.5, np.float32))], np.full((2, 3), 1.5, np.float32))
    check("RANGE", [Const(np.array(2, np.int64)), Feed(np.array(11, np.int64)), Const(np.array(3, np.int64))],
          np.arange(2, 11, 3, dtype=np.int64))


# ---- reductions ------------------------------------------------------------------------

def test_reductions_negative_duplicate_and_empty_axes():
    x = randn(2, 3, 4)
    check("MEAN", [Feed(x), Const(np.array([-1, 2, 0], np.int32))], x.mean((0, 2), keepdims=True), {"keepDims": True})
    check("SUM", [Feed(x), Const(np.array([1], np.int32))], x.sum(1), atol=1e-5)
    check("REDUCE_MAX", [Feed(x), Const(np.array([0, 1], np.int32))], x.max((0, 1)))
    check("REDUCE_PROD", [Feed(x), Const(np.array([0, 2], np.int32))], x.prod((0, 2), keepdims=True),
          {"keepDims": True}, atol=1e-5)
    check("MEAN", [Feed(x), Const(np.zeros((0,), np.int32))], x)  # no axes: identity


def test_softmax_beta_argmax_cumsum():
    x = randn(3, 5)
    check("SOFTMAX", [Feed(x)], torch.softmax(torch.from_numpy(x) * 0.5, -1).numpy(), {"beta": 0.5})
    check("ARG_MAX", [Feed(x), Const(np.array([1], np.int32))], x.argmax(1).astype(np.int32), {"outputType": 2})
    check("CUMSUM", [Feed(x), Const(np.array(1, np.int32))], np.cumsum(x, 1), atol=1e-5)
    excl_rev = np.flip(np.cumsum(np.flip(x, 1), 1), 1) - x
    check("CUMSUM", [Feed(x), Const(np.array(-1, np.int32))], excl_rev, {"exclusive": True, "reverse": True}, atol=1e-5)


def test_one_hot_topk_where():
    ids = np.array([2, 0, 3], np.int32)
    check("ONE_HOT", [Feed(ids), Const(np.array(4, np.int32)), Const(np.array(1.0, np.float32)),
                      Const(np.array(0.0, np.float32))], np.eye(4, dtype=np.float32)[ids], {"axis": -1})
    x = randn(2, 6)
    order = np.argsort(-x, axis=1)[:, :3]
    check("TOPK_V2", [Feed(x), Const(np.array(3, np.int32))],
          [np.take_along_axis(x, order, 1), order.astype(np.int32)])
    m = x > 0
    check("WHERE", [Feed(m)], np.argwhere(m).astype(np.int64))
