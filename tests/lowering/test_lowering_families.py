"""The families with the adapters' circle ops, for target circle (every fused op as its
builtin; checked with the reference interpreter) and tflite (composites; run in LiteRT)."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.runtime import reference
from circleops.serialize import write_model
from families import FAMILIES, example_ids
from lowering_util import family_model, lowered, norm_count, opcodes, reference_logits


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_circle_target_writes_every_fused_op_as_its_builtin(family):
    model = lowered(family.name, "all", "circle")
    ops = opcodes(model)
    hf = family_model(family.name)
    layers = hf.config.num_hidden_layers
    assert ops["RMS_NORM"] == norm_count(hf), ops
    if family.attention_fusable:
        # ATTENTION takes the whole layer: projections, RoPE, cache, softmax, output
        assert ops["ATTENTION"] == layers and "ROPE" not in ops and "SOFTMAX" not in ops, ops
    else:
        assert ops["ROPE"] == 2 * layers and "ATTENTION" not in ops, ops
    assert len(model.subgraphs) == 1
    (logits,) = reference.run(model, [example_ids().numpy()])
    np.testing.assert_allclose(logits, reference_logits(family.name).numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tflite_target_runs_in_litert(family, tmp_path):
    from circleops.runtime import litert

    model = lowered(family, "all", "tflite")
    ops = opcodes(model)
    composites = [op for op in model.subgraphs[0].operators if op.opcode == "STABLEHLO_COMPOSITE"]
    names = {op.options["name"] for op in composites}
    assert "odml.rms_norm" in names and not {"RMS_NORM", "ROPE", "ATTENTION"} & set(ops)
    assert len(model.subgraphs) == 1 + len(composites)  # one decomposition per composite
    path = tmp_path / f"{family}.tflite"
    write_model(model, path, "tflite")
    (logits,) = litert.run(path, [example_ids().numpy()])
    np.testing.assert_allclose(logits, reference_logits(family).numpy(), atol=1e-4, rtol=0)


def test_explicit_cache_decode_step_on_circle():
    """The generation graph for target circle: one ATTENTION per layer over the caches
    (updated in place, as ONE's kernel does), checked with the reference interpreter."""
    import torch

    from circleops.adapters.decode import DecoderWithCache
    from circleops.lowering import lower_program
    from families import BY_NAME

    dec = DecoderWithCache(BY_NAME["mistral"].build(), max_len=12).eval()
    g = torch.Generator().manual_seed(4)
    ids, pos = torch.tensor([[9, 3]]), torch.tensor([5])
    caches = [torch.randn(dec.cache_shape, generator=g) for _ in range(2 * dec.num_layers)]
    model = lower_program(torch.export.export(dec, (ids, pos, *caches), strict=False), "circle")
    ops = opcodes(model)
    assert ops["ATTENTION"] == dec.num_layers and ops["RMS_NORM"] == 2 * dec.num_layers + 1
    got = reference.run(model, [ids.numpy(), pos.numpy(), *[c.numpy().copy() for c in caches]])
    with torch.no_grad():
        want = dec(ids, pos, *[c.clone() for c in caches])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), atol=1e-4, rtol=0)
