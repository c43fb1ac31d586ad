"""Text-to-text generation (T5, BART, mBART, Marian) over the graphs of ``circleops convert
DIR --graphs encoder,prefill,decode`` (``circleops generate DIR --prompt TEXT``): the encoder
once per source, then the decoder's prompt (its start token, or a prefix) through the prefill
graphs and one decode step per token.

:class:`Text2TextGenerator` is a kind of the generation core (circleops.generation.core): the
encoder's run prepares a request, its cross-attention K/V are the request's constant inputs
(fed after the caches to every step), the source's length is an input of every step after
its ids and pos, and the decoding rules of the model's generation config (forced first and
last tokens, suppressed tokens, min_length, no_repeat_ngram_size: transformers' logits
processors) are its ``process_logits``; sessions, threads, caches, the chunk plan, sampling
and the loop are the core's.

    from circleops.generation.text2text import Text2TextGenerator
    gen = Text2TextGenerator("t5/")
    result = gen.translate("translate English to German: The house is small.")
    result.tokens, result.text
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Sequence

from circleops.errors import ModelLoadError
from circleops.generation.core import DEFAULT_MAX_NEW_TOKENS, CacheSpec, Generation, GenerationCore, \
    GenerationLimitError
from circleops.generation.sessions import text_graph_rows
from circleops.inputs.token_ids import check_token_ids
from circleops.options import HEADS_ROWS
from circleops.package.manifest import MANIFEST, Manifest, read_manifest
from circleops.package.text2text_manifest import TEXT2TEXT_GRAPHS, Text2TextSpec


class Text2TextGenerator(GenerationCore):
    """Generation on a text-to-text directory's graphs, as transformers'
    ``generate(input_ids, do_sample=False, num_beams=1)`` decodes (or drawn by a sampler).
    ``runtime`` and ``threads`` as for :class:`circleops.generation.generator.Generator`."""

    def __init__(self, source: str | os.PathLike | Manifest, runtime: str | None = None, *,
                 threads: int | Mapping[str, int] | None = None):
        import numpy as np

        m = source if isinstance(source, Manifest) else read_manifest(source)
        if m.text2text is None:
            raise ModelLoadError(f"{m.directory} holds a decoder-only model (its manifest has no encoder): generate "
                                 f"from it with circleops.generation.generator.Generator.")
        self.spec = spec = Text2TextSpec.from_json(m.text2text, m.directory / MANIFEST, m.vocab_size)
        missing = [g for g in (spec.encoder, *m.prefill_graphs.values(), "decode") if g not in m.files]
        if missing:
            raise ModelLoadError(f"{m.directory} lacks the {' and '.join(missing)} graph. Convert again with --graphs "
                                 f"{','.join(TEXT2TEXT_GRAPHS)}.")
        # the encoder's matmuls run over the T source positions: its thread count as a prefill's
        self.open(m, runtime, threads, {spec.encoder: spec.source_len, **text_graph_rows(m)})
        self._check_sessions()
        self.start(m.prefill_graphs, "decode", CacheSpec(m.cache_shapes, m.max_cache_len, HEADS_ROWS, "rows"),
                   one_row=True)
        self._length = np.zeros(1, dtype=np.int64)  # the source's length: every step's input after ids and pos
        self.step_extras = [self._length]
        self.forced_bos = spec.forced_bos_token_id
        self._prompt_len = 0
        self._budget = 0

    def _check_sessions(self) -> None:
        """ModelLoadError unless every graph takes the inputs the manifest describes (the
        caches and cross K/V are sized from it) and returns logits of vocab_size."""
        m, spec = self.manifest, self.spec
        n = m.num_layers
        caches, cross = [list(s) for s in m.cache_shapes], [list(spec.cross_shape)] * (2 * n)
        want = {spec.encoder: [[1, spec.source_len], [1]], "decode": [[1, 1], [1], [1], *caches, *cross]}
        for size, g in m.prefill_graphs.items():
            want[g] = [[1, size], [1], [1], [1], *caches, *cross]
        for g, shapes in want.items():
            got = [list(s.shape) for s in self.sessions[g].inputs]
            if got != shapes:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} does not describe its {g} graph: it takes inputs of "
                                     f"shapes {got}, the manifest says {shapes}. Convert again with --graphs "
                                     f"{','.join(TEXT2TEXT_GRAPHS)}.")
        for g in want:
            if g != spec.encoder and list(self.sessions[g].outputs[0].shape)[-1:] != [m.vocab_size]:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} says vocab_size {m.vocab_size}, and the {g} graph's "
                                     f"logits do not. Convert again with --graphs {','.join(TEXT2TEXT_GRAPHS)}.")

    # ------------------------------------------------------------------ the core's hooks

    def prefill_extras(self, ids: Any, pos: int) -> list[Any]:
        """The source's length, after a chunk's ids, pos and logits row."""
        return [self._length]

    def token_budget(self, prompt_len: int, max_new_tokens: Any) -> int:
        """``max_new_tokens``, which must fit the cache; remembered for the forced last token."""
        self.check_fits(prompt_len, max_new_tokens)
        self._prompt_len, self._budget = prompt_len, int(max_new_tokens)
        return self._budget

    def process_logits(self, logits: Any, step: int) -> Any:
        """transformers' logits processors of the model's generation config, on the
        ``step``-th new token (the decoder sequence so far is :attr:`history`): no repeated
        n-gram, suppressed tokens, no EOS before min_length, the forced first token (a
        decoder sequence of one token) and the forced last one (the last of max_new_tokens)."""
        import numpy as np

        spec, seq = self.spec, self.history
        scores = np.array(logits, dtype=np.float32)
        if spec.no_repeat_ngram_size:
            scores[banned_ngram_tokens(seq, spec.no_repeat_ngram_size)] = -np.inf
        if spec.suppress_tokens:
            scores[spec.suppress_tokens] = -np.inf
        if len(seq) < spec.min_length:
            scores[self.manifest.eos_token_ids] = -np.inf
        forced = None
        if self.forced_bos is not None and len(seq) == 1:
            forced = self.forced_bos
        if spec.forced_eos_token_id is not None and step == self._budget - 1:
            forced = spec.forced_eos_token_id
        if forced is not None:
            scores[:] = -np.inf
            scores[forced] = 0.0
        return scores

    # ------------------------------------------------------------------ a request

    def encode(self, source_ids: Sequence[int]) -> None:
        """Run the encoder on ``source_ids`` (the source, at most ``source_len`` tokens): its
        cross-attention K/V become the request's constant inputs."""
        import numpy as np

        m, spec = self.manifest, self.spec
        ids = check_token_ids(source_ids, m.vocab_size, "the source", error=GenerationLimitError)
        if not 1 <= len(ids) <= spec.source_len:
            raise GenerationLimitError(
                f"the source is {len(ids)} tokens and the encoder graph in {m.directory} takes 1 to "
                f"{spec.source_len}: shorten it, or convert again with --input-shape input_ids=1x{max(1, len(ids))}.")
        buf = np.full((1, spec.source_len), m.pad_token_id, dtype=np.int64)
        buf[0, :len(ids)] = ids
        self._length[0] = len(ids)
        self.constants = [np.ascontiguousarray(c) for c in self.sessions[spec.encoder].run([buf, self._length])]

    def generate(self, source_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,  # type: ignore[override]
                 decoder_prefix: Sequence[int] | None = None, forced_bos_token_id: int | None = None,
                 on_token: Callable[[int], None] | None = None, sampler: Any = None) -> Generation:
        """The new tokens for ``source_ids``: the encoder once, then the decoder from
        ``decoder_prefix`` (default: the start token; a longer one goes through the prefill
        graphs in chunks). ``forced_bos_token_id``: the first generated token (mBART's target
        language; default: the model's generation config's). Greedy, or drawn by ``sampler``
        after the decoding rules; stops after EOS (kept in ``tokens``, as transformers)."""
        prefix = list(decoder_prefix) if decoder_prefix is not None else [self.spec.decoder_start_token_id]
        prefix = check_token_ids(prefix, self.manifest.vocab_size, "the decoder prefix", error=GenerationLimitError)
        if forced_bos_token_id is not None:
            check_token_ids([forced_bos_token_id], self.manifest.vocab_size, "the forced first token",
                            error=GenerationLimitError)
        self.forced_bos = self.spec.forced_bos_token_id if forced_bos_token_id is None else int(forced_bos_token_id)
        self.reset()
        self.check_fits(len(prefix), max_new_tokens)  # before the encoder runs
        t = time.perf_counter()
        self.encode(source_ids)
        encoded = time.perf_counter() - t
        result = GenerationCore.generate(self, prefix, max_new_tokens, keep_cache=True, on_token=on_token,
                                         sampler=sampler)
        result.prefill_seconds += encoded  # the first token's time includes the encoder's
        return result

    def translate(self, text: str, tokenizer: Any, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                  **kwargs: Any) -> Generation:
        """:meth:`generate` on ``tokenizer(text)``, with the new text decoded (special tokens skipped)."""
        from circleops.generation.tokenizers import encode_prompt

        result = self.generate(encode_prompt(tokenizer, text), max_new_tokens, **kwargs)
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        return result


def banned_ngram_tokens(seq: Sequence[int], n: int) -> list[int]:
    """The tokens that would repeat an n-gram of ``seq`` (transformers' NoRepeatNGramLogitsProcessor)."""
    if len(seq) + 1 < n:
        return []
    tail = tuple(seq[len(seq) - n + 1:]) if n > 1 else ()
    return [seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i:i + n - 1]) == tail]


def generate(directory: str | os.PathLike, source: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             *, runtime: str | None = None, stream: Any = None, sampler: Any = None,
             language: str | None = None, threads: int | Mapping[str, int] | None = None) -> Generation:
    """Text-to-text generation with the graphs in ``directory``: ``source`` is text (tokenized
    with the saved tokenizer) or token ids; ``language``: a target-language token forced
    first (mBART's ``de_DE``); ``stream``: a file the text is written to as it comes;
    ``result.text`` holds the new text when a tokenizer is there."""
    from circleops.generation.tokenizers import TextStream, encode_prompt, load_tokenizer

    gen = Text2TextGenerator(directory, runtime=runtime, threads=threads)
    tokenizer = load_tokenizer(gen.manifest) if isinstance(source, str) or gen.manifest.tokenizer else None
    ids = encode_prompt(tokenizer, source) if isinstance(source, str) else [int(i) for i in source]
    forced = language_token(tokenizer, language, gen.manifest) if language is not None else None
    streamer = TextStream(tokenizer, stream) if tokenizer is not None and stream is not None else None
    result = gen.generate(ids, max_new_tokens, forced_bos_token_id=forced, on_token=streamer, sampler=sampler)
    if streamer is not None:
        result.text = streamer.close()
    elif tokenizer is not None:
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result


def language_token(tokenizer: Any, language: str, manifest: Manifest) -> int:
    """The id of the target-language token ``language`` (mBART's ``de_DE``, ``<2de>``...) in
    the saved tokenizer; GenerationLimitError when it has none of that name."""
    from circleops.generation.tokenizers import hf_tokenizer

    if tokenizer is None:
        raise GenerationLimitError(f"{manifest.directory} has no tokenizer to look up the language {language!r} in.")
    tok = hf_tokenizer(tokenizer.directory) if hasattr(tokenizer, "directory") else tokenizer
    token = tok.convert_tokens_to_ids(language)
    if not isinstance(token, int) or token == getattr(tok, "unk_token_id", None) or not 0 <= token < manifest.vocab_size:
        raise GenerationLimitError(f"--language {language}: the tokenizer of {manifest.directory} has no token "
                                   f"{language!r} (a target-language code such as mBART's de_DE or fr_XX).")
    return int(token)
