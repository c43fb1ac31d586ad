"""aten lowerings beyond the families' graphs, each run on onert and on the reference
interpreter (target circle) against torch eager."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from circleops.lowering import lower_program
from circleops.runtime import onert, reference
from circleops.serialize import write_model
from lowering_util import family_program, opcodes, reference_logits
from families import example_ids

g = torch.Generator().manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, generator=g)


class Fn(torch.nn.Module):
    def __init__(self, fn, **params):
        super().__init__()
        self.fn = fn
        for k, v in params.items():
            self.register_buffer(k, v)

    def forward(self, *xs):
        return self.fn(self, *xs)


def _regions(m, x):
    with torch.autocast("cpu", enabled=False):  # export wraps these regions in higher-order ops
        y = x * 2
    with torch.no_grad():
        z = y + 1
    return z.sin()


CASES = {
    "no_grad_and_autocast_off_regions": (_regions, (_r(3, 4),), {}),
    "sdpa_causal_gqa": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        (_r(1, 4, 5, 8), _r(1, 2, 5, 8), _r(1, 2, 5, 8)), {}),
    "sdpa_bool_mask": (lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m.mask, scale=0.3),
                       (_r(1, 2, 3, 8), _r(1, 2, 6, 8), _r(1, 2, 6, 8)), {"mask": torch.rand(3, 6, generator=g) > 0.3}),
    "index_two_tensors": (lambda m, x, i, j: (x[i, :, j], x[:, i, j], x[i, j]), (_r(4, 3, 5), torch.tensor([[0], [2]]),
                                                                     torch.tensor([[1, 2, 0]])), {}),
    "index_negative": (lambda m, x, i: x[:, i], (_r(2, 6), torch.tensor([-1, 0, -6])), {}),
    "layer_group_norm_var": (lambda m, x: (F.layer_norm(x, (6,), m.w, m.w) + x.var(-1, keepdim=True),
                                           F.group_norm(x.reshape(2, 4, 3, 2), 2), x.std(0)),
                             (_r(2, 4, 6),), {"w": _r(6)}),
    "cumsum_int_clamp": (lambda m, x: (torch.cumsum(x, 1), x.clamp(min=1, max=4), torch.maximum(x, x.flip(1))),
                         (torch.randint(-3, 8, (2, 5), generator=g),), {}),
    "pool_depthwise_bn": (lambda m, x: F.max_pool2d(F.batch_norm(F.conv2d(x, m.w, groups=4, padding=1), m.mean, m.var,
                                                                m.scale, m.shift), 2)
                          + F.avg_pool2d(x, 2).mean(1, keepdim=True),
                          (_r(1, 4, 6, 6),), {"w": _r(8, 1, 3, 3), "mean": _r(8), "var": torch.rand(8, generator=g) + 0.5,
                                              "scale": _r(8), "shift": _r(8)}),
    "conv_same_padding": (lambda m, x: F.conv2d(x, m.w, padding="same", dilation=(1, 2)) + F.conv2d(x, m.w, padding=1),
                          (_r(1, 2, 5, 6),), {"w": _r(3, 2, 3, 3)}),
    "split_stack_select": (lambda m, x: torch.stack([a.sum(-1) for a in x.split([1, 2, 3], -1)], 0) * x[:, 2, 3, None],
                           (_r(2, 4, 6),), {}),
    # onert: CONV_2D from 4 rows up or for an 8x wider output, else FULLY_CONNECTED (lowering.linalg)
    "linear_conv_or_fc": (lambda m, x, y: (F.linear(x, m.w, m.b), F.linear(x[:3], m.w) * 2, F.linear(y, m.w2),
                                           F.linear(x[:1, :2], m.wide)),
                          (_r(6, 8), _r(1, 5, 4)), {"w": _r(5, 8), "b": _r(5), "w2": _r(7, 4), "wide": _r(16, 2)}),
    # constant all-true / all-false conditions and in-order indices pick a side whole
    "constant_where_and_gather": (lambda m, x, y: (torch.where(m.yes, x, y) * 2, torch.where(m.no, x, y) * 3,
                                                   torch.where(m.some, x, y), x.index_select(1, m.order) * 4,
                                                   x.index_select(1, m.order.flip(0))),
                                  (_r(2, 4), _r(2, 4)),
                                  {"yes": torch.ones(2, 4, dtype=torch.bool), "no": torch.zeros(2, 4, dtype=torch.bool),
                                   "some": torch.rand(2, 4, generator=g) > 0.5, "order": torch.arange(4)}),
    # alpha scales the second operand (lowering.elementwise._times_alpha), a tensor or a constant
    "add_sub_rsub_alpha": (lambda m, x, y: (torch.add(x, y, alpha=0.5), torch.sub(x, m.w, alpha=3),
                                            torch.rsub(x, y, alpha=-2), torch.add(x, 2.0, alpha=0.25)),
                           (_r(2, 4), _r(2, 4)), {"w": _r(4)}),
    # onert's reducers run rank <= 4 only (Mamba2-style hybrids reduce rank-6 tensors):
    # adjacent dims merged, or the reduced ones moved last when they alternate
    "reduce_rank6": (lambda m, x: (x.sum(-1, keepdim=True), x.mean((1, 3)), x.amax((0, 2, 4)), x.sum(),
                                   x.amin(2), (x > 0).any(5)),
                     (_r(2, 2, 3, 3, 2, 4),), {}),
    # onert's BATCH_MATMUL runs rank <= 4: equal batch dims fold into one
    "matmul_rank5": (lambda m, a, b: (a @ b, a @ a.transpose(-1, -2)), (_r(1, 4, 2, 6, 5), _r(1, 4, 2, 5, 3)), {}),
    # onert's comparisons and MAXIMUM/MINIMUM are wrong from rank 5: dims that broadcast alike merge
    "compare_rank5": (lambda m, x, y: (x > y, x <= 0.5, torch.eq(x.round(), y.round()), torch.maximum(x, y),
                                       torch.minimum(x, m.c), x != y[:, :1],
                                       # bailing_hybrid's causal mask at rank 6 (SELECT_V2 is wrong there)
                                       x.unsqueeze(0).masked_fill(m.causal, float("-inf")).exp()),
                      (_r(2, 2, 3, 4, 5), _r(1, 2, 1, 4, 5)),
                      {"c": _r(4, 1), "causal": torch.ones(3, 4, 5, dtype=torch.bool).triu(1)}),
    "softmax_mid_dim_and_where": (lambda m, x: torch.where(x > 0, torch.softmax(x, 1), torch.log_softmax(x, 1) * 0.5),
                                  (_r(2, 3, 4),), {}),
}


@pytest.mark.parametrize("target", ["onert", "circle"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_aten_lowering_matches_torch(name, target, tmp_path):
    fn, inputs, params = CASES[name]
    module = Fn(fn, **params)
    ep = torch.export.export(module, inputs, strict=False)
    model = lower_program(ep, target)
    arrays = [x.numpy() for x in inputs]
    if target == "onert":
        path = tmp_path / f"{name}.circle"
        write_model(model, path, "circle")
        got = onert.run(path, arrays)
    else:
        got = reference.run(model, arrays)
    want = module(*inputs)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.numpy().dtype
        np.testing.assert_allclose(a, b.numpy(), atol=2e-5, rtol=1e-5)


# opcodes the cases above must produce, per target: (opcode, count)
EXPECTED_OPS = {
    ("linear_conv_or_fc", "onert"): {"CONV_2D": 3, "FULLY_CONNECTED": 1},
    ("linear_conv_or_fc", "circle"): {"CONV_2D": 0, "FULLY_CONNECTED": 4},
    ("constant_where_and_gather", "onert"): {"SELECT_V2": 1, "GATHER": 1},
    ("constant_where_and_gather", "circle"): {"SELECT_V2": 1, "GATHER": 1},
}


@pytest.mark.parametrize("name,target", sorted(EXPECTED_OPS))
def test_lowering_picks_the_ops(name, target):
    fn, inputs, params = CASES[name]
    model = lower_program(torch.export.export(Fn(fn, **params), inputs, strict=False), target)
    ops = opcodes(model)
    assert {op: ops.get(op, 0) for op in EXPECTED_OPS[name, target]} == EXPECTED_OPS[name, target], ops


def test_core_aten_programs_lower_too():
    """A program after run_decompositions() (mm, _softmax, permute, _to_copy, ...) lowers
    to the same computation."""
    ep = family_program("qwen3", "all").run_decompositions()
    model = lower_program(ep, "circle")
    assert opcodes(model)["RMS_NORM"] > 0
    (logits,) = reference.run(model, [example_ids().numpy()])
    np.testing.assert_allclose(logits, reference_logits("qwen3").numpy(), atol=1e-4, rtol=0)
