"""A representative dozen of the bench/zoo.py architectures (Hugging Face causal LMs outside
tests/families.py, built from shrunk default configs) convert for onert and match torch;
the MoE ones go through transformers' experts interface, routed to dense dispatch.
The whole zoo (every architecture of the installed transformers) is bench/zoo.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import zoo  # noqa: E402

DENSE = ["gpt2", "opt", "bloom", "falcon", "gpt_neox", "phi", "starcoder2", "cohere"]
MOE = ["olmoe", "phimoe", "glm4_moe", "granitemoeshared"]


@pytest.mark.parametrize("arch", DENSE + MOE)
def test_zoo_architecture_converts_for_onert(arch):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    row = zoo.run_one(arch, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch])
    assert row["status"] == "pass", row
    assert row["error"] < zoo.TOLERANCE
