"""Checks every registered op gets by being in circleops.ops.REGISTRY.

Per-op inputs come from the op module's ``sample_inputs(dtype)``, so nothing here is
written per op: eager vs reference kernel, opcheck (fp32, fp16, bf16, mixed dtypes),
gradcheck (fp64), backward, torch.export (strict and non-strict, the op kept whole through
run_decompositions) and torch.autocast (the rule declared in schema/ops.yaml).
"""
from __future__ import annotations

import pytest
import torch

from circleops.ops import REGISTRY, by_overload

OPS = list(REGISTRY)
LOW = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, *LOW)
CHEAP_OPCHECK = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _with_grad(args):
    return tuple(a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


class _Call(torch.nn.Module):
    """forward(*tensors) = the op with the sample's non-tensor arguments baked in."""

    def __init__(self, op, args, kwargs):
        super().__init__()
        self.op, self.kwargs = op, kwargs
        self.template = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def forward(self, *tensors):
        args = list(self.template)
        for i, t in zip(self.slots, tensors):
            args[i] = t
        return self.op(*args, **self.kwargs)


def _tensors(args):
    return tuple(a for a in args if isinstance(a, torch.Tensor))


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", OPS)
def test_kernel_equals_reference(name, dtype):
    spec = REGISTRY[name]
    for args, kwargs in spec.sample_inputs(dtype):
        got, want = _tuple(spec.op(*args, **kwargs)), _tuple(spec.reference(*args, **kwargs))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), f"circle::{name} {kwargs} in {dtype}: kernel != reference"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(name, dtype):
    # every sample (mixed weight/input dtypes included for fp16/bf16), without grad
    for args, kwargs in REGISTRY[name].sample_inputs(dtype):
        torch.library.opcheck(REGISTRY[name].op, args, kwargs, test_utils=CHEAP_OPCHECK)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", OPS)
def test_opcheck_with_grad(name, dtype):
    # the autograd formula traced through AOT dispatch (dynamic shapes): the first sample
    # in fp32, the last one (mixed weight/input dtypes) in fp16 and bf16
    samples = REGISTRY[name].sample_inputs(dtype)
    args, kwargs = samples[0] if dtype == torch.float32 else samples[-1]
    torch.library.opcheck(REGISTRY[name].op, _with_grad(args), kwargs)


@pytest.mark.parametrize("name", OPS)
def test_gradcheck_fp64(name):
    spec = REGISTRY[name]
    for args, kwargs in spec.sample_inputs(torch.float64)[:2]:
        args = _with_grad(args)
        module = _Call(spec.op, args, kwargs)
        assert torch.autograd.gradcheck(module, _tensors(args), fast_mode=True)


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
def test_export_keeps_the_op_whole(name, strict):
    spec = REGISTRY[name]
    args, kwargs = spec.sample_inputs(torch.float32)[0]
    module = _Call(spec.op, args, kwargs)
    ep = torch.export.export(module, _tensors(args), strict=strict)
    decomposed = ep.run_decompositions()
    for program in (ep, decomposed):
        fused = [n for n in program.graph.nodes if n.op == "call_function" and by_overload(n.target) is spec]
        assert len(fused) == 1, f"circle::{name} must stay one node, got graph:\n{program.graph}"
    for got, want in zip(_tuple(decomposed.module()(*_tensors(args))), _tuple(spec.op(*args, **kwargs))):
        assert torch.equal(got, want)


def _autocast_expected(spec, args, kwargs, autocast_dtype):
    """What the op must return inside autocast(autocast_dtype), per the yaml rule."""
    rule = spec.autocast
    if rule == "none":
        return spec.op(*args, **kwargs)
    target = torch.float32 if rule == "fp32" else autocast_dtype
    cast = tuple(a.to(target) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return spec.op(*cast, **kwargs)


@pytest.mark.parametrize("name", OPS)
def test_autocast_rule(name):
    spec = REGISTRY[name]
    for dtype, autocast_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)):
        for args, kwargs in spec.sample_inputs(dtype):
            expected = _tuple(_autocast_expected(spec, args, kwargs, autocast_dtype))
            with torch.autocast("cpu", dtype=autocast_dtype):
                got = _tuple(spec.op(*args, **kwargs))
            for g, e in zip(got, expected):
                assert g.dtype == e.dtype and torch.equal(g, e), f"{name} {kwargs}: autocast rule {spec.autocast!r} not followed"
    if spec.autocast == "fp32":
        assert got[0].dtype == torch.float32
    elif spec.autocast == "lower_precision":
        assert got[0].dtype == torch.float16


@pytest.mark.parametrize("strict", (False, True), ids=("nonstrict", "strict"))
@pytest.mark.parametrize("name", OPS)
def test_export_under_autocast(name, strict):
    # The exported program carries the autocast casts: run outside autocast, it matches eager inside.
    spec = REGISTRY[name]
    args, kwargs = spec.sample_inputs(torch.float32)[0]
    module = _Call(spec.op, args, kwargs)
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
