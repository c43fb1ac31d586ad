"""Shared fixtures for the numerics report tests: a tiny random Llama (tests/families.py)
and the same model with its norm inputs pushed past fp16's square range."""
from __future__ import annotations

import pytest
import torch

from families import BY_NAME

NEW_TOKENS = 6
# Embeddings x 2500 (std 0.2, tests/families.py) give the tiny Llama's residual stream an
# RMS of ~500 (max |x| ~1500): fp16 x² overflows there (|x| >= 256), as in SmolLM2's middle
# layers (RMS > 900).
LOUD = 2500.0


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    return BY_NAME["llama"].build()


@pytest.fixture(scope="session")
def loud_llama() -> torch.nn.Module:
    model = BY_NAME["llama"].build()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(LOUD)
    return model


@pytest.fixture(scope="session")
def loud_report(loud_llama, tmp_path_factory):
    """check() on the loud model, every policy, the .circle files kept."""
    from circleops.tools.precision import check

    return check(loud_llama, None, new_tokens=NEW_TOKENS, work_dir=tmp_path_factory.mktemp("loud"))
