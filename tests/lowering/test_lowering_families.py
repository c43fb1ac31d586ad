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
