"""DecoderWithCache: prefill + decode steps through exported graphs equal HF generate."""
from __future__ import annotations

import copy

import pytest
import torch

from adapter_fixtures import circle_counts
from circleops.adapters.decode import DecoderWithCache
from circleops.errors import CircleOpsError
from circleops.options import HEAD_MAJOR, SLOT_MAJOR
from families import BY_NAME, FAMILIES, example_ids

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


DECOMPOSED = [f for f in FAMILIES if not f.attention_fusable and f.decode_graphs]
FORMS = [("full", SLOT_MAJOR), ("rows", SLOT_MAJOR), ("rows", HEAD_MAJOR)]
PROMPT, NEW = [5, 17, 42, 99, 3, 7, 8, 9, 10, 11], 8


def _store(step, caches, outs, pos, s):
    """What the Generator does with a step's cache outputs (circleops.generation.generator.store_caches)."""
    if step.cache_update == "full":
        return list(outs)
    n = step.num_layers
    for i, rows in enumerate(outs):
        if step.cache_layout == HEAD_MAJOR:
            if i < n:
                caches[i][0, :, pos:pos + s] = rows[0].transpose(0, 1)
            else:
                caches[i][0, :, :, pos:pos + s] = rows[0].permute(1, 2, 0)
        else:
            caches[i][0, pos:pos + s] = rows[0]
    return caches


@pytest.fixture(scope="module")
def hf_runs():
    """family name -> (model, transformers' greedy tokens, their logits)."""
    runs = {}
    for family in DECOMPOSED:
        model = family.build()
        with torch.no_grad():
            gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, use_cache=True,
                                 output_logits=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
        runs[family.name] = model, gen.sequences[0, len(PROMPT):].tolist(), torch.cat(gen.logits)
    return runs


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f[0]}-{'head' if f[1] == HEAD_MAJOR else 'slot'}")
@pytest.mark.parametrize("family", DECOMPOSED, ids=lambda f: f.name)
def test_decomposed_attention_over_the_caches_equals_hf_generate(hf_runs, family, form):
    """Layers circle.attention cannot express attend decomposed over the same caches, in
    every cache form: a prefill in two chunks (6 + 4 tokens, past Gemma's window of 4), then
    greedy decode steps, give transformers' tokens and logits."""
    model, tokens, logits = hf_runs[family.name]
    step = DecoderWithCache(copy.deepcopy(model), 24, cache_update=form[0], cache_layout=form[1])
    assert set(step.decomposed) == set(range(step.num_layers))
    caches, got, pos = step.empty_caches(), [], 0
    with torch.no_grad():
        for chunk in (PROMPT[:6], PROMPT[6:]):
            out, *new = step(torch.tensor([chunk]), torch.tensor([pos]), *caches)
            caches, pos = _store(step, caches, new, pos, len(chunk)), pos + len(chunk)
        got.append(out[0, -1])
        for t in tokens[:-1]:
            out, *new = step(torch.tensor([[t]]), torch.tensor([pos]), *caches)
            caches, pos = _store(step, caches, new, pos, 1), pos + 1
            got.append(out[0, -1])
    assert [int(x.argmax()) for x in got] == tokens
    torch.testing.assert_close(torch.stack(got), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,kw,match", [
    ("gemma3", {"use_bidirectional_attention": True}, r"layer 0 \(Gemma3Attention\): bidirectional attention"),
    ("deepseek_v3", {}, r"DeepseekV3Attention\): no circleops attention adapter"),
    ("granitemoe", {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
     r"computes embedding_multiplier 12.0; logits_scaling 8.0 outside its decoder layers"),
])
def test_what_no_cache_graph_computes_is_refused(name, kw, match):
    from circleops.adapters import is_fused

    model = BY_NAME[name].build(**kw)
    with pytest.raises(CircleOpsError, match=match):
        DecoderWithCache(model, max_len=16)
    assert not is_fused(model)  # the caller's model as it came


def test_wrong_number_of_caches(llama_run):
    step, ids, *_ = llama_run
    with pytest.raises(CircleOpsError, match="expected 4 caches"):
        step(ids, torch.tensor([0]), *step.empty_caches()[:3])
