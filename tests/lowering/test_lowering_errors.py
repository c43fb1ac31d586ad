"""Errors a user can cause: each names what is wrong and what to do."""
from __future__ import annotations

import pytest
import torch

from circleops.errors import CircleOpsError, TargetError, UnsupportedOpError
from circleops.lowering import lower_program
from lowering_util import family_program


class Sorts(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.lgamma(y) + 1  # aten.lgamma: no lowering, no decomposition


def test_unsupported_op_names_op_node_source_and_remedy():
    ep = torch.export.export(Sorts(), (torch.randn(2, 5),), strict=False)
    with pytest.raises(UnsupportedOpError) as info:
        lower_program(ep, "onert")
    msg = str(info.value)
    assert "aten.lgamma" in msg  # the op
    assert "'lgamma'" in msg  # the node
    assert __file__ in msg and "torch.lgamma(y)" in msg  # the user's source line
    assert "register a lowering" in msg  # what to do
    assert isinstance(info.value, CircleOpsError)


def test_ops_without_lowering_are_decomposed_locally():
    """aten.var_mean / layer_norm have no lowering of their own: their decompositions are
    traced and lowered inline, so no whole-graph run_decompositions() is needed."""

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.ln(x) + torch.var(x, dim=-1, keepdim=True)

    x = torch.randn(2, 3, 8)
    module = Norms().eval()
    ep = torch.export.export(module, (x,), strict=False)
    model = lower_program(ep, "circle")
    from circleops.runtime import reference

    (got,) = reference.run(model, [x.numpy()])
    torch.testing.assert_close(torch.from_numpy(got), module(x).detach(), atol=1e-5, rtol=1e-5)


def test_onert_refuses_fp16_programs_clearly():
    ep = family_program("llama", "none", torch.float16)
    with pytest.raises(TargetError, match=r"float32 only.*model\.float\(\).*'circle'"):
        lower_program(ep, "onert")


def test_dtype_mismatch_and_unknown_target():
    ep = family_program("llama", "none")
    with pytest.raises(TargetError, match=r"computes in torch.float32 but dtype=torch.float16"):
        lower_program(ep, "circle", dtype=torch.float16)
    assert lower_program(ep, "circle", dtype="float32").subgraphs
    with pytest.raises(TargetError, match="unknown target 'tpu'"):
        lower_program(ep, "tpu")


def test_dynamic_shapes_are_refused():
    class Double(torch.nn.Module):
        def forward(self, x):
            return x * 2

    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(Double(), (torch.randn(3, 4),), dynamic_shapes={"x": {0: batch}}, strict=False)
    with pytest.raises(TargetError, match="dynamic shape.*static"):
        lower_program(ep, "circle")


def test_training_mode_dropout_is_refused():
    class Drop(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    ep = torch.export.export(Drop(), (torch.randn(4),), strict=False)
    with pytest.raises(UnsupportedOpError, match=r"training mode.*model\.eval\(\)"):
        lower_program(ep, "circle")


def test_unexpected_failure_in_a_lowering_is_a_circleops_error(monkeypatch, tmp_path):
    """A bug inside a lowering reaches the user as an InternalError naming the node, its
    op, the source line, asking for a report; the original exception is its __cause__."""
    import circleops
    from circleops.errors import InternalError
    from circleops.lowering import registry

    def broken(ctx, node, x):
        raise KeyError("a lowering bug")

    monkeypatch.setitem(registry.LOWERINGS, torch.ops.aten.sin.default, broken)

    class Sin(torch.nn.Module):
        def forward(self, x):
            return torch.sin(x * 2)

    with pytest.raises(InternalError) as info:
        circleops.convert(Sin(), (torch.randn(3),), tmp_path / "m.circle")
    msg = str(info.value)
    assert "'sin'" in msg and "aten.sin.default" in msg and "KeyError" in msg and "a lowering bug" in msg
    assert __file__ in msg and "torch.sin(x * 2)" in msg
    assert "report" in msg
    assert isinstance(info.value.__cause__, KeyError)
    assert not (tmp_path / "m.circle").exists()


def test_unexpected_failure_after_lowering_is_a_circleops_error(monkeypatch, tmp_path):
    import circleops
    from circleops.errors import InternalError
    from circleops.serialize import writer

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a writer bug")

    monkeypatch.setattr(writer, "write_model", broken)
    with pytest.raises(InternalError, match=r"write stage: ZeroDivisionError: a writer bug.*report") as info:
        circleops.convert(torch.nn.ReLU(), (torch.randn(3),), tmp_path / "m.circle")
    assert isinstance(info.value.__cause__, ZeroDivisionError)
