"""circleops' encoder-decoder step modules (circleops.adapters.seq2seq) against transformers:
greedy decoding through the encoder, prefill-chunk and decode modules gives generate's tokens
and logits (within 1e-4) for T5 (v1 tied, v1.1 gated-gelu untied), BART, mBART (forced BOS)
and Marian. The graphs written from them run on every runtime in test_text2text.py."""
from __future__ import annotations

import copy

import pytest
import torch

from tiny_seq2seq import Steps, greedy

NEW = 16
# fp32 through ~10 matmul/softmax layers in a different order than transformers' (q scaled
# before the product, a padded source, chunked prefill): a few ulps of |logits| ~ 10 per step
LOGIT_TOL = 1e-4


def _hf(tiny, ids, new, prefix=None):
    # the step modules' loop applies no decoding rules: the saved ones off (test_text2text applies them)
    kw = dict(no_repeat_ngram_size=0, min_length=0, bad_words_ids=None)
    if tiny.forced_bos is not None:
        kw["forced_bos_token_id"] = tiny.forced_bos
    if prefix is not None:
        kw["decoder_input_ids"] = torch.tensor([prefix])
    with torch.no_grad():
        out = tiny.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False, num_beams=1,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long), output_logits=True,
                                  return_dict_in_generate=True, **kw)
    return out.sequences[0].tolist(), [x[0] for x in out.logits]


@pytest.fixture(scope="module")
def steps(tiny_seq2seq):
    model = copy.deepcopy(tiny_seq2seq.model)  # fused in place: transformers keeps its own
    return Steps.of(model, source_len=128, prefill_len=4, cache_len=64), model


def _close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = max(1.0, float(w.abs().max()))
        assert float((g - w).abs().max()) <= LOGIT_TOL * scale, f"step {i}"


def test_greedy_equals_transformers(tiny_seq2seq, steps):
    ids = tiny_seq2seq.source_ids()
    want, want_logits = _hf(tiny_seq2seq, ids, NEW)
    got, logits = greedy(*steps, ids, NEW, forced_bos=tiny_seq2seq.forced_bos)
    assert got == want
    _close(logits, want_logits)


def test_decoder_prefix_in_several_prefill_chunks(tiny_seq2seq, steps):
    """A decoder prompt of 11 tokens: prefill chunks of 4, 4 and 3 (the last right-padded)."""
    ids = tiny_seq2seq.source_ids("summarize: the cat sees the dog and the green river walks quickly.")
    start = _hf(tiny_seq2seq, ids, 10)[0]
    prefix = (start + list(range(5, 16)))[:11]
    want, want_logits = _hf(tiny_seq2seq, ids, 6, prefix)
    got, logits = greedy(*steps, ids, 6, prefix)
    assert got == want
    _close(logits, want_logits)


def test_source_changes_the_logits(tiny_seq2seq, steps):
    """The cross-attention is live: another source gives other first logits."""
    a = greedy(*steps, tiny_seq2seq.source_ids(), 1)[1][0]
    b = greedy(*steps, tiny_seq2seq.source_ids("the dog"), 1)[1][0]
    assert float((a - b).abs().max()) > 1e-2
