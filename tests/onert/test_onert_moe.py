"""Mixture-of-experts LLMs as transformers 5 writes them (router topk, experts over 3-D
weights) convert for target onert with ``circleops.convert``, match torch within 1e-4,
and keep every RMSNorm as one RMS_NORM: the adapters route the experts to dense dispatch
(static shapes) and the norms to circle.rms_norm."""
from __future__ import annotations

import pytest
import torch

import circleops
from families import MOE_FAMILIES, example_ids
from lowering_util import norm_count


@pytest.mark.parametrize("family", MOE_FAMILIES, ids=lambda f: f.name)
def test_moe_family_converts_for_onert(family, tmp_path):
    model = family.build()
    with torch.no_grad():  # a sharper router: picks far from ties, so the test pins dispatch
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.mul_(10)
    report = circleops.convert(model, (example_ids(),), tmp_path / "m.circle", target="onert", verify=True,
                               tolerance=1e-4)
    assert report.verify.passed and report.verify.max_abs_error < 1e-4, report.verify
    assert report.ops.get("RMS_NORM") == norm_count(model), report.ops
    assert not {"WHERE", "NON_MAX_SUPPRESSION_V4"} & set(report.ops)  # no data-dependent shapes


def test_experts_dense_dispatch_equals_sparse():
    """The dense form (every expert on every token, weighted by the routing) is the eager
    sparse dispatch exactly, up to float summation order."""
    from circleops.adapters._experts import dense_experts

    for family in MOE_FAMILIES:
        model = family.build()
        experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
        g = torch.Generator().manual_seed(0)
        tokens, k = 5, model.config.num_experts_per_tok
        x = torch.randn(tokens, model.config.hidden_size, generator=g)
        index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=g)
        with torch.no_grad():
            sparse = type(experts).forward(experts, x, index, weights)
            dense = dense_experts(experts, x, index, weights)
        torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5, msg=family.name)
