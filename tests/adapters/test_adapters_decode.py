"""DecoderWithCache: prefill + decode steps through exported graphs equal HF generate."""
from __future__ import annotations

import pytest
import torch

from adapter_fixtures import circle_counts
from circleops.adapters.decode import DecoderWithCache
from circleops.errors import CircleOpsError
from families import BY_NAME, example_ids

STEPS = 10
MAX_LEN = 24


@pytest.fixture(scope="module")
def llama_run():
    """HF greedy generation with its own cache, then the exported prefill and decode graphs."""
    model = BY_NAME["llama"].build()
    ids = example_ids()
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=STEPS + 1, do_sample=False, use_cache=True,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    step = DecoderWithCache(model, max_len=MAX_LEN)
    caches = step.empty_caches()
    prefill = torch.export.export(step, (ids, torch.tensor([0]), *caches))
    decode = torch.export.export(step, (ids[:, :1], torch.tensor([ids.shape[1]]), *caches), strict=True)
    return step, ids, gen, prefill, decode


def test_graphs_hold_one_attention_per_layer_and_take_caches(llama_run):
    step, ids, _, prefill, decode = llama_run
    for ep in (prefill, decode):
        assert circle_counts(ep) == {"rms_norm": 2 * step.num_layers + 1, "attention": step.num_layers}
        user_inputs = ep.graph_signature.user_inputs
        assert len(user_inputs) == 2 + 2 * step.num_layers
        outs = [n for n in ep.graph.output_node().args[0]]
        assert len(outs) == 1 + 2 * step.num_layers
        assert all(tuple(o.meta["val"].shape) == step.cache_shape for o in outs[1:])


def test_prefill_then_decode_equals_hf_generate(llama_run):
    step, ids, gen, prefill, decode = llama_run
    run_prefill, run_decode = prefill.module(), decode.module()
    caches = step.empty_caches()
    with torch.no_grad():
        logits, *caches = run_prefill(ids, torch.tensor([0]), *caches)
        got_logits, tokens = [logits[0, -1]], [logits[0, -1].argmax()]
        for i in range(STEPS):
            pos = torch.tensor([ids.shape[1] + i])
            logits, *caches = run_decode(tokens[-1].view(1, 1), pos, *caches)
            got_logits.append(logits[0, -1])
            tokens.append(logits[0, -1].argmax())
    assert torch.stack(tokens).tolist() == gen.sequences[0, ids.shape[1]:].tolist()
    torch.testing.assert_close(torch.stack(got_logits), torch.cat(gen.logits), rtol=1e-4, atol=1e-4)
    # the caches hold exactly the written slots
    written = ids.shape[1] + STEPS
    assert caches[0][:, :written].abs().sum() > 0 and caches[0][:, written:].abs().sum() == 0


def test_eager_step_matches_exported_step(llama_run):
    step, ids, _, prefill, _ = llama_run
    caches = step.empty_caches()
    with torch.no_grad():
        eager = step(ids, torch.tensor([0]), *caches)
        exported = prefill.module()(ids, torch.tensor([0]), *caches)
    for a, b in zip(eager, exported):
        assert torch.equal(a, b)


def test_unfusable_family_is_refused_with_the_reason():
    with pytest.raises(CircleOpsError, match=r"Qwen2Attention.*biases"):
        DecoderWithCache(BY_NAME["qwen2"].build(), max_len=16)


def test_wrong_number_of_caches(llama_run):
    step, ids, *_ = llama_run
    with pytest.raises(CircleOpsError, match="expected 4 caches"):
        step(ids, torch.tensor([0]), *step.empty_caches()[:3])
