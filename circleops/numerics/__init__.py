"""fp16/bf16 numerics: norm policies, per-layer outputs, and the report of ``circleops check``."""
from __future__ import annotations

from circleops.numerics.layers import LayerOutputs, decoder_layers
from circleops.numerics.policy import NORM_POLICIES, NormPolicy, norm_policy, rms_norm_nodes, set_norm_policy
from circleops.numerics.report import CheckReport, PolicyResult

__all__ = ["NORM_POLICIES", "NormPolicy", "norm_policy", "rms_norm_nodes", "set_norm_policy",
           "LayerOutputs", "decoder_layers", "CheckReport", "PolicyResult"]
