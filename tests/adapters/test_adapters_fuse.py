"""circleops.fuse / unfuse: the adapters on one model instance, for good."""
from __future__ import annotations

import torch

import circleops
from adapter_fixtures import built, circle_counts, logits_of
from families import BY_NAME


def _instance_forwards(model: torch.nn.Module) -> int:
    return sum("forward" in m.__dict__ for m in model.modules())


def test_fuse_exports_without_a_with_and_unfuse_restores():
    b = built("qwen3")  # attention stays decomposed: its RoPE must still become circle.rope
    model = BY_NAME["qwen3"].build()
    other = BY_NAME["qwen3"].build()
    cls_forwards = {type(m): type(m).__dict__.get("forward") for m in model.modules()}
    assert circleops.fuse(model) is model
    assert _instance_forwards(other) == 0  # other instances untouched
    ep = torch.export.export(model, (b.ids,))
    assert circle_counts(ep) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert torch.equal(logits_of(ep, b.ids), b.logits)
    circleops.unfuse(model)
    assert _instance_forwards(model) == 0
    assert {type(m): type(m).__dict__.get("forward") for m in model.modules()} == cls_forwards
    assert not circleops.adapters.is_fused(model)


def test_fuse_attention_and_eager_equality():
    b = built("llama")
    model = BY_NAME["llama"].build()
    circleops.fuse(model)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(b.ids).logits, b.logits, rtol=1e-5, atol=1e-5)
        ep = torch.export.export(model, (b.ids,), strict=True)
        assert circle_counts(ep) == {"rms_norm": b.norm_calls, "attention": b.layers}
    finally:
        circleops.unfuse(model)


def test_fuse_attention_false_keeps_attention_decomposed():
    b = built("llama")
    model = circleops.fuse(BY_NAME["llama"].build(), attention=False)
    ep = torch.export.export(model, (b.ids,))
    assert circle_counts(ep) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert torch.equal(logits_of(ep, b.ids), b.logits)
