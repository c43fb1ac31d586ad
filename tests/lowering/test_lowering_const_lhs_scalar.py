"""A matmul whose left operand is a constant, 0-d graph inputs, and integer / boolean
selects: files onert loads and runs (it refuses a constant BATCH_MATMUL left operand and
rank-0 inputs, and selects float32 only), right on every target."""
from __future__ import annotations

import pytest
import torch

import circleops

g = torch.Generator().manual_seed(0)


class Fn(torch.nn.Module):
    def __init__(self, fn, **buffers):
        super().__init__()
        self.fn = fn
        for k, v in buffers.items():
            self.register_buffer(k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


CASES = {
    "const_lhs_2d": (lambda m, x: m.a @ x, (torch.randn(4, 3, generator=g),), {"a": torch.randn(5, 4, generator=g)}),
    "const_lhs_batched": (lambda m, x: m.a @ x, (torch.randn(2, 4, 3, generator=g),),
                          {"a": torch.randn(2, 5, 4, generator=g)}),
    "const_lhs_broadcast": (lambda m, x: torch.matmul(m.a, x), (torch.randn(2, 4, 3, generator=g),),
                            {"a": torch.randn(5, 4, generator=g)}),
    "const_vector_lhs": (lambda m, x: m.v @ x, (torch.randn(4, 3, generator=g),), {"v": torch.randn(4, generator=g)}),
    "scalar_input": (lambda m, x, s: (x * s + s, (x * s).sum()), (torch.randn(2, 3, generator=g), torch.tensor(1.5)), {}),
    "only_scalar_input": (lambda m, s: (s * 2).exp(), (torch.tensor(0.5),), {}),
    "integer_and_mask_select": (lambda m, c, i: (torch.where(c, i, -i), i.masked_fill(c, 7), torch.where(c, c, ~c),
                                                 torch.where(c, i.int(), 3)),
                                (torch.tensor([True, False, True, False]), torch.tensor([5, -2, 70000, 1])), {}),
}


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
@pytest.mark.parametrize("name", list(CASES))
def test_const_lhs_matmul_and_scalar_inputs(name, target, tmp_path):
    fn, args, buffers = CASES[name]
    path = tmp_path / ("m.tflite" if target == "tflite" else "m.circle")
    report = circleops.convert(Fn(fn, **buffers), args, path, target=target, verify=True)
    assert report.verify.passed and report.verify.max_abs_error < 1e-5
    if name.startswith("const"):
        assert report.ops.get("BATCH_MATMUL", 0) <= 1
