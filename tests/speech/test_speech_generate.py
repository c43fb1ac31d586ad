"""Whisper speech generation: `circleops convert DIR --graphs encoder,prefill,decode` and
`circleops generate DIR --audio clip.wav` give transformers' greedy tokens, token for token,
on onert and on the reference interpreter; bad audio and non-speech directories are clear
errors."""
from __future__ import annotations

import contextlib
import io
import json
import wave

import numpy as np
import pytest
import torch

import manifest_json
from circleops.cli import main
from circleops.generation.speech import SpeechGenerator
from circleops.package.speech_manifest import SpeechInputError
from tiny_whisper import write_wav

NEW_TOKENS = 12
# (target, runtime): onert's one file per graph on onert; circle's one file with a signature
# per graph on the reference interpreter
RUNS = [("onert", "onert"), ("circle", "reference")]
STARTS = [dict(language="en", task="transcribe"), dict(language="fr", task="translate"), dict(language="de"),
          dict()]  # the last: the language detected


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def hf(whisper_dir):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    return WhisperForConditionalGeneration.from_pretrained(str(whisper_dir)).eval(), \
        WhisperProcessor.from_pretrained(str(whisper_dir))


def _hf_features(processor, path) -> torch.Tensor:
    """input_features the way a transformers user makes them (samples read here, not by circleops)."""
    with wave.open(str(path)) as f:
        samples = np.frombuffer(f.readframes(f.getnframes()), "<i2").astype(np.float32) / 32768
    return processor.feature_extractor(samples, sampling_rate=16000, return_tensors="pt").input_features


def _hf_tokens(model, features, **start) -> list[int]:
    with torch.no_grad():
        return model.generate(features, do_sample=False, max_new_tokens=NEW_TOKENS, **start)[0].tolist()


@pytest.mark.parametrize("target,runtime", RUNS)
@pytest.mark.parametrize("start", STARTS, ids=lambda s: "-".join(s.values()) or "detect")
def test_tokens_are_transformers_greedy_tokens(speech_graphs, clip, hf, target, runtime, start):
    model, processor = hf
    gen = SpeechGenerator(speech_graphs(target), runtime=runtime)
    result = gen.transcribe(clip, max_new_tokens=NEW_TOKENS, **start)
    want = _hf_tokens(model, _hf_features(processor, clip), **start)
    assert result.tokens == want
    assert len(set(want)) > 3  # the model says something, not one token repeated
    assert result.text == processor.tokenizer.decode(want, skip_special_tokens=True)


def test_the_audio_decides_the_tokens(speech_graphs, hf, tmp_path):
    """Another clip (and silence) gives other tokens, the same as transformers': the encoder
    and the cross-attention K/V reach the decode steps."""
    model, processor = hf
    gen = SpeechGenerator(speech_graphs("onert"), runtime="onert")
    low = write_wav(tmp_path / "low.wav", freq=200.0, seconds=0.5)
    silence = np.zeros((1, *gen.manifest.input_features[1:]), np.float32) + _hf_features(processor, low).numpy().min()
    a = gen.transcribe(low, language="en", max_new_tokens=NEW_TOKENS).tokens
    b = gen.generate(silence, language="en", max_new_tokens=NEW_TOKENS).tokens
    assert a == _hf_tokens(model, _hf_features(processor, low), language="en")
    assert b == _hf_tokens(model, torch.from_numpy(silence), language="en")
    assert a != b


def test_start_tokens_follow_transformers(speech_graphs, clip, hf):
    """language and task tokens as transformers forces them; without a language, the one
    transformers' detect_language picks."""
    model, processor = hf
    gen = SpeechGenerator(speech_graphs("onert"), runtime="onert")
    cfg = model.generation_config
    features = _hf_features(processor, clip)
    states = gen.sessions["encoder"].run([features.numpy()])[0]
    sot, nots = cfg.decoder_start_token_id, cfg.no_timestamps_token_id
    assert gen.start_tokens(states, "fr", "translate") == [sot, cfg.lang_to_id["<|fr|>"], cfg.task_to_id["translate"], nots]
    assert gen.start_tokens(states, "english") == [sot, cfg.lang_to_id["<|en|>"], cfg.task_to_id["transcribe"], nots]
    detected = int(model.detect_language(features)[0])
    assert gen.start_tokens(states) == [sot, detected, nots]


def test_cache_and_cross_kv_layout_in_the_manifest(speech_graphs, whisper_dir):
    out = speech_graphs("onert")
    top, data = manifest_json.read(out), manifest_json.fields(out)
    cfg = json.loads((whisper_dir / "config.json").read_text())
    heads, d = cfg["decoder_attention_heads"], cfg["d_model"] // cfg["decoder_attention_heads"]
    assert (top["format"], top["version"], top["kind"]) == ("circleops-generate", 4, "speech") and "speech" in top
    assert data["cache_update"] == "rows"
    assert data["files"] == {"encoder": "encoder.circle", "prefill": "prefill.circle", "decode": "decode.circle"}
    assert data["cache_shape"] == [1, heads, cfg["max_target_positions"], d]
    assert data["cross_shape"] == [1, heads, cfg["max_source_positions"], d]
    decode = data["graphs"]["decode"]
    n = cfg["decoder_layers"]
    assert decode["inputs"][:2] == ["input_ids", "pos"] and len(decode["inputs"]) == 2 + 4 * n
    assert decode["outputs"] == ["logits", *[f"{kv}_new_{i}" for kv in "kv" for i in range(n)]]  # no cross K/V out
    assert "cross_k_0" in data["graphs"]["prefill"]["outputs"]


def test_cli_generate_prints_transformers_text(speech_graphs, clip, hf):
    model, processor = hf
    code, out, err = _cli("generate", str(speech_graphs("onert")), "--audio", str(clip), "--language", "en",
                          "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0, err
    want = _hf_tokens(model, _hf_features(processor, clip), language="en")
    assert out == processor.tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert f"{len(want)} tokens decoded" in err


def test_wav_of_another_rate_is_refused(speech_graphs, tmp_path):
    wav = write_wav(tmp_path / "clip-8k.wav", rate=8000)
    code, out, err = _cli("generate", str(speech_graphs("onert")), "--audio", str(wav))
    assert code == 2 and out == ""
    assert "sampled at 8000 Hz and the model hears 16000 Hz" in err and "resample" in err


def test_unknown_language_is_refused(speech_graphs, clip):
    gen = SpeechGenerator(speech_graphs("onert"), runtime="onert")
    with pytest.raises(SpeechInputError, match="'ja' is not one of the model's: de, en, es, fr"):
        gen.transcribe(clip, language="ja")


def test_audio_on_a_directory_that_is_not_speech_graphs(whisper_dir, clip, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    code, _, err = _cli("generate", str(whisper_dir), "--audio", str(clip))  # the model itself, not converted
    assert code == 2 and "is a Hugging Face model directory, not converted graphs" in err
    assert f"circleops convert {whisper_dir} --graphs encoder,prefill,decode" in err
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(llama))
    text = tmp_path / "text-graphs"
    assert main(["convert", str(llama), "--graphs", "prefill,decode", "--seq-len", "4", "--max-cache-len", "16",
                 "--target", "onert", "-q", "-o", str(text)]) == 0
    code, _, err = _cli("generate", str(text), "--audio", str(clip))
    assert code == 2 and "circleops-generate graphs (a text model: use --prompt)" in err
    code, _, err = _cli("generate", str(llama), "--audio", str(clip))
    assert code == 2 and "--audio needs the graphs of a Whisper-style speech model" in err
    code, _, err = _cli("convert", str(llama), "--graphs", "encoder,prefill,decode", "-o", str(tmp_path / "x"))
    assert code == 2 and "is not a Whisper directory" in err and not (tmp_path / "x").exists()


def test_prompt_on_speech_graphs_points_to_audio(speech_graphs):
    code, _, err = _cli("generate", str(speech_graphs("onert")), "--prompt", "hello")
    assert code == 2 and "--audio clip.wav" in err


def test_whisper_refuses_text_graph_lists(whisper_dir, tmp_path):
    code, _, err = _cli("convert", str(whisper_dir), "--graphs", "prefill,decode", "-o", str(tmp_path / "x"))
    assert code == 2 and "--graphs is encoder,prefill,decode" in err


def test_suppressed_tokens_are_applied_as_transformers_does(speech_graphs, clip, hf, tmp_path):
    """The manifest's suppress_tokens (every step) and begin_suppress_tokens (the first
    generated token only) change the tokens exactly as transformers' logits processors do:
    suppressing the model's own first and second choices here."""
    import shutil

    model, processor = hf
    plain = SpeechGenerator(speech_graphs("onert"), runtime="onert").transcribe(
        clip, language="en", max_new_tokens=NEW_TOKENS).tokens
    first, second = plain[0], plain[1]
    edited = tmp_path / "asr"
    shutil.copytree(speech_graphs("onert"), edited)
    manifest_json.edit(edited, {"begin_suppress_tokens": [first], "suppress_tokens": [second]})
    got = SpeechGenerator(edited, runtime="onert").transcribe(clip, language="en", max_new_tokens=NEW_TOKENS).tokens
    with torch.no_grad():
        want = model.generate(_hf_features(processor, clip), do_sample=False, max_new_tokens=NEW_TOKENS,
                              language="en", begin_suppress_tokens=[first], suppress_tokens=[second])[0].tolist()
    assert got == want
    assert got[0] != first and second not in got and got != plain


def test_without_max_new_tokens_it_stops_where_transformers_stops(speech_graphs, clip, hf):
    """No max_new_tokens: transformers generates up to max_target_positions tokens in all
    (start tokens included), and so does the generator (the cache holds every fed token)."""
    model, processor = hf
    gen = SpeechGenerator(speech_graphs("onert"), runtime="onert")
    result = gen.transcribe(clip, language="fr")
    with torch.no_grad():
        want = model.generate(_hf_features(processor, clip), do_sample=False, language="fr")[0].tolist()
    assert result.tokens == want
    eos = model.generation_config.eos_token_id
    assert want[-1] == eos or len(result.start_tokens) + len(want) == model.config.max_target_positions


def test_tflite_graphs_on_litert(speech_graphs, clip, hf):
    """--target tflite: the same graphs as TFLite files, run by LiteRT, the same tokens."""
    model, processor = hf
    gen = SpeechGenerator(speech_graphs("tflite"), runtime="litert")
    assert gen.manifest.files == {g: "model.tflite" for g in ("encoder", "prefill", "decode")}
    result = gen.transcribe(clip, language="en", max_new_tokens=NEW_TOKENS)
    assert result.tokens == _hf_tokens(model, _hf_features(processor, clip), language="en")


def test_a_clip_longer_than_the_window_is_cut_with_a_note(speech_graphs, hf, tmp_path):
    """Short-form only: 2.5 s into the tiny model's 1 s window is cut (as transformers' feature
    extractor cuts it), and stderr says so."""
    model, processor = hf
    long = write_wav(tmp_path / "long.wav", seconds=2.5)
    code, out, err = _cli("generate", str(speech_graphs("onert")), "--audio", str(long), "--language", "en",
                          "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0 and "only the first window is transcribed" in err
    want = _hf_tokens(model, _hf_features(processor, long), language="en")
    assert out == processor.tokenizer.decode(want, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("flags,message", [
    (("--quantize", "q8_0"), "--quantize do(es) not apply to speech graphs"),
    (("--dtype", "fp16"), "--dtype do(es) not apply to speech graphs"),
    (("--seq-len", "8"), "--seq-len do(es) not apply to speech graphs"),
])
def test_options_speech_graphs_do_not_take_are_refused(whisper_dir, tmp_path, flags, message):
    out = tmp_path / "asr"
    code, _, err = _cli("convert", str(whisper_dir), "--graphs", "encoder,prefill,decode", "--target", "circle",
                        *flags, "-o", str(out))
    assert code == 2 and message in err and not out.exists()


def test_output_must_be_a_directory(whisper_dir, tmp_path):
    code, _, err = _cli("convert", str(whisper_dir), "--graphs", "encoder,prefill,decode", "-o", str(tmp_path / "a.circle"))
    assert code == 2 and "-o names a directory" in err
