"""A tiny random Whisper saved the way a real checkpoint is: WhisperForConditionalGeneration
(save_pretrained), a WhisperProcessor (feature extractor + a byte-level BPE tokenizer with
Whisper's special tokens: no real Whisper tokenizer is on this machine and there is no hub),
and a generation_config.json with Whisper's lang_to_id / task_to_id / suppress tokens, so
``model.generate(input_features, language=..., task=...)`` runs as for openai/whisper-*."""
from __future__ import annotations

import json
import math
import wave
from pathlib import Path

import numpy as np

LANGUAGES = ("en", "fr", "de", "es")
SAMPLING_RATE = 16000


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def special_tokens() -> list[str]:
    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{lang}|>" for lang in LANGUAGES]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>"])


def save_tiny_whisper(path: str | Path, *, seed: int = 4, d_model: int = 64, max_target_positions: int = 64) -> Path:
    """Write the tiny Whisper into ``path`` and return it (seed 4: greedy tokens on
    write_wav's clip that do not repeat for 12 steps, and differ on silence)."""
    import torch
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    (path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(chars)}, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n")
    specials = special_tokens()
    tokenizer = WhisperTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), unk_token="<|endoftext|>",
                                 bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in specials}
    (path / "vocab.json").unlink()
    (path / "merges.txt").unlink()
    eos = ids["<|endoftext|>"]
    config = WhisperConfig(
        vocab_size=len(tokenizer), d_model=d_model, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model, num_mel_bins=20,
        max_source_positions=50, max_target_positions=max_target_positions, pad_token_id=eos, bos_token_id=eos,
        eos_token_id=eos, decoder_start_token_id=ids["<|startoftranscript|>"],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        # HF's init (std 0.02, the head tied to the token embeddings) makes a random Whisper
        # repeat one token whatever it hears. Token embeddings and an untied head of std 1
        # make each step depend on the previous token; larger encoder convolutions and
        # cross-attention values make the tokens depend on the audio (and the language
        # token): a wrong feature, cross K/V or start token then changes the tokens
        model.model.decoder.embed_tokens.weight.normal_(0.0, 1.0)
        model.proj_out.weight.normal_(0.0, 1.0)
        model.model.encoder.conv1.weight.normal_(0.0, 0.5)
        model.model.encoder.conv2.weight.normal_(0.0, 0.3)
        for layer in model.model.decoder.layers:
            layer.encoder_attn.v_proj.weight.normal_(0.0, 0.1)
            layer.encoder_attn.out_proj.weight.normal_(0.0, 0.1)
    lang_to_id = {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in LANGUAGES}
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        max_length=max_target_positions, is_multilingual=True, lang_to_id=lang_to_id,
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"], return_timestamps=False,
        suppress_tokens=[ord(c) for c in "\"#()*+/:;<=>@[\\]^_`{|}~"],
        begin_suppress_tokens=[ord(" "), eos])
    model.save_pretrained(str(path))
    # one second of audio is the whole window: 100 frames = 2 x max_source_positions
    extractor = WhisperFeatureExtractor(feature_size=20, sampling_rate=SAMPLING_RATE, hop_length=160, chunk_length=1,
                                        n_fft=400)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(path))
    return path


def write_wav(path: str | Path, *, seconds: float = 0.8, rate: int = SAMPLING_RATE, freq: float = 900.0) -> Path:
    """A 16-bit mono WAV of a chirp with a little noise."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.RandomState(0)
    x = 0.5 * np.sin(2 * math.pi * (freq + 300 * t) * t) + 0.05 * rng.randn(t.size)
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return Path(path)
