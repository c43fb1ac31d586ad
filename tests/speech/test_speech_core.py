"""Whisper runs on the generation core (circleops.generation.core), so what a text model gets
from it a speech model gets too: --sample (temperature, top-k, top-p, seed) drawing from the
logits after Whisper's suppressed tokens, and --threads reaching each graph's session; greedy
stays transformers' tokens (tests/speech/test_speech_generate.py)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import wave

import numpy as np
import pytest
import torch

import circleops.generation.sessions as sessions_module
import manifest_json
from circleops.cli import main
from circleops.generation.sampling import Sampler, SamplingConfig
from circleops.generation.speech import SpeechGenerator

NEW_TOKENS = 12


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def hf(whisper_dir):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    return WhisperForConditionalGeneration.from_pretrained(str(whisper_dir)).eval(), \
        WhisperProcessor.from_pretrained(str(whisper_dir))


def _hf_features(processor, path) -> torch.Tensor:
    with wave.open(str(path)) as f:
        samples = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768
    return processor.feature_extractor(samples, sampling_rate=16000, return_tensors="pt").input_features


class Recording(Sampler):
    """A Sampler that records, per pick, the scores it was given and the token's rank in them."""

    def __init__(self, config):
        super().__init__(config)
        self.scores, self.ranks = [], []

    def __call__(self, logits, context=()):
        token = super().__call__(logits, context)
        scores = np.asarray(logits)
        self.scores.append(scores.copy())
        self.ranks.append(int((scores > scores[token]).sum()))
        return token


@pytest.fixture(scope="module")
def edited(speech_graphs, clip, tmp_path_factory):
    """The onert speech graphs with the model's own first greedy token begin-suppressed and its
    second suppressed (so the suppressed logits decide what is drawn), and those two tokens."""
    plain = SpeechGenerator(speech_graphs("onert"), runtime="onert").transcribe(
        clip, language="en", max_new_tokens=NEW_TOKENS).tokens
    out = tmp_path_factory.mktemp("asr-edited") / "asr"
    shutil.copytree(speech_graphs("onert"), out)
    manifest_json.edit(out, {"begin_suppress_tokens": [plain[0]], "suppress_tokens": [plain[1]]})
    return out, plain[0], plain[1]


def test_sample_top_k_1_is_greedy_over_the_suppressed_logits(edited, clip, hf):
    """--sample --top-k 1 draws the most likely token of what the sampler is given: the tokens
    are transformers' greedy tokens under the same suppressed tokens, so the sampler sees the
    logits after Whisper's logits processor (before it, it would draw the suppressed ones)."""
    out, first, second = edited
    model, processor = hf
    with torch.no_grad():
        want = model.generate(_hf_features(processor, clip), do_sample=False, max_new_tokens=NEW_TOKENS,
                              language="en", begin_suppress_tokens=[first], suppress_tokens=[second])[0].tolist()
    code, text, err = _cli("generate", out, "--audio", clip, "--language", "en", "--max-new-tokens", NEW_TOKENS,
                           "--sample", "--top-k", "1", "--seed", "0")
    assert code == 0, err
    assert text == processor.tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert "sampling: temperature 1, top-k 1, seed 0" in err


def test_sample_draws_what_the_sampler_draws(edited, clip, hf):
    """--sample --top-k 5 --temperature 1.5 --seed S: the CLI prints the API's draws for that
    config; each is among the 5 most likely of the suppressed scores (a suppressed token is
    -inf there, and never drawn), some are not the most likely one (the tiny model's logits are
    peaked: a few steps have one clear choice), the seed decides them."""
    out, first, second = edited
    _, processor = hf
    gen = SpeechGenerator(out, runtime="onert")
    greedy = gen.transcribe(clip, language="en", max_new_tokens=NEW_TOKENS).tokens
    draws = {}
    for seed in (3, 4):
        code, text, err = _cli("generate", out, "--audio", clip, "--language", "en", "--max-new-tokens", NEW_TOKENS,
                               "--sample", "--top-k", "5", "--temperature", "1.5", "--seed", seed)
        assert code == 0, err
        sampler = Recording(SamplingConfig(do_sample=True, top_k=5, temperature=1.5, seed=seed))
        api = gen.transcribe(clip, language="en", max_new_tokens=NEW_TOKENS, sampler=sampler)
        assert text == api.text + "\n" and api.text == processor.tokenizer.decode(api.tokens, skip_special_tokens=True)
        draws[seed] = api.tokens
        assert all(rank < 5 for rank in sampler.ranks), sampler.ranks
        assert sum(rank > 0 for rank in sampler.ranks) >= 2, sampler.ranks  # drawn, not the argmax each time
        assert sampler.scores[0][first] == -np.inf and all(s[second] == -np.inf for s in sampler.scores)
        assert api.tokens[0] != first and second not in api.tokens
        assert api.tokens != greedy
    assert draws[3] != draws[4]


@pytest.fixture
def opened(monkeypatch):
    """graph name -> the NUM_THREADS its session was created under (None: unset)."""
    seen: dict[str, str | None] = {}
    real = sessions_module.open_session

    def spy(runtime, path, signature=None, **kwargs):
        seen[os.path.basename(str(path)).split(".")[0] if signature is None else signature] = \
            os.environ.get("NUM_THREADS")
        return real(runtime, path, signature, **kwargs)

    monkeypatch.setattr(sessions_module, "open_session", spy)
    monkeypatch.delenv("NUM_THREADS", raising=False)
    return seen


def test_cli_threads_reaches_the_speech_sessions(speech_graphs, clip, hf, opened):
    """--threads 2 on onert: the encoder and the prefill (over the encoder's frames) run at 2,
    the decode step's one row at 1 (GRAPH_THREAD_CAPS, as for a text model); the same
    transformers tokens."""
    model, processor = hf
    code, text, err = _cli("generate", speech_graphs("onert"), "--audio", clip, "--language", "en",
                           "--max-new-tokens", NEW_TOKENS, "--threads", "2")
    assert code == 0, err
    assert opened == {"encoder": "2", "prefill": "2", "decode": "1"}
    assert "NUM_THREADS" not in os.environ  # set only while each session is created
    with torch.no_grad():
        want = model.generate(_hf_features(processor, clip), do_sample=False, max_new_tokens=NEW_TOKENS,
                              language="en")[0].tolist()
    assert text == processor.tokenizer.decode(want, skip_special_tokens=True) + "\n"


def test_threads_on_litert_and_a_mapping(speech_graphs, clip, hf, monkeypatch):
    """LiteRT runs every graph at the budget (no cap measured for it); a mapping is honoured
    exactly for the graphs it names; the tokens stay transformers'."""
    model, processor = hf
    monkeypatch.delenv("NUM_THREADS", raising=False)
    gen = SpeechGenerator(speech_graphs("tflite"), runtime="litert", threads=3)
    assert gen.threads == {"encoder": 3, "prefill": 3, "decode": 3}
    assert {s.num_threads for s in gen.sessions.values()} == {3}
    with torch.no_grad():
        want = model.generate(_hf_features(processor, clip), do_sample=False, max_new_tokens=NEW_TOKENS,
                              language="en")[0].tolist()
    assert gen.transcribe(clip, language="en", max_new_tokens=NEW_TOKENS).tokens == want
    gen = SpeechGenerator(speech_graphs("tflite"), runtime="litert", threads={"decode": 2})
    assert gen.threads["decode"] == 2 and gen.sessions["decode"].num_threads == 2
