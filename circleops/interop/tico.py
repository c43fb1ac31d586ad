"""TICO's ``circle_custom::*`` ops, so that models written for TICO (Samsung's torch-to-Circle
converter) convert with circleops: each op mapped to its Circle builtin, or decomposed into
ops that circleops writes as builtins (CONV_2D, MAX_POOL_2D, RMS_NORM, ...).

TICO defines the ops (``tico.utils.register_custom_op.RegisterOps()``; TICO itself is
optional here); this module only tells circleops' registry how to write them, through the
public :func:`circleops.register_op`, and gives each a reference kernel in aten or circle
ops (TICO's NHWC conventions, its None defaults). circleops imports it on the first
registry lookup of a ``circle_custom`` op (circleops.ops.registry.INTEROP), and
:func:`register_defined` registers whichever of the ops are defined by then.

| circle_custom op | written as |
|---|---|
| rms_norm | circle::rms_norm (RMS_NORM builtin; decomposed / composite as the target says) |
| attention | circle::attention (ONE's ATTENTION contract; TICO's kernel is a placeholder) |
| instance_norm | circle::instance_norm on the NCHW view (INSTANCE_NORM) |
| resize_bilinear | RESIZE_BILINEAR (alignCorners, halfPixelCenters); decomposed where not run |
| resize_nearest_neighbor | RESIZE_NEAREST_NEIGHBOR; decomposed where not run (onert) |
| prelu | PRELU (channel-last broadcasting) |
| conv2d, depthwise_conv2d, transpose_conv, maxpool2d, avgpool2d | the aten op on the NCHW view: CONV_2D, DEPTHWISE_CONV_2D, TRANSPOSE_CONV, MAX_POOL_2D, AVERAGE_POOL_2D |
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

import circleops

NAMESPACE = "circle_custom"
_TO_NCHW = (0, 3, 1, 2)
_TO_NHWC = (0, 2, 3, 1)


def _nchw(x: Tensor) -> Tensor:
    return x.permute(_TO_NCHW)


def _nhwc(x: Tensor) -> Tensor:
    return x.permute(_TO_NHWC)


def _pair(value: Optional[Sequence[int]], default: Sequence[int]) -> list[int]:
    return list(default) if value is None else list(value)


# ------------------------------------------------------------------------ references
def rms_norm(hidden_states: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """TICO's RMSNorm is Llama's (normalize in fp32, cast back, then weight ·): circle::rms_norm's default."""
    return torch.ops.circle.rms_norm(hidden_states, weight, eps)


def attention(hidden_states: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, position_cos: Tensor,
              position_sin: Tensor, attention_mask: Tensor, past_key: Tensor, past_value: Tensor,
              cache_position: Tensor) -> Tensor:
    """ONE's ATTENTION, which TICO's op stands for: circle::attention's output."""
    return torch.ops.circle.attention(hidden_states, wq, wk, wv, wo, position_cos, position_sin, attention_mask,
                                      past_key, past_value, cache_position)[0]


def instance_norm(input_: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                  running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                  use_input_stats: bool = True, momentum: float = 0.1, eps: float = 1e-5,
                  cudnn_enabled: bool = False) -> Tensor:
    """NHWC instance norm (TICO computes with input statistics whatever use_input_stats says)."""
    return _nhwc(torch.ops.circle.instance_norm(_nchw(input_), weight, bias, eps))


def _resize_matrix(n_in: int, n_out: int, align_corners: bool, half_pixel_centers: bool,
                   dtype: torch.dtype) -> Tensor:
    """[n_out, n_in] linear-interpolation weights of TFLite/Circle RESIZE_BILINEAR's
    coordinate mode (TICO's reference: source coordinate clamped to [0, n_in - 1]).
    Functional ops on constants only, so the lowering folds it to one constant."""
    scale = (n_in - 1) / (n_out - 1) if align_corners and n_out > 1 else n_in / n_out
    o = torch.arange(n_out, dtype=torch.float64)
    src = (o + 0.5) * scale - 0.5 if half_pixel_centers else o * scale
    src = src.clamp(0.0, n_in - 1.0)
    lo = torch.floor(src)
    hi = torch.clamp(lo + 1, max=n_in - 1)
    frac = (src - lo)[:, None]
    i = torch.arange(n_in, dtype=torch.float64)[None, :]
    m = (i == lo[:, None]).to(torch.float64) * (1.0 - frac) + (i == hi[:, None]).to(torch.float64) * frac
    return m.to(dtype)


def resize_bilinear(input_: Tensor, size: Sequence[int], align_corners: bool = False,
                    half_pixel_centers: bool = False) -> Tensor:
    """NHWC bilinear resize to ``size`` = (H, W), separable: one interpolation matrix per
    axis (constants of the static shapes), computed in fp32 (fp64 for fp64)."""
    out_h, out_w = (int(v) for v in size)
    dtype = torch.promote_types(input_.dtype, torch.float32)
    my = _resize_matrix(int(input_.shape[1]), out_h, align_corners, half_pixel_centers, dtype)
    mx = _resize_matrix(int(input_.shape[2]), out_w, align_corners, half_pixel_centers, dtype)
    x = input_.to(dtype)
    y = torch.matmul(my, x.transpose(1, 3).unsqueeze(-1)).squeeze(-1)  # [N, C, W, out_h]
    y = torch.matmul(mx, y.transpose(2, 3).unsqueeze(-1)).squeeze(-1)  # [N, C, out_h, out_w]
    return y.permute(0, 2, 3, 1).to(input_.dtype)


def resize_nearest_neighbor(input_: Tensor, size: Sequence[int]) -> Tensor:
    """NHWC nearest resize to ``size`` = (H, W) (TFLite's legacy mode: floor(o · in / out))."""
    out_h, out_w = (int(v) for v in size[-2:])
    return _nhwc(F.interpolate(_nchw(input_), size=(out_h, out_w), mode="nearest"))


def prelu(input_: Tensor, weight: Tensor) -> Tensor:
    """PReLU broadcasting the weight over the last (channel) dim."""
    return torch.where(input_ >= 0, input_, input_ * weight)


def conv2d(input_: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride: Optional[Sequence[int]] = None,
           padding: Optional[Sequence[int]] = None, dilation: Optional[Sequence[int]] = None,
           groups: Optional[int] = None) -> Tensor:
    """NHWC input, OHWI weight."""
    return _nhwc(F.conv2d(_nchw(input_), weight.permute(0, 3, 1, 2), bias, _pair(stride, (1, 1)),
                          _pair(padding, (0, 0)), _pair(dilation, (1, 1)), 1 if groups is None else groups))


def depthwise_conv2d(input_: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                     stride: Optional[Sequence[int]] = None, padding: Optional[Sequence[int]] = None,
                     dilation: Optional[Sequence[int]] = None, groups: Optional[int] = None) -> Tensor:
    """NHWC input, [1, H, W, O] weight, groups = input channels."""
    return _nhwc(F.conv2d(_nchw(input_), weight.permute(3, 0, 1, 2), bias, _pair(stride, (1, 1)),
                          _pair(padding, (0, 0)), _pair(dilation, (1, 1)), groups))


def transpose_conv(input_: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                   stride: Optional[Sequence[int]] = None, padding: Optional[Sequence[int]] = None,
                   output_padding: Optional[Sequence[int]] = None, groups: Optional[int] = None,
                   dilation: Optional[Sequence[int]] = None) -> Tensor:
    """NHWC input, OHWI weight (TICO permutes it to IOHW for aten)."""
    return _nhwc(F.conv_transpose2d(_nchw(input_), weight.permute(3, 0, 1, 2), bias, _pair(stride, (1, 1)),
                                    _pair(padding, (0, 0)), _pair(output_padding, (0, 0)),
                                    1 if groups is None else groups, _pair(dilation, (1, 1))))


def maxpool2d(input_: Tensor, kernel_size: Sequence[int], stride: Optional[Sequence[int]] = None,
              padding: Optional[Sequence[int]] = None, dilation: Optional[Sequence[int]] = None,
              ceil_mode: Optional[bool] = None) -> Tensor:
    return _nhwc(F.max_pool2d(_nchw(input_), list(kernel_size), list(stride) if stride else list(kernel_size),
                              _pair(padding, (0, 0)), _pair(dilation, (1, 1)), bool(ceil_mode)))


def avgpool2d(input_: Tensor, kernel_size: Sequence[int], stride: Optional[Sequence[int]] = None,
              padding: Optional[Sequence[int]] = None, ceil_mode: Optional[bool] = None,
              count_include_pad: Optional[bool] = None, divisor_override: Optional[int] = None) -> Tensor:
    return _nhwc(F.avg_pool2d(_nchw(input_), list(kernel_size), list(stride) if stride else list(kernel_size),
                              _pair(padding, (0, 0)), bool(ceil_mode),
                              True if count_include_pad is None else count_include_pad, divisor_override))


# name -> (reference, circle form); TICO's ops are Circle ops: TFLite gets their decomposition
MAPPING: dict[str, tuple[Callable[..., Any], Any]] = {
    "rms_norm": (rms_norm, "decompose"),
    "attention": (attention, "decompose"),
    "instance_norm": (instance_norm, "decompose"),
    "resize_bilinear": (resize_bilinear, {"builtin": "RESIZE_BILINEAR", "options": "ResizeBilinearOptions",
                                          "inputs": ["input_", "size"],
                                          "option_fields": {"alignCorners": "align_corners",
                                                            "halfPixelCenters": "half_pixel_centers"}}),
    "resize_nearest_neighbor": (resize_nearest_neighbor, {"builtin": "RESIZE_NEAREST_NEIGHBOR",
                                                          "options": "ResizeNearestNeighborOptions",
                                                          "inputs": ["input_", "size"], "option_fields": {}}),
    "prelu": (prelu, {"builtin": "PRELU", "inputs": ["input_", "weight"]}),
    "conv2d": (conv2d, "decompose"),
    "depthwise_conv2d": (depthwise_conv2d, "decompose"),
    "transpose_conv": (transpose_conv, "decompose"),
    "maxpool2d": (maxpool2d, "decompose"),
    "avgpool2d": (avgpool2d, "decompose"),
}


def register_defined() -> list[str]:
    """Register every mapped ``circle_custom`` op that torch knows by now (TICO, or a model's
    own copy of TICO's definitions) and circleops does not yet. Returns the names registered."""
    done = []
    namespace = getattr(torch.ops, NAMESPACE)
    for name, (reference, circle) in MAPPING.items():
        qualname = f"{NAMESPACE}::{name}"
        if circleops.lookup(qualname) is not None or not _defined(namespace, name):
            continue
        circleops.register_op(getattr(namespace, name), reference, circle=circle, tflite="decompose",
                              provider="circleops.interop.tico")
        done.append(qualname)
    return done


def _defined(namespace: Any, name: str) -> bool:
    try:
        return hasattr(getattr(namespace, name), "default")
    except (AttributeError, RuntimeError):
        return False


register_defined()

__all__ = ["MAPPING", "NAMESPACE", "register_defined", *MAPPING]
