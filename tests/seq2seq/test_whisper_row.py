"""Whisper is a row of the same encoder-decoder table: circleops.recipes.speech's prefill and
decode graphs are the core's modules, and they compute transformers' Whisper decoder: the
prefill's row logits, its cross K/V, and a decode step over the rows it wrote."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "speech"))

from tiny_whisper import save_tiny_whisper  # noqa: E402


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    from transformers import WhisperForConditionalGeneration

    path = save_tiny_whisper(tmp_path_factory.mktemp("whisper") / "w")
    return WhisperForConditionalGeneration.from_pretrained(str(path)).eval()


def test_speech_graphs_compute_transformers_whisper(whisper):
    from circleops.recipes import speech

    _, prefill_of, decode_of = speech._torch_modules()
    s = speech._shapes(whisper.config, 16)
    states = torch.randn((1, s.enc_len, s.d_model), generator=torch.Generator().manual_seed(0))
    ids = [s.vocab - 3, s.vocab - 5, s.vocab - 8, 40]
    with torch.no_grad():
        hf = whisper(encoder_outputs=(states,), decoder_input_ids=torch.tensor([ids + [7]])).logits[0]
        prefill, decode = prefill_of(whisper), decode_of(whisper)
        out = prefill(torch.tensor([ids]), torch.tensor([3]), states)
        n = s.num_layers
        torch.testing.assert_close(out[0][0, 0], hf[3], rtol=1e-5, atol=1e-4)
        caches = [torch.zeros((1, s.heads, s.cache_len, s.head_dim)) for _ in range(2 * n)]
        for cache, row in zip(caches, out[1:1 + 2 * n]):
            cache[:, :, :4] = row
        step = decode(torch.tensor([[7]]), torch.tensor([4]), *caches, *out[1 + 2 * n:])
        torch.testing.assert_close(step[0][0, 0], hf[4], rtol=1e-5, atol=1e-4)
