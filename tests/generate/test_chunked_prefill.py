"""Prompts run through the prefill graphs (two lengths here, as by default) in chunks (their
`pos` input), with transformers' greedy tokens, up to the cache length; the chunk plan."""
from __future__ import annotations

from itertools import product

import numpy as np
import pytest
import torch

from circleops.generation.generator import GenerationLimitError, Generator, plan_chunks
from circleops.recipes.llm import convert_graphs
from families import BY_NAME
from generate_fixtures import one_torch_thread

PREFILL, SHORT, CACHE, NEW = 16, 4, 320, 6


@pytest.fixture(scope="module")
def model():
    return BY_NAME["llama"].build(max_position_embeddings=512)


@pytest.fixture(scope="module", params=["onert", "circle"])
def graphs(request, model, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"chunked_{request.param}")
    convert_graphs(BY_NAME["llama"].build(max_position_embeddings=512), out, target=request.param,
                   prefill_len=(PREFILL, SHORT), max_cache_len=CACHE)
    return Generator(out)


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def _hf(model, prompt, new):
    with torch.no_grad(), one_torch_thread():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("n", [3, 5, PREFILL, 36, 37, 300, CACHE - NEW])
def test_any_prompt_length_gives_transformers_tokens(graphs, model, n):
    prompt = _prompt(n)
    result = graphs.generate(prompt, NEW, stop_at_eos=False)
    assert result.tokens == _hf(model, prompt, NEW)
    assert graphs.position == n + NEW - 1  # the last token is returned, not fed


def test_logits_and_cache_match_the_model(graphs, model):
    """The prefill returns the last prompt token's logits, and the caches it leaves hold
    every prompt token: the decode steps after it give the model's logits too."""
    prompt = _prompt(48)
    chunks = graphs.plan(0, 45)
    assert [n for n, _ in chunks] == [PREFILL, PREFILL, PREFILL]  # two full chunks + an end-aligned third
    got = [graphs.prefill(prompt[:45])] + [graphs.decode(t) for t in prompt[45:]]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, 44:].numpy()
    assert abs(np.stack(got) - want).max() < 1e-4


@pytest.mark.parametrize("start,end", [(0, 1), (0, 3), (0, 5), (0, 20), (0, 36), (7, 9), (30, 31), (3, 300)])
def test_plan_covers_the_tokens_at_least_cost(start, end):
    """Every token start..end-1 is written, the runs before the last hold new tokens only,
    the last ends at the last token (or starts at 0, padded), and no other plan of those
    runs computes fewer positions (exhaustive over 1..3 runs)."""
    lengths, overhead = (PREFILL, SHORT), 24
    runs = plan_chunks(start, end, lengths, overhead)
    covered = set()
    for i, (n, s) in enumerate(runs):
        assert n in lengths and s >= 0
        if i < len(runs) - 1:
            assert s == start + sum(m for m, _ in runs[:i]) and s + n < end
        else:
            assert s + n == end or (s == 0 and n > end)
        covered |= set(range(s, min(s + n, end)))
    assert covered >= set(range(start, end))
    cost, left = sum(n + overhead for n, _ in runs), end - start
    if left <= 40:  # every sequence of runs that covers the tokens, each before the last all new
        best = min(sum(c) + k * overhead for k in range(1, left // SHORT + 2) for c in product(lengths, repeat=k)
                   if sum(c[:-1]) < left <= sum(c))
        assert cost == best


def test_past_the_cache_is_refused(graphs):
    with pytest.raises(GenerationLimitError, match=f"more than the {CACHE} slots"):
        graphs.generate(_prompt(CACHE), 1)


def test_timing_line_counts_the_chunks(graphs):
    result = graphs.generate(_prompt(40), 2, stop_at_eos=False)
    assert result.prefill_runs == 3  # 0..15, 16..31, then 24..39 end-aligned
    assert f"(graph length {PREFILL}, 3 runs)" in result.timing_line(PREFILL)
    result = graphs.generate(_prompt(3), 2, stop_at_eos=False)
    assert result.prefill_chunks == [SHORT] and f"(graph length {SHORT})" in result.timing_line()
    result = graphs.generate(_prompt(36), 2, stop_at_eos=False)
    assert result.prefill_chunks == [PREFILL, PREFILL, SHORT]
    assert f"(runs of {PREFILL} + {PREFILL} + {SHORT} positions)" in result.timing_line()
