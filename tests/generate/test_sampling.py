"""circleops.generation.sampling: transformers' logits processing, reproducible draws, the right distribution."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from circleops.generation.sampling import Sampler, SamplingConfig, SamplingError, softmax

V = 64


def _logits(seed=0, n=V):
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


@pytest.mark.parametrize("temperature, k, p, penalty", [
    (1.0, 50, 1.0, 1.0), (0.7, 10, 1.0, 1.0), (1.3, 0, 0.9, 1.0), (0.5, 20, 0.8, 1.3), (1.0, 5, 0.5, 0.8)])
def test_processing_equals_transformers(temperature, k, p, penalty):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                         TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    logits, context = _logits(1), [3, 7, 7, 40, 63]
    procs = LogitsProcessorList()
    if penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty))
    procs.append(TemperatureLogitsWarper(temperature))
    if k:
        procs.append(TopKLogitsWarper(k))
    if p < 1:
        procs.append(TopPLogitsWarper(p))
    want = procs(torch.tensor([context]), torch.from_numpy(logits)[None].clone())[0].numpy()
    got = Sampler(SamplingConfig(do_sample=True, temperature=temperature, top_k=k, top_p=p,
                                 repetition_penalty=penalty)).process(logits, context)
    assert np.array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)
    del GenerationConfig


def test_fixed_seed_fixed_tokens():
    config = SamplingConfig(do_sample=True, temperature=1.5, top_k=0, seed=1234)
    draws = [[s(_logits(i)) for i in range(50)] for s in (Sampler(config), Sampler(config))]
    other = Sampler(SamplingConfig(do_sample=True, temperature=1.5, top_k=0, seed=4321))
    assert draws[0] == draws[1]
    assert [other(_logits(i)) for i in range(50)] != draws[0]


def test_top_k_1_is_greedy_and_greedy_is_default():
    for i in range(20):
        logits = _logits(i)
        assert Sampler(SamplingConfig(do_sample=True, top_k=1, temperature=2.0, seed=i))(logits) == int(logits.argmax())
        assert Sampler()(logits) == int(logits.argmax())


def test_first_token_distribution_is_softmax_over_temperature():
    """Pearson chi-square of 20000 draws against softmax(logits / T) over 8 tokens:
    df = 7, the 0.999 quantile is 24.3 (a fixed seed makes the statistic fixed too)."""
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    T, n = 0.8, 20000
    sampler = Sampler(SamplingConfig(do_sample=True, temperature=T, top_k=0, seed=7))
    counts = np.bincount([sampler(logits) for _ in range(n)], minlength=8)
    expected = softmax(logits / T) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (counts, expected.round())
    # and a wrong temperature is caught by the same bound
    wrong = softmax(logits / 1.2) * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 24.3


def test_repetition_penalty_applies_to_greedy():
    logits = np.array([5.0, 4.9, -1.0], np.float32)
    assert Sampler(SamplingConfig(repetition_penalty=1.2))(logits, context=[0]) == 1
    assert Sampler(SamplingConfig())(logits, context=[0]) == 0


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "repetition_penalty": 1.1}))
    c = SamplingConfig.from_generation_config(tmp_path)
    assert (c.do_sample, c.temperature, c.top_p, c.top_k, c.repetition_penalty) == (False, 0.6, 0.9, 50, 1.1)
    c = SamplingConfig.from_generation_config(tmp_path, do_sample=True, temperature=1.2, top_k=None, seed=3)
    assert (c.do_sample, c.temperature, c.top_k, c.seed) == (True, 1.2, 50, 3)
    assert SamplingConfig.from_generation_config(tmp_path / "missing") == SamplingConfig()


@pytest.mark.parametrize("kw, message", [({"temperature": 0}, "temperature"), ({"top_p": 0}, "top-p"),
                                         ({"top_k": -1}, "top-k"), ({"repetition_penalty": 0}, "repetition")])
def test_bad_values_are_clear_errors(kw, message):
    with pytest.raises(SamplingError, match=message):
        SamplingConfig(do_sample=True, **kw)
