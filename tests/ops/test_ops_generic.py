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
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


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
