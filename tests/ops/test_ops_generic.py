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


# Ops whose module has a separate eager kernel: for the others the eager op IS the reference
# kernel, and comparing the two would compare a function with itself.
WITH_KERNEL = [name for name in OPS if hasattr(REGISTRY[name].module, "kernel")]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", WITH_KERNEL)
def test_kernel_equals_reference(name, dtype):
    spec = REGISTRY[name]
    for args, kwargs in spec.sample_inputs(dtype):
        got, want = _tuple(spec.op(*args, **kwargs)), _tuple(spec.reference(*args, **kwargs))
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), f"circle::{name} {kwargs} in {dtype}: kernel != reference"


# ----------------------------------------------------------------- independent float64 oracles
# Each op's documented semantics written again the plain way, in float64, sharing no code with
# circleops.ops: the op (kernel and reference alike) must match it at its dtype's precision.

def _oracle_rope(x, cos, sin, mode="gpt_neox"):
    x = x.double()
    cos, sin = cos.double(), sin.double()
    cos = cos[None, None] if cos.dim() == 2 else cos[:, None] if cos.dim() == 3 else cos
    sin = sin[None, None] if sin.dim() == 2 else sin[:, None] if sin.dim() == 3 else sin
    r = cos.shape[-1]
    out = x.clone()
    pairs = [(i, i + r // 2) for i in range(r // 2)] if mode == "gpt_neox" else [(i, i + 1) for i in range(0, r, 2)]
    for a, b in pairs:  # each pair (a, b) turns by its angle: a' = a cos - b sin, b' = b cos + a sin
        out[..., a] = x[..., a] * cos[..., a] - x[..., b] * sin[..., a]
        out[..., b] = x[..., b] * cos[..., b] + x[..., a] * sin[..., b]
    return out


def _oracle_rms_norm(x, weight=None, eps=1e-6, offset=0.0, multiply="input_dtype", policy="fp32"):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())


def _oracle_instance_norm(x, weight=None, bias=None, eps=1e-5):
    return torch.nn.functional.instance_norm(x.double(), weight=None if weight is None else weight.double(),
                                             bias=None if bias is None else bias.double(), eps=eps)


def _oracle_attention(x, wq, wk, wv, wo, cos, sin, mask, k_cache, v_cache, pos, scale=0.0, cache_update="full"):
    """Head by head, slot by slot: the ATTENTION contract of circleops/ops/attention.py."""
    x, wq, wk, wv, wo = (t.double() for t in (x, wq, wk, wv, wo))
    b, s, _ = x.shape
    c, hkv, d = k_cache.shape[1:]
    hq, p = wq.shape[0] // d, int(pos.reshape(-1)[0])
    m = mask.double()
    m = m.expand(b, s, c) if m.dim() == 2 else m[:, 0] if m.dim() == 4 else m
    m = m.expand(b, s, c)
    rot = lambda t: _oracle_rope(t.transpose(1, 2), cos, sin).transpose(1, 2)  # [B, S, H, D]
    q = rot((x @ wq.T).view(b, s, hq, d))
    k = rot((x @ wk.T).view(b, s, hkv, d))
    v = (x @ wv.T).view(b, s, hkv, d)
    k_new, v_new = k.to(k_cache.dtype), v.to(v_cache.dtype)  # what the cache stores
    if cache_update == "rows":
        keys = torch.cat((k_cache.double(), k_new.double()), 1)  # the C slots, then the S new rows
        values = torch.cat((v_cache.double(), v_new.double()), 1)
        own = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
        m = torch.cat((m, own.expand(b, s, s)), -1)
    else:
        keys, values = k_cache.double().clone(), v_cache.double().clone()
        for i in range(s):
            if p + i < c:
                keys[:, p + i], values[:, p + i] = k_new[:, i].double(), v_new[:, i].double()
    scaling = scale if scale != 0.0 else d ** -0.5
    out = torch.zeros(b, s, hq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = q[:, :, h] @ keys[:, :, kv].transpose(1, 2) * scaling + m  # [B, S, slots]
        out[:, :, h] = torch.softmax(scores, -1) @ values[:, :, kv]
    y = out.reshape(b, s, hq * d) @ wo.T
    if cache_update == "rows":
        return y, k_new, v_new
    return y, keys, values


ORACLES = {"rope": _oracle_rope, "rms_norm": _oracle_rms_norm, "instance_norm": _oracle_instance_norm,
           "attention": _oracle_attention}
# max |op - oracle| <= ORACLE_RTOL[dtype] x max(1, max|oracle|): a few roundings at the dtype's precision
ORACLE_RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def test_every_op_has_an_oracle():
    assert set(ORACLES) == set(OPS), "a new op needs a float64 oracle in ORACLES"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("name", OPS)
def test_op_matches_its_float64_oracle(name, dtype):
    spec = REGISTRY[name]
    for args, kwargs in spec.sample_inputs(dtype):
        got, want = _tuple(spec.op(*args, **kwargs)), _tuple(ORACLES[name](*args, **kwargs))
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, f"circle::{name} {kwargs} in {dtype} output {i}: {list(g.shape)} vs {list(w.shape)}"
            err = float((g.double() - w.double()).abs().max())
            tol = ORACLE_RTOL[dtype] * max(1.0, float(w.double().abs().max()))
            assert err <= tol, f"circle::{name} {kwargs} in {dtype} output {i}: off the oracle by {err:.3g} > {tol:.3g}"


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
