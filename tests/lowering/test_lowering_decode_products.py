"""A decode step's products with its own new key and value on LiteRT (issue 34).

XNNPACK packs a BATCH_MATMUL's non-constant right operand on every run. The "rows" form of a
one-token step has, beside its two products over the cached keys and values, a product with
its own key (one column) and one with its own value (inner dimension 1): for target tflite
(``TargetProfile.matmul_packs_rhs``) those two are MUL + SUM and MUL, so a layer packs only
the cache operands; a prefill's products (S columns) and other targets keep BATCH_MATMUL.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.lowering import lower_program
from circleops.ops.attention import attend_rows
from circleops.serialize import write_model

H, G, D, C = 2, 3, 8, 16  # kv heads, query heads per kv head, head dim, cache slots


class RowsAttention(torch.nn.Module):
    """attend_rows over head-major caches (k [1, H, C, D], v [1, H, D, C]) as the generation
    graphs read them."""

    def forward(self, q, k, v, k_new, v_new, mask):
        return attend_rows(q, k.transpose(1, 2), v.permute(0, 3, 1, 2), k_new, v_new, mask, D ** -0.5, q.dtype)


def _inputs(s: int, pos: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(s)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    mask = torch.zeros(1, 1, s, C, dtype=dtype).masked_fill(torch.arange(C) >= pos, torch.finfo(dtype).min)
    return r(1, H * G, s, D), r(1, H, C, D), r(1, H, D, C), r(1, s, H, D), r(1, s, H, D), mask


def _ops(s: int, target: str, pos: int = 5, dtype: torch.dtype = torch.float32):
    inputs = _inputs(s, pos, dtype)
    model = lower_program(torch.export.export(RowsAttention(), inputs, strict=False), target)
    return model, inputs, [o.opcode for sg in model.subgraphs for o in sg.operators]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_step_packs_only_the_cache_operands(dtype, tmp_path):
    model, inputs, ops = _ops(1, "tflite", dtype=dtype)
    assert ops.count("BATCH_MATMUL") == 2, ops  # q·Kᵀ over the cache, p·V over the cache
    assert ops.count("SUM") == 1 and ops.count("MUL") >= 2, ops  # q·k_new as MUL + SUM, p·v_new as MUL
    path = tmp_path / "rows.tflite"
    write_model(model, path, "tflite")
    from circleops.runtime import litert

    got = litert.run(path, [np.asarray(x) for x in inputs])[0].astype(np.float32)
    with torch.no_grad():
        want = RowsAttention()(*inputs).float().numpy()
    # another summation order over D = 8 terms of |q·k| ~ 3, then a softmax and the weighted
    # values (|out| <~ 4): 16 units in the last place at 4 of the dtype (fp16 graphs compute
    # the new products in fp32 and round once, as torch's fp16 matmul): far below any error
    # in what is multiplied or summed (O(1))
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * 4 * float(torch.finfo(dtype).eps))


@pytest.mark.parametrize("s,target,matmuls", [(4, "tflite", 4), (1, "onert", 4)],
                         ids=["tflite-prefill", "onert-decode"])
def test_other_products_stay_batch_matmul(s, target, matmuls):
    """A prefill's own-token products have S columns (packing them is amortized; an
    elementwise form would write [S, S, D]); onert runs its BATCH_MATMUL without packing."""
    _, _, ops = _ops(s, target, pos=0 if s > 1 else 5)
    assert ops.count("BATCH_MATMUL") == matmuls and "SUM" not in ops, ops
