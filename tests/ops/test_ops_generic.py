"""Checks every built-in op gets by being in schema/ops.yaml (circleops.ops.BUILTINS).

Per-op inputs come from the op module's ``sample_inputs(dtype)``, so nothing here is
written per op. The battery is circleops.testing's, the one ``check_op`` runs on users'
ops: schema, eager vs reference kernel, opcheck (fp32, fp16, bf16, mixed dtypes, with
grad), gradcheck (fp64), torch.autocast (the rule declared in schema/ops.yaml),
torch.export (strict and non-strict, the op kept whole through run_decompositions), and
every target converted and its file verified against torch. Here besides: backward vs
autograd of the reference, export and a training step under autocast.
"""
from __future__ import annotations

import pytest
import torch

from circleops.ops import BUILTINS, REGISTRY
from circleops.testing import CHECKS, CallOp

OPS = list(BUILTINS)


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _with_grad(args):
    return tuple(a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _tensors(args):
    return tuple(a for a in args if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", OPS)
def test_battery(name, check):
    spec = REGISTRY[name]
    CHECKS[check](spec, spec.sample_inputs)


@pytest.mark.parametrize("name", OPS)
def test_backward_equals_autograd_of_reference(name):
    # Training (QAT) goes through the registered backward; it must be the exact gradient
    # of the computation the forward ran.
    spec = REGISTRY[name]
    for args, kwargs in spec.sample_inputs(torch.float32) + spec.sample_inputs(torch.bfloat16)[-1:]:
        a1, a2 = _with_grad(args), _with_grad(args)
        outs1, outs2 = _tuple(spec.op(*a1, **kwargs)), _tuple(spec.reference(*a2, **kwargs))
        g = torch.Generator().manual_seed(1)
        cotangents = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs1]
        sum((o * c).sum() for o, c in zip(outs1, cotangents)).backward()
        sum((o * c).sum() for o, c in zip(outs2, cotangents)).backward()
        for t1, t2 in zip(_tensors(a1), _tensors(a2)):
            if t1.is_floating_point():
                assert t1.grad is not None and torch.isfinite(t1.grad).all()
                torch.testing.assert_close(t1.grad, t2.grad, rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("strict", (False, True), ids=("nonstrict", "strict"))
@pytest.mark.parametrize("name", OPS)
def test_export_under_autocast(name, strict):
    # The exported program carries the autocast casts: run outside autocast, it matches eager inside.
    spec = REGISTRY[name]
    args, kwargs = spec.sample_inputs(torch.float32)[0]
    module = CallOp(spec.op, args, kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _tuple(module(*_tensors(args)))
        ep = torch.export.export(module, _tensors(args), strict=strict).run_decompositions()
    got = _tuple(ep.module()(*_tensors(args)))
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("name", OPS)
def test_training_step_under_autocast(name):
    # Mixed-precision training: forward in autocast, backward outside, fp32 leaves get fp32 grads.
    spec = REGISTRY[name]
    args, kwargs = spec.sample_inputs(torch.float32)[0]
    args = _with_grad(args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = _tuple(spec.op(*args, **kwargs))
    sum(o.float().square().mean() for o in outs).backward()
    for t in _tensors(args):
        if t.is_floating_point():
            assert t.grad is not None and t.grad.dtype == t.dtype and torch.isfinite(t.grad).all()
