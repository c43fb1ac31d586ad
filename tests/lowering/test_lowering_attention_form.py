"""The form of a decomposed attention (target onert: ATTENTION is not runnable there).

A decode step's cost outside the weight products is the work done on the KV caches, so the
decomposition must touch each [B, C, Hkv, D] cache a bounded number of times: one select
to write the new row, one transpose to put it in the layout BATCH_MATMUL reads, and no
per-query-head copies (GQA groups share one product), no gathers, no internal transposes
inside BATCH_MATMUL (its right operand arrives as [..., N, K] with the adjoint flag).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.lowering import lower_program
from circleops.ops.attention import causal_mask
from circleops.serialize import write_model

g = torch.Generator().manual_seed(0)


def _r(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


class Attention(torch.nn.Module):
    def __init__(self, e=32, hq=4, hkv=2, d=8):
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Parameter(_r(h * d, e, scale=e ** -0.5)) for h in (hq, hkv, hkv))
        self.wo = torch.nn.Parameter(_r(e, hq * d, scale=(hq * d) ** -0.5))

    def forward(self, x, cos, sin, mask, k, v, pos):
        return torch.ops.circle.attention(x, self.wq, self.wk, self.wv, self.wo, cos, sin, mask, k, v, pos)


def _inputs(s, pos, c=16, hkv=2, d=8, e=32):
    ang = (pos + torch.arange(s, dtype=torch.float32))[:, None] * _r(1, d // 2).abs()
    ang = torch.cat([ang, ang], -1)
    return (_r(1, s, e), ang.cos(), ang.sin(), causal_mask(s, c, pos), _r(1, c, hkv, d), _r(1, c, hkv, d),
            torch.tensor([pos]))


def _lowered(s, pos, target="onert"):
    module, inputs = Attention().eval(), _inputs(s, pos)
    model = lower_program(torch.export.export(module, inputs, strict=False), target)
    return module, inputs, model


@pytest.mark.parametrize("s,pos", [(1, 5), (3, 0)], ids=["decode", "prefill"])
def test_each_cache_is_copied_once_and_transposed_once(s, pos, tmp_path):
    module, inputs, model = _lowered(s, pos)
    sg = model.subgraphs[0]
    ops = [o.opcode for o in sg.operators]
    assert "BROADCAST_TO" not in ops and "TILE" not in ops  # no kv head repeated per query head
    cache = inputs[4].numel()
    big = sorted(o.opcode for o in sg.operators if np.prod(sg.tensors[o.outputs[0]].shape) >= cache)
    # per cache: the select that writes the new rows, the transpose BATCH_MATMUL reads, the
    # copy of the output that onert needs (ONERT.copy_consumed_outputs), and for a prefill
    # the index_select of the new rows; nothing else the size of a cache
    want = ["SELECT_V2", "TRANSPOSE", "RESHAPE"] + ["GATHER"] * (s > 1)
    assert big == sorted(want * 2), big
    matmuls = [o for o in sg.operators if o.opcode == "BATCH_MATMUL"]
    assert len(matmuls) == 2 and all(o.options.get("adjointRhs") for o in matmuls)
    if s == 1:
        assert "GATHER" not in ops  # a decode step's write is one compare and one select

    path = tmp_path / "attention.circle"
    write_model(model, path, "circle")
    from circleops.runtime import onert

    got = onert.run(path, [np.asarray(i) for i in inputs])
    with torch.no_grad():
        want = module(*inputs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), atol=2e-5, rtol=1e-5)


class QKt(torch.nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b.transpose(-1, -2))


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
def test_matmul_with_a_transposed_right_operand_uses_the_adjoint_flag(target, tmp_path):
    """q·Kᵀ: BATCH_MATMUL(q, K, adjoint) and no TRANSPOSE, on every target's runtime."""
    module = QKt()
    a, b = _r(2, 3, 5, 8), _r(2, 3, 7, 8)
    model = lower_program(torch.export.export(module, (a, b), strict=False), target)
    sg = model.subgraphs[0]
    assert [o.opcode for o in sg.operators] == ["BATCH_MATMUL"]
    fmt = "tflite" if target == "tflite" else "circle"
    path = tmp_path / f"mm.{fmt}"
    write_model(model, path, fmt)
    from circleops.runtime import open_session

    runtime = {"circle": "reference", "onert": "onert", "tflite": "litert"}[target]
    got = open_session(runtime, path).run([a.numpy(), b.numpy()])[0]
    np.testing.assert_allclose(got, (a @ b.transpose(-1, -2)).numpy(), atol=1e-5, rtol=1e-5)
