"""Every family's small random model, lowered for target onert, runs in onert and matches
torch; with the adapters, RMS_NORM is there once per norm module."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.lowering import lower_program
from circleops.runtime import onert
from circleops.serialize import write_model
from families import FAMILIES, example_ids
from lowering_util import family_model, lowered, norm_count, opcodes, reference_logits

ATOL = 1e-4


# "none": the plain HF graph (every norm decomposed); "all": the adapters' circle ops
# (rms_norm, rope, and attention where the family's layer is fusable)
@pytest.mark.parametrize("fused", ["none", "all"])
@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_family_runs_in_onert(family, fused, tmp_path):
    model = lowered(family, fused, "onert")
    ops = opcodes(model)
    # onert runs none of these: they must never reach a file for target onert
    assert not {"ATTENTION", "INSTANCE_NORM", "STABLEHLO_COMPOSITE"} & set(ops), ops
    assert all(t.dtype != "FLOAT16" for t in model.subgraphs[0].tensors)
    # 8 rows: every projection is a 1x1 CONV_2D, onert's faster matrix product
    assert ops["CONV_2D"] > 0 and "FULLY_CONNECTED" not in ops, ops
    if fused == "none":
        assert "RMS_NORM" not in ops
    else:
        assert ops["RMS_NORM"] == norm_count(family_model(family)), ops
        assert "ROPE" not in ops  # S = 8: onert's ROPE is right for one position only
    path = tmp_path / f"{family}.circle"
    write_model(model, path, "circle")
    (logits,) = onert.run(path, [example_ids().numpy()])
    expected = reference_logits(family).numpy()
    assert logits.shape == expected.shape
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_step_uses_rope_builtin(family, tmp_path):
    """One token at position 5: onert's ROPE is exact for S == 1, so target onert writes it."""
    import torch

    from circleops.adapters import patched_modules
    from lowering_util import DecodeStep

    model = family_model(family)
    ids, pos = torch.tensor([[7]]), torch.tensor([[5]])
    with patched_modules(attention=False):
        ep = torch.export.export(DecodeStep(model), (ids, pos), strict=False)
    ir_model = lower_program(ep, "onert")
    layers = model.config.num_hidden_layers
    assert opcodes(ir_model)["ROPE"] == 2 * layers  # q and k of every layer
    assert "CONV_2D" not in opcodes(ir_model)  # one row, lm_head 4x wider: FULLY_CONNECTED is faster
    path = tmp_path / "decode.circle"
    write_model(ir_model, path, "circle")
    (logits,) = onert.run(path, [ids.numpy(), pos.numpy()])
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=0)


def test_explicit_cache_decode_step_runs_in_onert(tmp_path):
    """adapters.decode.DecoderWithCache (the generation graph): one token over ONE-layout
    caches; logits and the updated caches match torch, RoPE runs as onert's ROPE."""
    import torch

    from circleops.adapters.decode import DecoderWithCache
    from families import BY_NAME

    dec = DecoderWithCache(BY_NAME["llama"].build(), max_len=12).eval()  # fuses its model in place: a fresh one
    g = torch.Generator().manual_seed(3)
    ids, pos = torch.tensor([[11]]), torch.tensor([4])
    caches = [torch.randn(dec.cache_shape, generator=g) for _ in range(2 * dec.num_layers)]
    ep = torch.export.export(dec, (ids, pos, *caches), strict=False)
    model = lower_program(ep, "onert")
    assert opcodes(model)["ROPE"] == 2 * dec.num_layers and "ATTENTION" not in opcodes(model)
    path = tmp_path / "decode.circle"
    write_model(model, path, "circle")
    got = onert.run(path, [ids.numpy(), pos.numpy(), *[c.numpy() for c in caches]])
    with torch.no_grad():
        want = dec(ids, pos, *[c.clone() for c in caches])
    assert len(got) == len(want) == 1 + 2 * dec.num_layers
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), atol=ATOL, rtol=0)
