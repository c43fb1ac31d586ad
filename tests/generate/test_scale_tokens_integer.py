"""bench/scale_tokens.py's third form for the integer NPU recipes (issue 32): ``--quantized DIR
--target circle --quantize int16 --weight-bits 4 --verify`` compares the written directory's
greedy tokens on the reference interpreter with torch running the same quantized computation
(the converted, fake-quantized graphs, before verify restores the model's weights). On a tiny
Llama saved as an HF directory, in the short configuration the 1B run uses (one prefill
length, a short cache, --no-gptq --int8-weights none)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

from circleops.generation.generator import Generator
from circleops.quantize.weights import NOISE_FLOORS

from families import BY_NAME
from generate_fixtures import TINY_PROMPTS, one_torch_thread

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import scale_tokens  # noqa: E402

NEW = 6


class Scores:
    """A greedy sampler that keeps the scores it was shown (the directory's own logits)."""

    def __init__(self):
        self.scores = []

    def __call__(self, scores, history) -> int:
        self.scores.append(np.asarray(scores, dtype=np.float64).reshape(-1))
        return int(self.scores[-1].argmax())


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[dict, Path, list[int]]:
    root = tmp_path_factory.mktemp("scale_tokens_int")
    BY_NAME["llama"].build().save_pretrained(str(root / "hf"))
    ids = TINY_PROMPTS[0]
    args = argparse.Namespace(quantized=str(root / "hf"), target="circle", quantize="int16", weight_bits=4,
                              seq_len="8", max_cache_len=32, calibrate=1, gptq=False, int8_weights="none",
                              int16=None, rotate=None, verify=True, new=NEW, out=str(root / "out"))
    with one_torch_thread():
        info = scale_tokens.quantized(args, ids)
    return info, root / "out", ids


def test_options_reach_the_convert(compared):
    """--no-gptq and --int8-weights none are the convert's: every linear int4, rounded to nearest."""
    info, _, _ = compared
    summary = info["summary"]
    assert "round to nearest" in summary and "int8 per channel" not in summary, summary
    assert "GPTQ" not in summary.split("quantize:")[1].split("manifest")[0], summary


def test_torch_side_is_the_files_computation(compared):
    """torch's greedy logits (their top-2 margins) are the directory's own within twice verify's
    bound: torch ran the file's quantized computation, not the float model (on this model the
    two differ by logits of ~1, 7.6 dB). The tokens reported for the directory are a fresh
    Generator's, every step's noise is positive (the stochastic rounding moved something) and
    the directory's tokens are torch's wherever torch's margin is past that bound."""
    info, out, ids = compared
    sampler = Scores()
    with one_torch_thread():
        tokens = Generator(out, runtime="reference").generate(ids, NEW, stop_at_eos=False, sampler=sampler).tokens
    assert list(tokens) == info["tokens"] and len(tokens) == NEW
    assert len(info["directory_noise"]) == NEW and min(info["directory_noise"]) > 0
    for k, (scores, margin) in enumerate(zip(sampler.scores, info["torch_margins"])):
        top = np.sort(scores)[-2:]
        # verify's bound on one logit (circleops.package.step._compare), as the directory passed it
        bound = max(info["tolerance"] * max(1.0, float(np.abs(scores).max())), NOISE_FLOORS * info["noise_floor"])
        # each logit within one bound of torch's: the top-2 margin within two
        assert abs((top[1] - top[0]) - margin) <= 2 * bound, (k, top[1] - top[0], margin, bound)
        if margin > 2 * bound:
            assert info["tokens"][k] == info["torch_tokens"][k], k
    assert info["directory_gap_over_noise"] <= 1.0, info["directory_gaps"]
