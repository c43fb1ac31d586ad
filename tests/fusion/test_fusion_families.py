"""Pattern fusion on every family exported without adapters: the same circle ops the
adapters give, bit-equal logits, and a report of what stayed decomposed and why."""
from __future__ import annotations

import pytest
import torch

import circleops.adapters as adapters
from adapter_fixtures import built, circle_counts, logits_of
from circleops.passes.fusion import fuse_patterns
from families import FAMILIES

CASES = ([(f.name, "fp32", "") for f in FAMILIES]
         + [(f, "fp16", "") for f in ("llama", "olmo2", "gemma")]  # the three norm styles, upcast
         + [("phi3", "fp32", "partial_rotary")])


@pytest.mark.parametrize("family,dtype,variant", CASES, ids=["-".join(filter(None, c)) for c in CASES])
def test_fuse_patterns_matches_the_adapters(family, dtype, variant):
    b = built(family, dtype, variant)
    ep = torch.export.export(b.model, (b.ids,))
    fused, report = fuse_patterns(ep)
    assert not circle_counts(ep)  # the input program is left as it was
    assert circle_counts(fused) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert report.count("rms_norm") == b.norm_calls and report.count("rope") == 2 * b.layers
    assert not any(n.target == torch.ops.aten.rsqrt.default for n in fused.graph.nodes)
    assert torch.equal(logits_of(fused, b.ids), b.logits)
    attention = [e for e in report.left if e.kind == "attention"]
    assert len(attention) == b.layers and all("left decomposed" in e.detail for e in attention)
    assert not [e for e in report.left if e.kind != "attention"]


def test_fuse_patterns_after_run_decompositions_and_strict():
    b = built("gemma", "fp16")
    ep = torch.export.export(b.model, (b.ids,), strict=True).run_decompositions()
    fused, report = fuse_patterns(ep)
    assert circle_counts(fused) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert "offset=1.0, multiply=fp32" in str(report)
    assert torch.equal(logits_of(fused, b.ids), b.logits)


def test_report_explains_attention_the_adapter_left():
    b = built("qwen2")
    with adapters.patched_qwen2_modules():
        ep = torch.export.export(b.model, (b.ids,))
    fused, report = fuse_patterns(ep)
    assert report.count("rms_norm", new_only=True) == 0 and report.count("rms_norm") == b.norm_calls
    assert circle_counts(fused) == circle_counts(ep)
    left = [e for e in report.left if e.kind == "attention"]
    assert [e.where for e in left] == [f"model.layers.{i}.self_attn (Qwen2Attention)" for i in range(b.layers)]
    assert all("biases on q_proj, k_proj, v_proj" in e.detail for e in left)
    _, with_model = fuse_patterns(ep, model=b.model)
    assert [e.detail for e in with_model.left] == [e.detail for e in left]


def test_report_counts_fused_attention():
    b = built("llama")
    with adapters.patched_llama_modules():
        ep = torch.export.export(b.model, (b.ids,))
    _, report = fuse_patterns(ep)
    assert report.count("attention") == b.layers and not report.left
