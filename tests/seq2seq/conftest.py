import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_seq2seq import FAMILIES, save_tiny  # noqa: E402


@pytest.fixture(scope="module", params=FAMILIES)
def tiny_seq2seq(request, tmp_path_factory):
    """A tiny random model of each text encoder-decoder family, saved with its tokenizer."""
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "model", seed=2)
