"""An inline attention's RoPE of q and k as one rotation on target tflite (issue 34).

circleops.lowering.attention_rope: q and k concatenated and rotated once, rotate_half a product
with a constant signed permutation, a power-of-two scaling folded into q. Fewer ops per layer
than rotating q and k apart (7 ops each: two slices, NEG, CONCAT, two MULs, ADD) and scaling
both score parts, and the same bits out of LiteRT: every changed step is exact in fp32.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from circleops.lowering import lower_program
from circleops.lowering.attention_rope import joint_rope, power_of_two, rotate_half_matrix
from circleops.ops import rope
from circleops.ops.attention import causal_mask
from circleops.pipeline.stages import inline_fused_ops
from circleops.serialize import write_model
from circleops.targets import PROFILES

E, HQ, HKV, C = 32, 6, 2, 16  # GQA 3 query heads per kv head, as SmolLM2 (9 / 3)


class Attention(torch.nn.Module):
    """One circle.attention of the "rows" form (the generation graphs' decode and prefill)."""

    def __init__(self, d: int):
        super().__init__()
        g = torch.Generator().manual_seed(d)
        r = lambda *shape: torch.randn(*shape, generator=g) * shape[-1] ** -0.5  # noqa: E731
        self.wq, self.wk, self.wv = (torch.nn.Parameter(r(h * d, E)) for h in (HQ, HKV, HKV))
        self.wo = torch.nn.Parameter(r(E, HQ * d))

    def forward(self, x, cos, sin, mask, k, v, pos):
        return torch.ops.circle.attention(x, self.wq, self.wk, self.wv, self.wo, cos, sin, mask, k, v, pos,
                                          cache_update="rows")


def _inputs(s: int, pos: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * s + d)
    ang = (pos + torch.arange(s, dtype=torch.float32))[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))
    ang = torch.cat([ang, ang], -1)
    return (torch.randn(1, s, E, generator=g), ang.cos(), ang.sin(), causal_mask(s, C, pos, cache_update="rows"),
            torch.randn(1, C, HKV, d, generator=g), torch.randn(1, C, HKV, d, generator=g), torch.tensor([pos]))


def _lowered(module: torch.nn.Module, inputs: tuple, joint: bool):
    ep = torch.export.export(module, inputs, strict=False)
    assert inline_fused_ops(ep, {"attention"}) == 1  # as the tflite generation graphs write it
    profile = dataclasses.replace(PROFILES["tflite"], attention_joint_rope=joint)
    return lower_program(ep, profile)


def _scalar_muls(model, value: float) -> int:
    """MULs by a scalar constant equal to ``value`` (the scores' scaling)."""
    sg = model.subgraphs[0]

    def is_value(i):
        t = sg.tensors[i]
        return (t.data is not None and int(np.prod(t.shape)) == 1
                and float(np.asarray(t.data).reshape(-1)[0]) == float(np.float32(value)))
    return sum(1 for o in sg.operators if o.opcode == "MUL" and any(is_value(i) for i in o.inputs if i >= 0))


@pytest.mark.parametrize("d", [16, 8], ids=["scale-power-of-two", "scale-other"])
@pytest.mark.parametrize("s,pos", [(1, 5), (3, 2)], ids=["decode", "prefill"])
def test_joint_rope_is_fewer_ops_and_the_same_bits(s, pos, d, tmp_path):
    from circleops.runtime import litert

    module, inputs = Attention(d).eval(), _inputs(s, pos, d)
    joint, apart = _lowered(module, inputs, True), _lowered(module, inputs, False)
    ops_joint = Counter(o.opcode for o in joint.subgraphs[0].operators)
    ops_apart = Counter(o.opcode for o in apart.subgraphs[0].operators)
    assert ops_apart["NEG"] == 2 and ops_joint["NEG"] == 0, (ops_joint, ops_apart)  # no rotate_half slices
    sg = joint.subgraphs[0]
    rotations = [o for o in sg.operators if o.opcode == "BATCH_MATMUL" and sg.tensors[o.inputs[1]].data is not None]
    assert len(rotations) == 1  # q and k together, by a constant (packed once by XNNPACK)
    scaling = d ** -0.5
    folded = power_of_two(scaling)
    assert folded == (d == 16)
    # decode: the scores over the cache and the own key's are scaled apart (two MULs); a
    # power-of-two scaling is folded into q's rows instead (one MUL by a per-head constant)
    assert _scalar_muls(apart, scaling) == 2 and _scalar_muls(joint, scaling) == (0 if folded else 2)
    work = lambda ops: sum(n for op, n in ops.items() if op != "RESHAPE")  # noqa: E731 (XNNPACK runs a RESHAPE in place)
    assert work(ops_joint) <= work(ops_apart) - (8 if folded else 7), (ops_joint, ops_apart)

    got = []
    for name, model in (("joint", joint), ("apart", apart)):
        path = tmp_path / f"{name}.tflite"
        write_model(model, path, "tflite")
        got.append(litert.run(path, [np.asarray(i) for i in inputs]))
    for a, b in zip(*got):  # out, k_new, v_new: every changed step is exact, so the bits agree
        assert a.shape == b.shape and np.array_equal(a, b), float(np.abs(a - b).max())
    with torch.no_grad():
        want = module(*inputs)
    for a, b in zip(got[0], want):
        # fp32 against torch's own order of the same sums (D and E terms of magnitude ~1, a
        # softmax in between): a few units in the last place of values ~1
        np.testing.assert_allclose(a, b.numpy(), rtol=0, atol=64 * float(np.finfo(np.float32).eps))


def test_rotate_half_matrix_is_rotate_half_exactly():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(1)) * 1e3
    want = torch.cat((-x[..., 32:], x[..., :32]), -1)
    assert torch.equal(x @ rotate_half_matrix(64, torch.float32)[0], want)


def test_joint_rope_equals_rope_of_each():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 6, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    ang = torch.arange(3, dtype=torch.float32)[:, None] * torch.rand(1, 8, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    q2, k2, scaling = joint_rope(q, k, cos, sin, 0.25)
    assert scaling == 1.0  # folded into q
    assert torch.equal(q2, rope.reference(q, cos, sin, "gpt_neox") * 0.25)
    assert torch.equal(k2, rope.reference(k, cos, sin, "gpt_neox"))
    q3, _, kept = joint_rope(q, k, cos, sin, 0.3)  # not a power of two: left on the scores
    assert kept == 0.3 and torch.equal(q3, rope.reference(q, cos, sin, "gpt_neox"))
    # partial rotary (the first 8 of 16 channels): rotated apart, as circle::rope does
    q4, k4, kept = joint_rope(q, k, cos[:, :8], sin[:, :8], 0.25)
    assert kept == 0.25 and torch.equal(q4, rope.reference(q, cos[:, :8], sin[:, :8], "gpt_neox"))
    assert torch.equal(k4, rope.reference(k, cos[:, :8], sin[:, :8], "gpt_neox"))


@pytest.mark.parametrize("x,want", [(0.125, True), (0.25, True), (1.0, True), (2.0 ** -20, True),
                                    (64 ** -0.5, True), (128 ** -0.5, False), (0.3, False), (0.0, False), (-0.5, False)])
def test_power_of_two(x, want):
    assert power_of_two(x) is want
