"""Prompts longer than the prefill graph run through it in chunks (its `pos` input), with
transformers' greedy tokens, up to the cache length."""
from __future__ import annotations

import pytest
import torch

from circleops.generate import GenerationLimitError, Generator
from circleops.graphs import convert_graphs
from families import BY_NAME
from generate_fixtures import one_torch_thread

PREFILL, CACHE, NEW = 16, 320, 6


@pytest.fixture(scope="module")
def model():
    return BY_NAME["llama"].build(max_position_embeddings=512)


@pytest.fixture(scope="module", params=["onert", "circle"])
def graphs(request, model, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"chunked_{request.param}")
    convert_graphs(BY_NAME["llama"].build(max_position_embeddings=512), out, target=request.param,
                   prefill_len=PREFILL, max_cache_len=CACHE)
    return Generator(out)


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _hf(model, prompt, new):
    with torch.no_grad(), one_torch_thread():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("n", [5, PREFILL, 37, 300, CACHE - NEW])
def test_any_prompt_length_gives_transformers_tokens(graphs, model, n):
    prompt = _prompt(n)
    result = graphs.generate(prompt, NEW, stop_at_eos=False)
    assert result.tokens == _hf(model, prompt, NEW)
    assert graphs.position == n + NEW - 1  # the last token is returned, not fed


def test_prompt_logits_match_the_model(graphs, model):
    prompt = _prompt(45)  # 2 full chunks + an end-aligned third
    got = graphs.prefill(prompt, all_logits=True)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].numpy()
    assert got.shape == want.shape
    assert abs(got - want).max() < 1e-4


def test_past_the_cache_is_refused(graphs):
    with pytest.raises(GenerationLimitError, match=f"more than the {CACHE} slots"):
        graphs.generate(_prompt(CACHE), 1)


def test_timing_line_counts_the_chunks(graphs):
    result = graphs.generate(_prompt(40), 2, stop_at_eos=False)
    assert result.prefill_runs == 3  # 0..15, 16..31, then 24..39 end-aligned
    assert f"(graph length {PREFILL}, 3 runs)" in result.timing_line(PREFILL)
