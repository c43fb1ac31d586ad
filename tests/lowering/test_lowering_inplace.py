"""In-place, out= and *_copy variants convert as their functional forms (circleops.passes.
functionalize), on every target, fp32 and fp16, against torch."""
from __future__ import annotations

import math

import pytest
import torch

import circleops
from circleops.passes.functionalize import functionalize, has_mutations

g = torch.Generator().manual_seed(0)


def _inplace_arith(x, y):
    z = x.clone()
    z.add_(y)
    z.mul_(2)
    z.div_(3)
    z.sub_(y, alpha=0.5)
    z.clamp_(-1, 1)
    z.masked_fill_(y > 0.5, -0.25)
    return z


def _copy_detach(x, y):
    w = torch.zeros_like(x)
    w.copy_(y)
    w.detach_()
    return w * x


def _writes_through_views(x, y):
    w = x.clone()
    w[1].copy_(y[0])
    w[:, 2] = 7.0
    w[:, 1:4:2] *= 3
    return w


def _index_put(x, y):
    w = x.clone()
    w.index_put_((torch.tensor([0, 2, 0]),), y[:3], accumulate=True)
    v = x.clone()
    v[torch.tensor([2, 0, -1])] = y[1:4]  # the last of two writes to row 2 wins
    u = x.clone()
    u[torch.tensor([1, 3]), torch.tensor([4, 0])] = -1.0
    m = x.clone()
    m[y > 0] = float("-inf")  # a boolean mask with one value: a select, -inf survives
    return w, v, u, m.softmax(-1)


def _copy_variants(x, y):
    return (torch.slice_copy(x, 1, 0, 2), torch.select_copy(x, 0, 1), torch.alias_copy(x) + 1, x.clone() * 2,
            torch.slice_scatter(x, y[:, :2], 1, 0, 2), torch.slice_scatter(x, y[:, :2], 1, 1, 5, 2),
            torch.select_scatter(x, y[0], 0, 1), torch.select_scatter(x, y[:, 0], 1, -1))


def _out_variants(x, y):
    a = torch.sub(x, y, alpha=2, out=torch.empty_like(x))
    b = torch.mul(x, 3, out=torch.empty_like(x))
    return a, b


def _falcon_attention(x, y):
    # FalconAttention's eager path: scores /= sqrt(d) in place, then softmax
    scores = x @ y.transpose(0, 1)
    scores /= math.sqrt(x.shape[-1])
    return scores.softmax(-1) @ y


def _writes_into_inputs(x, y):
    x.mul_(2)  # the caller's tensor: the file computes from the value it is given
    y[0] = 0.0
    return x + y


def _scatter(x, y):
    i = torch.tensor([[0, 4], [1, 2], [3, 3], [2, 0]])
    groups = torch.zeros(4, 5, dtype=x.dtype).scatter_(1, i, 1.0)  # DeepSeek-V3's group mask
    return x.scatter(1, i, y[:, :2]), groups, x.scatter_add(1, i, y[:, :2])


CASES = {f.__name__[1:]: f for f in (_inplace_arith, _copy_detach, _writes_through_views, _index_put, _copy_variants,
                                     _out_variants, _falcon_attention, _writes_into_inputs, _scatter)}


class Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, y):
        return self.fn(x, y)


TARGETS = [("circle", torch.float32), ("onert", torch.float32), ("tflite", torch.float32),
           ("circle", torch.float16), ("tflite", torch.float16)]


@pytest.mark.parametrize("target,dtype", TARGETS, ids=[f"{t}-{str(d)[6:]}" for t, d in TARGETS])
@pytest.mark.parametrize("name", list(CASES))
def test_inplace_and_copy_variants_convert(name, target, dtype, tmp_path):
    x = torch.randn(4, 5, generator=g).to(dtype)
    y = torch.randn(4, 5, generator=g).to(dtype)
    path = tmp_path / ("m.tflite" if target == "tflite" else "m.circle")
    report = circleops.convert(Fn(CASES[name]), (x, y), path, target=target, dtype=dtype, verify=True)
    assert report.verify.passed
    if dtype == torch.float32:
        assert report.verify.max_abs_error <= 1e-5 * max(1.0, report.verify.reference_max_abs)


def _export(fn):
    return torch.export.export(Fn(fn), (torch.randn(4, 5), torch.randn(4, 5)), strict=False)


@pytest.mark.parametrize("name", ["inplace_arith", "copy_detach", "out_variants", "falcon_attention", "index_put"])
def test_unaliased_writes_are_rewritten_locally(name, monkeypatch):
    """No run_decompositions() (a second trace of the whole model) when no write goes
    through a view: each node becomes its functional overload."""
    ep = _export(CASES[name])
    assert has_mutations(ep)

    def refuse(*a, **k):
        raise AssertionError("run_decompositions was called")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", refuse)
    out = functionalize(ep)
    assert not has_mutations(out)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    torch.testing.assert_close(out.module()(x, y), ep.module()(x, y))


def test_writes_through_views_use_torch_functionalization():
    ep = _export(_writes_through_views)
    out = functionalize(ep)
    assert not has_mutations(out)
    x, y = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    torch.testing.assert_close(out.module()(x, y), ep.module()(x, y))


def test_functional_programs_are_returned_unchanged():
    ep = torch.export.export(torch.nn.Linear(5, 3), (torch.randn(2, 5),), strict=False)
    assert functionalize(ep) is ep
