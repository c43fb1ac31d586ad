"""Integer (PT2E) prefill and decode graphs (issue 32's integer NPU recipes): `convert --graphs
--quantize int16|uint8 --target circle --verify` writes them, the caches at fixed per-layer
scales (circleops.recipes.llm_integer), and `generate --runtime reference` gives the greedy
tokens of torch running the same quantized computation (the converted, fake-quantized modules
through the same generation core)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from circleops.errors import TargetError
from circleops.generation.generator import Generator
from circleops.recipes.llm import convert_graphs
from circleops.quantize.weights import NOISE_FLOORS
from circleops.recipes.llm_integer import torch_generator
from circleops.serialize import read_model

from generate_fixtures import TINY_PROMPTS, one_torch_thread

NEW = 8


class Forced:
    """A sampler (circleops.generation.core.GenerationCore.pick) that takes the given tokens and
    keeps the scores it was shown: torch run on the file's own token history."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.scores = tokens, []

    def __call__(self, scores, history) -> int:
        self.scores.append(np.asarray(scores, dtype=np.float64).reshape(-1))
        return self.tokens[len(self.scores) - 1]


@pytest.fixture(scope="module", params=["int16", "uint8"])
def integer_graphs(request, tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp(f"int_graphs_{request.param}")
    with one_torch_thread():
        # one calibration window, no rotation and (uint8) no measured int16 parts: the test's CPU
        # budget; the recipes' defaults are measured on SmolLM2 (docs/integer-llm.md)
        report = convert_graphs(copy.deepcopy(tiny_model), out, target="circle", quantize=request.param,
                                prefill_len=8, max_cache_len=32, verify="reference", calibrate=1, rotate="off",
                                int16=["none"] if request.param == "uint8" else None, source="tiny llama")
    return request.param, out, report


def test_written_integer_with_integer_caches(integer_graphs):
    """Every graph's weights and activations are integer, and ATTENTION reads and writes its
    caches as integer tensors of one fixed scale per layer's K and V, the same in both graphs."""
    scheme, out, report = integer_graphs
    model = read_model(out / "model.circle")
    act = "INT16" if scheme == "int16" else "UINT8"
    scales = []
    for sg in model.subgraphs:
        attention = [op for op in sg.operators if op.opcode == "ATTENTION"]
        assert len(attention) == 2
        caches = [sg.tensors[op.inputs[i]] for op in attention for i in (8, 9)]
        assert all(t.dtype == act and t.quant is not None for t in caches)
        scales.append([(float(t.quant.scale[0]), int(t.quant.zero_point[0])) for t in caches])
        fcs = [op for op in sg.operators if op.opcode == "FULLY_CONNECTED"]
        assert fcs and all(sg.tensors[op.inputs[1]].dtype == "INT8" for op in fcs)
        assert all(sg.tensors[op.inputs[0]].dtype == act for op in fcs)
    assert scales[0] == scales[1]  # prefill and decode: one integer form of each cache
    assert report.verify_runtime == "reference" and all(g.max_abs_error is not None for g in report.graphs.values())
    q = report.quality
    assert q is not None and q.positions == 32 - 8 + 1 and "quality against fp32" in report.summary()


def test_generate_matches_torch_quantized(integer_graphs):
    """The reference interpreter's greedy tokens are torch's on the converted modules: at every
    step torch, run on the same history (the file's tokens), scores the file's token within
    twice the verify bound of its own greedy choice (the file's logits are within one bound of
    torch's, so a choice further below would be a wrong file, not a near tie)."""
    scheme, out, report = integer_graphs
    same = 0
    with one_torch_thread():
        for prompt in TINY_PROMPTS[::2]:  # one short prompt, one that fills the prefill
            got = Generator(out, runtime="reference").generate(prompt, NEW).tokens
            forced = Forced(got)
            assert torch_generator(out, report.converted).generate(prompt, NEW, sampler=forced).tokens == got
            for k, (token, scores) in enumerate(zip(got, forced.scores)):
                bound = 2 * max(report.tolerance * max(1.0, float(np.abs(scores).max())),
                                NOISE_FLOORS * (report.noise_floor or 0.0))  # verify's bound, twice
                assert scores[token] >= scores.max() - bound, \
                    f"{scheme} prompt {prompt}: token {k} {token} scores {scores[token]:.3g} in torch, whose greedy " \
                    f"{int(scores.argmax())} scores {scores.max():.3g} (bound {bound:.3g})"
                same += int(token == int(scores.argmax()))
    assert same > 0


def test_onert_refused_before_loading():
    """onert runs no integer ATTENTION: refused naming the op and what to use, before any work."""
    with pytest.raises(TargetError, match="ATTENTION.*--target circle"):
        convert_graphs(None, "unused", target="onert", quantize="uint8")
