"""Every family, exported inside its adapters: one circle op per norm / rotation / attention
layer, and the HF model's logits (bit-equal without fused attention)."""
from __future__ import annotations

import warnings

import pytest
import torch

import circleops.adapters as adapters
from adapter_fixtures import ATTENTION_TOL, DTYPES, built, circle_counts, logits_of
from families import BY_NAME, FAMILIES

NAMES = [f.name for f in FAMILIES]
FUSABLE = [f.name for f in FAMILIES if f.attention_fusable]
# what the attention adapter must name when it leaves a family's attention decomposed
WHY_DECOMPOSED = {
    "qwen2": "biases",
    "qwen3": "q/k norms",
    "olmo2": "q/k norms",
    "gemma2": "soft-capping",
    "gemma3": "q/k norms",
}


def _cm(family: str, kind: str):
    return getattr(adapters, f"patched_{family}_{kind}")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", NAMES)
def test_norm_and_rope_adapters_bit_equal(family, dtype):
    b = built(family, dtype)
    with _cm(family, "rmsnorm")(), _cm(family, "rope")():
        ep = torch.export.export(b.model, (b.ids,))
    assert circle_counts(ep) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert torch.equal(logits_of(ep, b.ids), b.logits)


# fp32: every family, strict export, all families' adapters at once (patched_modules);
# bf16/fp16: the families whose attention fuses, non-strict, the family's own adapters
CASES = [(f, "fp32", True) for f in NAMES] + [(f, d, False) for f in FUSABLE for d in ("bf16", "fp16")]


@pytest.mark.parametrize("family,dtype,strict", CASES, ids=[f"{f}-{d}-{'strict' if s else 'nonstrict'}" for f, d, s in CASES])
def test_modules_adapter_attention(family, dtype, strict):
    b = built(family, dtype)
    session = adapters.patched_modules() if strict else _cm(family, "modules")()
    with warnings.catch_warnings():
        warnings.simplefilter("error", adapters.UnusedPatchWarning)  # every patch of the family ran
        with session:
            ep = torch.export.export(b.model, (b.ids,), strict=strict)
    counts = circle_counts(ep)
    assert counts["rms_norm"] == b.norm_calls
    layers = sorted({d.layer for d in session.decisions})
    assert layers == list(range(b.layers))
    if BY_NAME[family].attention_fusable:
        assert counts["attention"] == b.layers and counts["rope"] == 0
        assert all(d.fused for d in session.decisions)
    else:
        assert counts["attention"] == 0 and counts["rope"] == 2 * b.layers
        assert all(not d.fused and WHY_DECOMPOSED[family] in d.reason for d in session.decisions)
    tol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(logits_of(ep, b.ids), b.logits, rtol=tol, atol=tol)


def test_gemma2_decides_sliding_window_per_layer():
    b = built("gemma2")
    with adapters.patched_gemma2_attention() as session:
        b.model(b.ids)
    by_layer = {d.layer: d.reason for d in session.decisions}
    kinds = b.model.config.layer_types
    assert kinds[:2] == ["sliding_attention", "full_attention"]
    assert "sliding-window" in by_layer[0] and "sliding-window" not in by_layer[1]
    assert "soft-capping" in by_layer[1]


@pytest.mark.parametrize("family,variant,reason", [
    ("phi3", "partial_rotary", "partial rotary"),
    ("mistral", "sliding_window", "sliding-window"),
])
def test_config_variants_keep_attention_decomposed(family, variant, reason):
    """Decided per layer from the config: Phi3 with partial rotary, Mistral with a window."""
    b = built(family, "fp32", variant)
    with _cm(family, "modules")() as session:
        ep = torch.export.export(b.model, (b.ids,))
    assert circle_counts(ep) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}
    assert session.decisions and all(reason in d.reason for d in session.decisions)
    assert torch.equal(logits_of(ep, b.ids), b.logits)
