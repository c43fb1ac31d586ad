"""Models written for TICO (Samsung's torch-to-Circle converter) convert with circleops: its
``circle_custom::*`` ops, defined by TICO itself (tico.utils.register_custom_op), are
registered through circleops' public registry by circleops.interop.tico, loaded when such
an op first appears, each mapped to its Circle builtin or decomposed.

The three ResizeBilinear modules are TICO's own system-test modules
(test/modules/op/resize_bilinear.py), which failed before ("no lowering").
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.runtime import reference

try:
    from tico.ops import ResizeBilinear2d
    from tico.utils.register_custom_op import RegisterOps
except ImportError as err:  # a test extra: pip install -e ".[test]" (tico==0.3.0)
    raise ImportError(f"tests/registry/test_tico_interop.py needs TICO: pip install -e '.[test]' ({err})") from err

RegisterOps()

cc = torch.ops.circle_custom
SUFFIX = {"circle": "circle", "onert": "circle", "tflite": "tflite"}


class AsymmetricResizeBilinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.resize = ResizeBilinear2d((6, 8), align_corners=False, half_pixel_centers=False)

    def forward(self, input_):
        return self.resize(input_)


class HalfPixelResizeBilinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.resize = ResizeBilinear2d((6, 8), align_corners=False, half_pixel_centers=True)

    def forward(self, input_):
        return self.resize(input_)


class AlignCornersResizeBilinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.resize = ResizeBilinear2d((6, 8), align_corners=True, half_pixel_centers=False)

    def forward(self, input_):
        return self.resize(input_)


class NHWC(torch.nn.Module):
    """One circle_custom op on an NHWC input, with its weights."""

    def __init__(self, fn, **weights):
        super().__init__()
        torch.manual_seed(0)
        self.fn = fn
        for name, t in weights.items():
            self.register_buffer(name, t)

    def forward(self, x):
        return self.fn(self, x)


def _models():
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    nhwc = r(1, 6, 6, 4)
    return {
        "resize_bilinear_asymmetric": (AsymmetricResizeBilinear(), r(1, 2, 3, 4), {"RESIZE_BILINEAR"}),
        "resize_bilinear_half_pixel": (HalfPixelResizeBilinear(), r(1, 2, 3, 4), {"RESIZE_BILINEAR"}),
        "resize_bilinear_align_corners": (AlignCornersResizeBilinear(), r(1, 2, 3, 4), {"RESIZE_BILINEAR"}),
        "conv2d": (NHWC(lambda m, x: cc.conv2d(x, m.w, m.b, [1, 1], [1, 1]), w=r(5, 3, 3, 4), b=r(5)), nhwc,
                   {"CONV_2D"}),
        "depthwise_conv2d": (NHWC(lambda m, x: cc.depthwise_conv2d(x, m.w, m.b, [1, 1], [1, 1], [1, 1], 4),
                                  w=r(1, 3, 3, 4), b=r(4)), nhwc, {"DEPTHWISE_CONV_2D"}),
        "transpose_conv": (NHWC(lambda m, x: cc.transpose_conv(x, m.w, None, [2, 2]), w=r(3, 2, 2, 4)), nhwc,
                           {"TRANSPOSE_CONV"}),
        "maxpool2d": (NHWC(lambda m, x: cc.maxpool2d(x, [2, 2])), nhwc, {"MAX_POOL_2D"}),
        "avgpool2d": (NHWC(lambda m, x: cc.avgpool2d(x, [2, 2], [2, 2])), nhwc, {"AVERAGE_POOL_2D"}),
        "prelu": (NHWC(lambda m, x: cc.prelu(x, m.w), w=r(4).abs()), nhwc, {"PRELU"}),
        "instance_norm": (NHWC(lambda m, x: cc.instance_norm(x, m.w, m.b), w=r(4), b=r(4)), nhwc,
                          {"INSTANCE_NORM"}),
        "rms_norm": (NHWC(lambda m, x: cc.rms_norm(x, m.w, 1e-6), w=r(4)), r(1, 5, 4), {"RMS_NORM"}),
    }


MODELS = _models()


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
@pytest.mark.parametrize("name", MODELS)
def test_a_tico_model_converts_and_verifies(tmp_path, name, target):
    model, x, builtins = MODELS[name]
    report = circleops.convert(model, (x,), tmp_path / f"{name}.{SUFFIX[target]}", target=target, verify=True)
    assert report.verify.passed
    assert "CUSTOM" not in report.ops
    if target == "circle":  # the NPU's file keeps the op as its builtin
        assert builtins <= set(report.ops), report.ops


def test_the_interop_is_loaded_on_the_first_circle_custom_op():
    spec = circleops.ops.by_overload(cc.conv2d.default)
    assert spec is not None and spec.provider == "circleops.interop.tico"
    assert circleops.lookup("circle_custom::resize_bilinear").targets == {
        "circle": "builtin", "onert": "builtin", "tflite": "decomposed"}


def test_attention_is_ones_attention(tmp_path):
    # TICO's own kernel is a placeholder (it returns None): only the file can be checked,
    # against circle::attention, whose contract is ONE's ATTENTION.
    b, s, e, hq, hkv, d, c = 1, 3, 16, 2, 1, 8, 8
    g = torch.Generator().manual_seed(0)
    r = lambda *sh: torch.randn(*sh, generator=g) * 0.3  # noqa: E731
    w = dict(wq=r(hq * d, e), wk=r(hkv * d, e), wv=r(hkv * d, e), wo=r(e, hq * d))
    cos, sin = torch.cos(r(s, d)), torch.sin(r(s, d))
    mask = torch.triu(torch.full((s, c), float("-inf")), 1)
    kc, vc, pos = torch.zeros(b, c, hkv, d), torch.zeros(b, c, hkv, d), torch.tensor([0])

    class Attn(torch.nn.Module):
        def forward(self, x):
            return cc.attention(x, w["wq"], w["wk"], w["wv"], w["wo"], cos, sin, mask, kc, vc, pos)

    x = r(b, s, e)
    path = tmp_path / "attn.circle"
    report = circleops.convert(Attn(), (x,), path, target="circle")
    assert report.ops.get("ATTENTION") == 1
    want = torch.ops.circle.attention(x, w["wq"], w["wk"], w["wv"], w["wo"], cos, sin, mask, kc, vc, pos)[0]
    np.testing.assert_allclose(reference.run(str(path), [x.numpy()])[0], want.numpy(), rtol=1e-5, atol=1e-5)
