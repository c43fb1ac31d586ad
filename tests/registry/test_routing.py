"""circleops.patch_module / patch_function: route a user's module class (or a function) to
their op during export, restored on exit, with the "never exercised" warning."""
from __future__ import annotations

import warnings

import pytest
import torch

import circleops
from circleops.adapters import UnusedPatchWarning


@circleops.op("routing::double(Tensor x) -> Tensor")
def double(x):
    return x * 2


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x + x


def routed(self, x):
    return torch.ops.routing.double(x)


def _targets(ep):
    return [n.target for n in ep.graph.nodes if n.op == "call_function"]


def test_patch_module_routes_the_class_during_export_and_restores_it():
    original = Doubler.forward
    model = torch.nn.Sequential(Doubler(), torch.nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPatchWarning)
        with circleops.patch_module(Doubler, routed):
            assert Doubler.forward is not original
            ep = torch.export.export(model, (torch.randn(3),))
    assert Doubler.forward is original
    assert double.overload in _targets(ep) and torch.ops.aten.add.Tensor not in _targets(ep)
    assert _targets(torch.export.export(model, (torch.randn(3),))).count(double.overload) == 0


def test_strict_export_counts_the_patch_as_used():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPatchWarning)
        with circleops.patch_module(Doubler, routed):
            ep = torch.export.export(Doubler(), (torch.randn(3),), strict=True)
    assert double.overload in _targets(ep)


def test_a_patch_never_exercised_is_reported():
    model = Doubler()
    with pytest.warns(UnusedPatchWarning, match=r"test_routing\.Doubler\.forward") as seen:
        with circleops.patch_module(Doubler, routed):
            pass
    torch.export.export(model, (torch.randn(3),))
    # the session's name is a call already: once "()", not "patch_module(Doubler)(): ..."
    assert str(seen[0].message).startswith("patch_module(Doubler): these patched classes/functions never ran")
    with pytest.warns(UnusedPatchWarning) as seen:
        with circleops.patch_modules({Doubler: routed}):
            pass
    assert str(seen[0].message).startswith("patch_modules(): these patched")


def test_restored_on_an_exception_and_nests():
    original = Doubler.forward
    with pytest.raises(RuntimeError, match="boom"):
        with circleops.patch_module(Doubler, routed):
            raise RuntimeError("boom")
    assert Doubler.forward is original

    def triple(self, x):
        return x * 3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnusedPatchWarning)
        with circleops.patch_module(Doubler, routed):
            with circleops.patch_module(Doubler, triple):
                assert torch.equal(Doubler()(torch.ones(1)), torch.full((1,), 3.0))
            assert torch.equal(Doubler()(torch.ones(1)), torch.full((1,), 2.0))
    assert Doubler.forward is original


def test_patch_function_routes_a_function():
    import torch.nn.functional as F

    original = F.silu
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPatchWarning)
        with circleops.patch_function(F, "silu", lambda x, inplace=False: torch.ops.routing.double(x)):
            ep = torch.export.export(torch.nn.SiLU(), (torch.randn(3),))
    assert F.silu is original and double.overload in _targets(ep)


def test_bad_targets_are_clear():
    with pytest.raises(TypeError, match="expected a class"):
        circleops.patch_module(Doubler(), routed)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        circleops.patch_function(Doubler, "nope", routed)
