"""The pattern pass keeps the ExportedProgram's signature valid for any placeholder name:
``forward(self, input)`` (torch's own convention, and what nn.Sequential's forward is called
with) converts on every target, fused or not."""
from __future__ import annotations

import pytest
import torch

import circleops
from circleops.passes.fold import fold_constants
from circleops.passes.fusion import fuse_patterns

g = torch.Generator().manual_seed(0)


class InputNamed(torch.nn.Module):
    """A module whose forward argument is named like the builtin ``input``."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, generator=g))

    def forward(self, input):  # noqa: A002 (the name is the point)
        return torch.relu(input * self.w) + input.sum(-1, keepdim=True)


class InputNamedRms(torch.nn.Module):
    """``input`` flowing into a decomposed RMSNorm, which the pass does fuse."""

    def forward(self, input):  # noqa: A002
        h = input.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(input.dtype)


MODELS = {
    "sequential": lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
    "forward_input": InputNamed,
    "forward_input_fused": InputNamedRms,
}


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
@pytest.mark.parametrize("name", list(MODELS))
def test_input_named_models_convert_and_match_torch(name, target, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(2, 3, 4, generator=g)
    path = tmp_path / ("m.tflite" if target == "tflite" else "m.circle")
    report = circleops.convert(model, (x,), path, target=target, verify=True)
    assert report.verify.passed and report.verify.max_abs_error < 1e-5
    assert [name for name, _, _ in report.inputs] == ["input"]
    if name == "forward_input_fused":
        assert report.fused == {"rms_norm": 1}


def test_passes_keep_placeholder_names():
    ep = torch.export.export(InputNamedRms(), (torch.randn(2, 4),), strict=False)
    fused, report = fuse_patterns(ep)
    assert report.count("rms_norm") == 1
    for prog in (fused, fold_constants(ep)):
        names = [n.name for n in prog.graph.nodes if n.op == "placeholder"]
        assert names == [s.arg.name for s in prog.graph_signature.input_specs] == ["input"]
        x = torch.randn(2, 4, generator=g)
        torch.testing.assert_close(prog.module()(x), ep.module()(x))
