"""Integer (PT2E) prefill and decode graphs (issue 32's integer NPU recipes): `convert --graphs
--quantize int16|uint8 --target circle --verify` writes them, the caches at fixed per-layer
scales (circleops.recipes.llm_integer), and `generate --runtime reference` gives the greedy
tokens of torch running the same quantized computation (the converted, fake-quantized modules
through the same generation core)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from circleops.errors import TargetError
from circleops.generation.generator import Generator
from circleops.recipes.llm import convert_graphs
from circleops.quantize.weights import NOISE_FLOORS
from circleops.recipes.llm import decoder_step, io_names
from circleops.recipes.llm_integer import (CALIBRATION_DECODE_STEPS, QUALITY_DECODE_STEPS, calibrate,
                                          torch_generator)
from circleops.serialize import read_model

from generate_fixtures import TINY_PROMPTS, one_torch_thread
from held_memory import held_bytes

NEW = 8


class Forced:
    """A sampler (circleops.generation.core.GenerationCore.pick) that takes the given tokens and
    keeps the scores it was shown: torch run on the file's own token history."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.scores = tokens, []

    def __call__(self, scores, history) -> int:
        self.scores.append(np.asarray(scores, dtype=np.float64).reshape(-1))
        return self.tokens[len(self.scores) - 1]


PREFILL, CACHE = 8, 128
# positions the graphs are calibrated at: two prefill chunks, then the decode steps after them
CALIBRATED = 2 * PREFILL + CALIBRATION_DECODE_STEPS


@pytest.fixture(scope="module", params=["int16", "uint8"])
def integer_graphs(request, tmp_path_factory, tiny_model):
    out = tmp_path_factory.mktemp(f"int_graphs_{request.param}")
    with one_torch_thread():
        # one calibration window, no rotation and (uint8) no measured int16 parts: the test's CPU
        # budget; the recipes' defaults are measured on SmolLM2 (docs/integer-llm.md). The cache
        # is longer than the calibration window, so that positions past it can be decoded.
        report = convert_graphs(copy.deepcopy(tiny_model), out, target="circle", quantize=request.param,
                                prefill_len=PREFILL, max_cache_len=CACHE, verify="reference", calibrate=1,
                                rotate="off", int16=["none"] if request.param == "uint8" else None,
                                source="tiny llama")
    assert CALIBRATED < CACHE // 2
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
    assert q is not None and q.positions == QUALITY_DECODE_STEPS + 1 and "quality against fp32" in report.summary()


def test_graphs_hold_one_copy_of_their_folded_integers(integer_graphs):
    """The prefill and decode graphs' folded integer weights (PT2E's per-graph copies of the
    same integers: the embedding and lm_head tables at 1B, issue 32) are one storage each."""
    from circleops.quantize.integer.shared import FOLDED

    _, _, report = integer_graphs
    graphs = [{k: v for k, v in m.named_buffers() if k.startswith(FOLDED)} for m in report.converted.values()]
    assert len(graphs) == 2 and graphs[0] and graphs[0].keys() == graphs[1].keys()
    for k, v in graphs[0].items():
        if v.dtype == torch.int32:  # biases: scale s_input · s_weight, each graph's own activations
            continue
        w = graphs[1][k]
        assert torch.equal(v, w) and v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr(), k


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


def test_decode_past_its_calibrated_positions(integer_graphs, tiny_model):
    """A decode step far past every position calibration saw is as close to fp32 as one at a
    calibrated position. The RoPE cos/sin are rows of exact tables gathered by position; an
    angle computed in the graph (position x inv_freq) would be an activation quantized with the
    calibrated positions' range, saturating past them: cos/sin of the wrong angle, logits off
    by their own size. The same eight tokens are prefilled at pos P, then one token decoded at
    P + 8, by the written file and by the fp32 step: the rotation keeps every activation's
    range, so far past calibration the file's difference from fp32 is another draw of the
    same rounding as at the calibrated P = 0 and 8 (twice their larger difference bounds it);
    and the file is torch's quantized step there within verify's bound."""
    scheme, out, report = integer_graphs
    step = decoder_step(copy.deepcopy(tiny_model), CACHE)
    session = Generator(out, runtime="reference")
    prefill, decode = session.prefill_sessions[PREFILL], session.decode_session
    tokens, token = np.array([TINY_PROMPTS[2]], np.int64), np.array([[11]], np.int64)

    def difference(p: int) -> tuple[float, float, float]:
        """(max |file - fp32|, max |file - torch's quantized step|, max |fp32|) of the logits
        of the token decoded at p + PREFILL after the prefill at p."""
        empty = [c.numpy() for c in step.empty_caches()]
        caches = prefill.run([tokens, np.array([p]), np.array([PREFILL - 1]), *empty])[1:]
        got = decode.run([token, np.array([p + PREFILL]), *caches])[0].reshape(-1).astype(np.float64)
        with torch.no_grad():
            t = [torch.from_numpy(a) for a in (tokens, token)]
            want = step(t[0], torch.tensor([p]), *step.empty_caches())
            want = step(t[1], torch.tensor([p + PREFILL]), *want[1:])[0].reshape(-1).double().numpy()
            q = report.converted["prefill"](t[0], torch.tensor([p]), torch.tensor([PREFILL - 1]),
                                            *step.empty_caches())
            q = report.converted["decode"](t[1], torch.tensor([p + PREFILL]), *q[1:])[0].reshape(-1).double().numpy()
        return float(np.abs(got - want).max()), float(np.abs(got - q).max()), float(np.abs(want).max())

    with one_torch_thread():
        near = max(difference(p)[0] for p in (0, PREFILL))  # the decode step calibrated at 16 .. CALIBRATED - 1
        far, own, top = difference(CACHE - PREFILL - 1)  # decoded at the last slot, far past CALIBRATED
    assert far <= 2 * near, f"{scheme}: decoded at {CACHE - 1} the file is {far:.3g} from fp32 (logits up to " \
        f"{top:.3g}), at calibrated positions {near:.3g}"
    bound = max(report.tolerance * max(1.0, top), NOISE_FLOORS * (report.noise_floor or 0.0))
    assert own <= bound, f"{scheme}: decoded at {CACHE - 1} the file is {own:.3g} from torch's quantized step"


def test_calibration_caches_held_once_per_window(tiny_model):
    """Each calibration sample reads the caches as they were when it was taken (the next decode
    sample's caches are the fp32 step's output on this one's; the first prefill's are empty),
    while the calibration holds one set of caches per window, not one per sample: a clone per
    sample held 6 GB of SmolLM2's 512-slot caches at the default 8 windows x 32 decode steps."""
    step = decoder_step(copy.deepcopy(tiny_model), CACHE, rope_tables=True)
    names = io_names(step.num_layers)[0][2:]
    vocab, windows = int(tiny_model.config.vocab_size), 2
    ids = [torch.randint(0, vocab, (1, 2 * PREFILL + CALIBRATION_DECODE_STEPS),
                         generator=torch.Generator().manual_seed(w)) for w in range(windows)]
    with one_torch_thread(), torch.no_grad():
        cal = calibrate(step, {"prefill": ("prefill", PREFILL), "decode": ("decode", 1)}, ids, names, CACHE)
        one_set = sum(c.nbytes for c in step.empty_caches())
        assert held_bytes(cal) < (windows + 1) * one_set, "a set of caches held per calibration sample"
        decode = cal.samples["decode"]
        assert len(decode) == windows * CALIBRATION_DECODE_STEPS
        assert not any(c.any() for c in cal.samples["prefill"][0][3:]), "the first prefill reads empty caches"
        for k in range(len(decode) - 1):
            if k % CALIBRATION_DECODE_STEPS == CALIBRATION_DECODE_STEPS - 1:
                continue  # the window's last step: the next sample starts another window
            wrote = step(*decode[k])[1:]
            assert all(torch.equal(a, b) for a, b in zip(wrote, decode[k + 1][2:])), f"decode sample {k + 1}"


def test_onert_refused_before_loading():
    """onert runs no integer ATTENTION: refused naming the op and what to use, before any work."""
    with pytest.raises(TargetError, match="ATTENTION.*--target circle"):
        convert_graphs(None, "unused", target="onert", quantize="uint8")
