"""Tiny random encoder-decoder models of each text family (tests/seq2seq), saved the way a
checkpoint is (save_pretrained + the tokenizer transformers builds offline: T5's and
mBART's unigram, BART's byte-level BPE; Marian's needs sentencepiece, so its ids are made
directly), and a greedy loop over circleops' step modules that applies the decoding rules
transformers' generate applies (decoder start, forced BOS, forced EOS at the last step).

The weights are redrawn wider than the default init (std 0.02 gives a random model that
repeats one token whatever it reads): token embeddings and heads of std 1, so each step
depends on the previous token and the source, and a wrong position, bias or mask changes
the tokens."""
from __future__ import annotations

import json
import os
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "speech"))

from tiny_whisper import _bytes_to_unicode  # noqa: E402  (GPT-2's byte table: BART's byte-level BPE)

WORDS = ("translate English to German French summarize : the a house is small big cat dog and on of "
         "wonderful green old new river city walks runs sees quickly").split()
PROMPT = ("translate English to German: the old house on the river is small and green, and the big dog "
          "sees the cat.")
FAMILIES = ("t5", "t5-v1_1", "bart", "mbart", "marian")
# decoding rules of the generation configs real checkpoints ship (BART-CNN: min_length,
# no_repeat_ngram_size; Marian: the pad token as a bad word): transformers' greedy generate
# applies them as logits processors, and they keep a random model from repeating one token
RULES = {"t5": {"no_repeat_ngram_size": 2}, "t5-v1_1": {"no_repeat_ngram_size": 3, "min_length": 6},
         "bart": {"no_repeat_ngram_size": 3, "min_length": 4}, "marian": {"no_repeat_ngram_size": 2}}


def _unigram_pieces(specials: list[str]) -> list[tuple[str, float]]:
    return ([(t, 0.0) for t in specials] + [("▁" + w, -1.0) for w in WORDS]
            + [(c, -5.0) for c in string.ascii_letters + string.digits + ".,:!?'-"] + [("▁", -3.0)])


def _tokenizer(family: str, root: Path) -> Any:
    from transformers import BartTokenizer, MBartTokenizer, T5Tokenizer

    if family.startswith("t5"):
        return T5Tokenizer(vocab=_unigram_pieces(["<pad>", "</s>", "<unk>"]), extra_ids=4)
    if family == "mbart":
        return MBartTokenizer(vocab=_unigram_pieces(["<s>", "<pad>", "</s>", "<unk>"]), src_lang="en_XX",
                              tgt_lang="de_DE")
    if family == "bart":
        chars = _bytes_to_unicode()
        vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + chars)}
        (root / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        (root / "merges.txt").write_text("#version: 0.2\n")
        tok = BartTokenizer(str(root / "vocab.json"), str(root / "merges.txt"))
        (root / "vocab.json").unlink()
        (root / "merges.txt").unlink()
        return tok
    return None  # marian: sentencepiece is not installed


def _config(family: str, vocab: int, tok: Any) -> Any:
    from transformers import BartConfig, MarianConfig, MBartConfig, T5Config

    if family.startswith("t5"):
        gated = family == "t5-v1_1"
        return T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=24,
                        feed_forward_proj="gated-gelu" if gated else "relu", tie_word_embeddings=not gated,
                        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    common = dict(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    if family == "bart":
        return BartConfig(**common, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                          forced_eos_token_id=2, scale_embedding=False)
    if family == "mbart":
        return MBartConfig(**common, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                           forced_eos_token_id=2, scale_embedding=True)
    return MarianConfig(**common, pad_token_id=vocab - 1, eos_token_id=0, decoder_start_token_id=vocab - 1,
                        forced_eos_token_id=0, scale_embedding=True, share_encoder_decoder_embeddings=True)


def _model(family: str, config: Any, seed: int) -> Any:
    from transformers import (BartForConditionalGeneration, MarianMTModel, MBartForConditionalGeneration,
                              T5ForConditionalGeneration)

    cls = {"bart": BartForConditionalGeneration, "mbart": MBartForConditionalGeneration,
           "marian": MarianMTModel}.get(family, T5ForConditionalGeneration)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and not (family == "marian" and "embed_positions" in name):
                fan_in = p.shape[1] if "embed" not in name and "shared" not in name and "relative" not in name else 1
                p.normal_(0.0, (4.0 if "position" in name or "relative" in name else 1.5) / fan_in ** 0.5)
    return model


@dataclass
class TinySeq2Seq:
    family: str
    directory: Path
    model: Any
    tokenizer: Any  # None for Marian
    forced_bos: int | None = None  # mBART: the target language code

    def source_ids(self, text: str = PROMPT) -> list[int]:
        if self.tokenizer is None:  # Marian: ids of the words, then EOS
            g = torch.Generator().manual_seed(len(text))
            n = len(text.split()) + 4
            return torch.randint(1, self.model.config.vocab_size - 1, (n,), generator=g).tolist() + [0]
        return self.tokenizer(text).input_ids

    def hf_greedy(self, ids: list[int], new: int, decoder_prefix: list[int] | None = None) -> list[int]:
        kw = {"forced_bos_token_id": self.forced_bos} if self.forced_bos is not None else {}
        if decoder_prefix is not None:
            kw["decoder_input_ids"] = torch.tensor([decoder_prefix])
        with torch.no_grad():
            out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False, num_beams=1,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
        return out[0].tolist()


def save_tiny(family: str, root: Path, seed: int = 0) -> TinySeq2Seq:
    root.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(family, root)
    vocab = len(tok) if tok is not None else 300
    model = _model(family, _config(family, vocab, tok), seed)
    rules = {**RULES.get(family, {}), **({"bad_words_ids": [[vocab - 1]]} if family == "marian" else {})}
    for name, value in rules.items():  # saved in generation_config.json
        setattr(model.generation_config, name, value)
    model.save_pretrained(str(root))
    if tok is not None:
        tok.save_pretrained(str(root))
    forced = tok.convert_tokens_to_ids("de_DE") if family == "mbart" else None
    return TinySeq2Seq(family, root, model, tok, forced)


@dataclass
class Steps:
    """circleops' three modules of one model: what the encoder, prefill and decode graphs
    are exported from."""

    encoder: Any
    prefill: Any
    decode: Any
    source_len: int
    prefill_len: int

    @classmethod
    def of(cls, model: Any, *, source_len: int = 48, prefill_len: int = 4, cache_len: int = 64) -> "Steps":
        from circleops.adapters.seq2seq import Seq2SeqDecoderStep, Seq2SeqEncoder

        return cls(Seq2SeqEncoder(model, source_len), Seq2SeqDecoderStep(model, cache_len, one_row=True),
                   Seq2SeqDecoderStep(model, cache_len), source_len, prefill_len)


def write_rows(caches: list[torch.Tensor], rows: tuple[torch.Tensor, ...], pos: int, count: int) -> None:
    """The generator's part of the "rows" cache update: the first ``count`` new rows at ``pos``."""
    for cache, row in zip(caches, rows):
        cache[:, :, pos:pos + count] = row[:, :, :count]


def greedy(steps: Steps, model: Any, ids: list[int], new: int, prefix: list[int] | None = None,
           forced_bos: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding through the step modules, with generate's rules: the decoder prompt is
    ``prefix`` (default: decoder_start_token_id), run in prefill chunks; forced BOS at the
    first new token, forced EOS at the last (max_length), stop at EOS. Returns (the decoder
    sequence, the logits of every new token)."""
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, int) else gen.eos_token_id[0]
    tokens = list(prefix) if prefix else [gen.decoder_start_token_id]
    max_length = len(tokens) + new
    pad = gen.pad_token_id or 0
    with torch.no_grad():
        cross = steps.encoder(torch.tensor([ids + [pad] * (steps.source_len - len(ids))]), torch.tensor([len(ids)]))
        caches = steps.prefill.empty_caches()
        n = torch.tensor([len(ids)])
        pos, p = 0, steps.prefill_len
        while pos < len(tokens):
            chunk = tokens[pos:pos + p]
            out = steps.prefill(torch.tensor([chunk + [pad] * (p - len(chunk))]), torch.tensor([pos]),
                                torch.tensor([len(chunk) - 1]), n, *caches, *cross)
            write_rows(caches, out[1:], pos, len(chunk))
            pos += len(chunk)
        logits, seen = out[0][0, -1], []
        while True:
            seen.append(logits)
            nxt = int(logits.argmax())
            if forced_bos is not None and len(tokens) == 1:
                nxt = forced_bos
            if gen.forced_eos_token_id is not None and len(tokens) == max_length - 1:
                nxt = gen.forced_eos_token_id
            tokens.append(nxt)
            if nxt == eos or len(tokens) >= max_length:
                return tokens, seen
            out = steps.decode(torch.tensor([[nxt]]), torch.tensor([pos]), n, *caches, *cross)
            write_rows(caches, out[1:], pos, 1)
            pos += 1
            logits = out[0][0, -1]
