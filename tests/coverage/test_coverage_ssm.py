"""State-space (Mamba-style) models: their causal depthwise conv1d (groups = channels,
padding k-1, the tail cut off) converts on every target, and tiny Mamba and Mamba2 built
from their configs (bench/zoo.py's tiny_config) match torch on onert. docs/zoo.md once
listed every conv1d model as refused ("non-2D convolution")."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import circleops

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import zoo  # noqa: E402


class CausalConv1d(torch.nn.Module):
    """Mamba's mixer conv: depthwise over [B, C, L], left context only."""

    def __init__(self, channels=8, kernel=4):
        super().__init__()
        self.conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, padding=kernel - 1, bias=True)

    def forward(self, x):
        return torch.nn.functional.silu(self.conv(x)[..., :x.shape[-1]])


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
def test_causal_depthwise_conv1d_converts(target, tmp_path):
    torch.manual_seed(0)
    path = tmp_path / ("m.tflite" if target == "tflite" else "m.circle")
    report = circleops.convert(CausalConv1d().eval(), (torch.randn(1, 8, 6),), path, target=target, verify=True)
    assert report.verify.passed
    assert report.verify.max_abs_error <= 1e-5 * max(1.0, report.verify.reference_max_abs)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_tiny_mamba_matches_torch_on_onert(arch):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    row = zoo.run_one(arch, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    assert row["status"] == "pass", row
    assert row["error"] < zoo.TOLERANCE
