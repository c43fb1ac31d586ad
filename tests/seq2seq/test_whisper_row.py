"""Whisper is a row of the same encoder-decoder table: the core's decoder step computes
circleops.recipes.speech's prefill and decode graphs (the same inputs and outputs), so the speech
graphs can be exported from it."""
from __future__ import annotations

import copy
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


def test_whisper_row_computes_the_speech_graphs(whisper):
    from circleops.recipes import speech
    from circleops.adapters.seq2seq import CrossFromStates, Seq2SeqDecoderStep

    _, prefill_cls, decode_cls = speech._torch_modules()
    s = speech._shapes(whisper.config, 16)
    g = torch.Generator().manual_seed(0)
    states = torch.randn((1, s.enc_len, s.d_model), generator=g)
    ids = torch.tensor([[50, 51, 52, 53]]) % s.vocab
    step = Seq2SeqDecoderStep(copy.deepcopy(whisper), s.cache_len, source_mask=False)
    with torch.no_grad():
        want = prefill_cls(whisper)(ids, torch.tensor([3]), states)
        got = CrossFromStates(step)(ids, torch.tensor([3]), states)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        cross = list(want[1 + 2 * s.num_layers:])
        caches = [torch.randn((1, s.heads, s.cache_len, s.head_dim), generator=g) for _ in range(2 * s.num_layers)]
        args = (torch.tensor([[7]]), torch.tensor([5]), *caches, *cross)
        for a, b in zip(step(*args), decode_cls(whisper)(*args)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
