"""Whisper-style speech-to-text over a speech directory's graphs (``circleops generate DIR
--audio clip.wav``): the encoder once per clip, the prefill of the forced start tokens (which
also projects every layer's cross-attention K/V), then one decode step per token.

:class:`SpeechGenerator` is a kind of the generation core (circleops.generation.core): the
encoder's run and the start tokens prepare a request, the cross-attention K/V are the
request's constant inputs, Whisper's suppressed tokens are its logits processor and the end
token is not one of its output tokens; sessions, threads, caches, sampling and the loop
are the core's.

    from circleops.generation.speech import SpeechGenerator
    gen = SpeechGenerator("asr/")
    result = gen.transcribe("clip.wav", language="en")
    result.tokens, result.text
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from circleops.errors import ModelLoadError, RuntimeRunError
from circleops.generation.caches import HEADS_ROWS
from circleops.generation.core import CacheSpec, GenerationCore
from circleops.package.manifest import MANIFEST
from circleops.package.speech_manifest import (SPEECH_GRAPHS, SpeechInputError, SpeechManifest, check_extractor,
                                               read_speech_manifest)
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.user_files import users_processor

TASK_NAMES = ("transcribe", "translate")
DEFAULT_MAX_NEW_TOKENS = 64


def load_processor(path: Path) -> Any:
    """The WhisperProcessor saved in ``path`` (feature extractor and tokenizer), or None."""
    import contextlib
    import io

    from transformers import WhisperProcessor

    refuse_remote_code(path)  # before the except below, which takes any failure for "no processor"
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return WhisperProcessor.from_pretrained(str(path), trust_remote_code=False)
    except Exception:  # a directory with no processor: the graphs still convert
        return None


def read_audio(path: str | os.PathLike, sampling_rate: int) -> Any:
    """A WAV file (8/16/32-bit PCM, mono or mixed down) as float32 samples; a file at
    another rate than the model's is refused (resampling would change what it hears)."""
    from circleops.inputs.user_files import read_wav

    samples, rate = read_wav(str(path), error=RuntimeRunError)
    if rate != sampling_rate:
        raise SpeechInputError(f"{path} is sampled at {rate} Hz and the model hears {sampling_rate} Hz: resample it "
                               f"first (e.g. `sox {path} -r {sampling_rate} clip-{sampling_rate // 1000}k.wav`, or "
                               f"`ffmpeg -i {path} -ar {sampling_rate} clip-{sampling_rate // 1000}k.wav`).")
    return samples


@dataclass
class Transcription:
    """What :meth:`SpeechGenerator.generate` produced: the generated tokens as transformers'
    ``WhisperForConditionalGeneration.generate(...)[0]`` returns them (transformers 5: without
    the start tokens and without the end token; ``stopped_at_eos`` says whether the end token
    was reached), the start tokens it was given, the text, and where the time went."""

    tokens: list[int]
    start_tokens: list[int]
    text: str | None = None
    language: str | None = None  # the language token, given or detected
    encode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stopped_at_eos: bool = False

    def timing_line(self) -> str:
        steps = max(0, len(self.tokens) - 1)
        rate = f", {steps / self.decode_seconds:.1f} tokens/s" if steps and self.decode_seconds > 0 else ""
        return (f"circleops: encoder {self.encode_seconds * 1e3:.0f} ms, prefill of {len(self.start_tokens)} start "
                f"tokens {self.prefill_seconds * 1e3:.0f} ms, {len(self.tokens)} tokens decoded in "
                f"{self.decode_seconds:.2f} s{rate}")


class SpeechGenerator(GenerationCore):
    """Speech-to-text over a speech directory's graphs, as transformers'
    ``WhisperForConditionalGeneration.generate(input_features)`` decodes (short-form: one
    window): the same start tokens for ``language`` / ``task`` (the language detected from
    the first token's logits when the model is multilingual and none is given), the same
    suppressed tokens; greedy (``do_sample=False``: the same tokens), or drawn by a
    ``sampler``. One Session per graph, opened once; ``threads`` as for
    :class:`circleops.generation.generator.Generator`."""

    keep_stop_token = False  # transformers' Whisper generate leaves the end token out of its output

    def __init__(self, directory: str | os.PathLike | SpeechManifest, runtime: str | None = None, *,
                 threads: int | Mapping[str, int] | None = None):
        import numpy as np

        m = directory if isinstance(directory, SpeechManifest) else read_speech_manifest(directory)
        frames = m.cross_shape[2]
        # the rows each graph's matmuls run (its thread count): the encoder and the prefill
        # (which projects every layer's cross-attention K/V) over the T encoder frames
        self.open(m, runtime, threads, {"encoder": frames, "prefill": frames, "decode": 1})
        self._check_sessions()
        caches = CacheSpec([m.cache_shape] * (2 * m.num_layers), m.max_cache_len, HEADS_ROWS, "rows")
        self.start({m.prefill_len: "prefill"}, "decode", caches, one_row=True)
        self._suppress = [t for t in m.suppress_tokens if 0 <= t < m.vocab_size]
        self._begin = [t for t in m.begin_suppress_tokens if 0 <= t < m.vocab_size]
        self.states = np.zeros(0, np.float32)  # the encoder's output for the request (set by generate)
        self._processor: Any = None

    @property
    def note(self) -> str | None:
        """Why the default runtime changed, if it did (choose_runtime)."""
        return self.runtime_note

    def _check_sessions(self) -> None:
        m = self.manifest
        counts = {g: len(self.sessions[g].inputs) for g in SPEECH_GRAPHS}
        if counts["decode"] != 2 + 4 * m.num_layers:  # before any list is sized by num_layers
            raise ModelLoadError(f"{m.directory}/{MANIFEST} does not describe its decode graph: num_layers "
                                 f"{m.num_layers} means {2 + 4 * m.num_layers} inputs, the graph takes "
                                 f"{counts['decode']}. Convert again with --graphs encoder,prefill,decode.")
        want = {"encoder": [m.input_features], "prefill": [[1, m.prefill_len], [1], [1, m.cross_shape[2], m.cross_shape[1] * m.cross_shape[3]]],
                "decode": [[1, 1], [1]] + [m.cache_shape] * (2 * m.num_layers) + [m.cross_shape] * (2 * m.num_layers)}
        for g, shapes in want.items():
            got = [list(spec.shape) for spec in self.sessions[g].inputs]
            if got != shapes:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} does not describe its {g} graph: it takes inputs of "
                                     f"shapes {got}, the manifest says {shapes}. Convert again with --graphs "
                                     f"encoder,prefill,decode.")
        for g in ("prefill", "decode"):  # the ids are checked against vocab_size: it must be the graphs'
            logits = list(self.sessions[g].outputs[0].shape)
            if logits[-1:] != [m.vocab_size]:
                raise ModelLoadError(f"{m.directory}/{MANIFEST} says vocab_size {m.vocab_size}, and the {g} graph's "
                                     f"logits have shape {logits}. Convert again with --graphs encoder,prefill,decode.")

    @property
    def processor(self) -> Any:
        """The saved WhisperProcessor (feature extractor + tokenizer)."""
        if self._processor is None:
            if self.manifest.processor is None:
                raise ModelLoadError(f"{self.manifest.directory} has no processor (the model directory had no "
                                     f"preprocessor_config.json / tokenizer): pass input features and token ids "
                                     f"from Python (SpeechGenerator.generate).")
            self._processor = load_processor(self.manifest.directory / self.manifest.processor)
            if self._processor is None:
                raise ModelLoadError(f"cannot load the processor in {self.manifest.directory / self.manifest.processor}. "
                                     f"Convert again.")
        return self._processor

    def features(self, audio: str | os.PathLike | Any, *, warn: Callable[[str], None] | None = None) -> Any:
        """log-mel ``input_features [1, mel, frames]`` of a WAV file or of float samples at
        the model's rate, by the saved feature extractor (padded or cut to one window)."""
        import numpy as np

        extractor = self.processor.feature_extractor
        check_extractor(extractor, self.manifest)  # its window sizes the buffers: checked before any is made
        samples = read_audio(audio, extractor.sampling_rate) if isinstance(audio, (str, os.PathLike)) else audio
        samples = np.asarray(samples, dtype=np.float32)
        if warn is not None and samples.size > extractor.n_samples:
            warn(f"the audio is {samples.size / extractor.sampling_rate:.1f} s long and the model hears windows of "
                 f"{extractor.n_samples / extractor.sampling_rate:.1f} s: only the first window is transcribed "
                 f"(long-form transcription is not implemented)")
        with users_processor("feature extractor", self.manifest.directory / (self.manifest.processor or ""),
                             error=SpeechInputError):
            feats = extractor(samples, sampling_rate=extractor.sampling_rate, return_tensors="np")["input_features"]
        return np.asarray(feats, dtype=np.float32)

    def transcribe(self, audio: str | os.PathLike | Any, *, language: str | None = None, task: str | None = None,
                   max_new_tokens: int | None = None, on_token: Callable[[int], None] | None = None,
                   warn: Callable[[str], None] | None = None, sampler: Any = None) -> Transcription:
        """:meth:`generate` on the features of ``audio``, with the text decoded."""
        result = self.generate(self.features(audio, warn=warn), language=language, task=task,
                               max_new_tokens=max_new_tokens, on_token=on_token, sampler=sampler)
        result.text = self.processor.tokenizer.decode(result.tokens, skip_special_tokens=True)
        return result

    # ------------------------------------------------------------------ decoding

    def _language_id(self, language: str) -> int:
        m = self.manifest
        if not m.lang_to_id:
            raise SpeechInputError(f"{m.source or m.directory} is English-only (its generation config lists no "
                                   f"languages): drop --language.")
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        name = language.lower()
        token = (name if name in m.lang_to_id else f"<|{TO_LANGUAGE_CODE[name]}|>" if name in TO_LANGUAGE_CODE
                 else f"<|{name}|>")
        if token not in m.lang_to_id:
            codes = ", ".join(t.strip("<|>") for t in m.lang_to_id)
            raise SpeechInputError(f"language {language!r} is not one of the model's: {codes}.")
        return m.lang_to_id[token]

    def start_tokens(self, encoder_states: Any, language: str | None = None, task: str | None = None) -> list[int]:
        """The forced start tokens, by transformers' rules (WhisperGenerationMixin's
        _retrieve_init_tokens, short-form, no timestamps)."""
        import numpy as np

        m = self.manifest
        if task is not None and task not in TASK_NAMES:
            raise SpeechInputError(f"task {task!r}: Whisper's tasks are {', '.join(TASK_NAMES)}.")
        if not m.is_multilingual and (task is not None or language is not None):
            raise SpeechInputError(f"{m.source or m.directory} is English-only: it takes no --language or --task.")
        init: list[Any] = [m.decoder_start_token_id]
        if task is None and language is None:
            forced = sorted((int(i), t) for i, t in m.forced_decoder_ids)
            for k, (i, t) in enumerate(forced):
                if i != k + 1:
                    break
                init.append(None if t is None else int(t))
        undefined = len(init) <= 1 or init[1] is None
        lang: int | None = None
        if language is not None:
            lang = self._language_id(language)
        elif m.lang_to_id and undefined:
            logits = self._prefill([m.decoder_start_token_id], encoder_states, row=0)[0].reshape(-1)
            ids = sorted(m.lang_to_id.values())
            lang = ids[int(np.argmax(logits[ids]))]
        if lang is not None:
            if len(init) > 1:
                init[1] = lang
            else:
                init.append(lang)
        if task is not None:
            task_id = m.task_to_id.get(task)
            if task_id is None:
                raise SpeechInputError(f"the model's generation config has no task {task!r}.")
            if any(t in m.task_to_id.values() for t in init):
                init = [task_id if t in m.task_to_id.values() else t for t in init]
            else:
                init.append(task_id)
        elif language is not None and "transcribe" in m.task_to_id:
            if not any(t in m.task_to_id.values() for t in init):
                init.append(m.task_to_id["transcribe"])
        if m.no_timestamps_token_id is not None and init[-1] != m.no_timestamps_token_id:
            init.append(int(m.no_timestamps_token_id))
        init = [int(t) for t in init if t is not None]
        if len(init) > m.prefill_len:
            raise SpeechInputError(f"the start tokens {init} are more than the prefill graph's {m.prefill_len}.")
        return init

    def _prefill(self, tokens: Sequence[int], encoder_states: Any, row: int) -> list[Any]:
        """One run of the prefill graph on ``tokens`` (the caches untouched): language detection."""
        import numpy as np

        m = self.manifest
        ids = np.full((1, m.prefill_len), m.pad_token_id, dtype=np.int64)
        ids[0, :len(tokens)] = tokens
        return self.sessions["prefill"].run([ids, np.array([row], np.int64), encoder_states])

    # ------------------------------------------------------------------ the core's hooks

    def prefill_inputs(self, ids: Any, pos: int, row: int, caches: list[Any]) -> list[Any]:
        """Whisper's prefill starts a request at slot 0 and reads no cache: the start tokens,
        the row whose logits it returns and the encoder's states."""
        import numpy as np

        return [ids, np.array([row], np.int64), self.states]

    def prefill_outputs(self, outputs: Sequence[Any]) -> Sequence[Any]:
        """The start tokens' self-attention rows; every layer's cross-attention K/V, which
        the prefill computes once per clip, become the request's constant inputs (read by
        every decode step after its caches)."""
        import numpy as np

        rows = 2 * self.manifest.num_layers
        self.constants = [np.ascontiguousarray(c) for c in outputs[rows + 1:]]
        return outputs[1:rows + 1]

    def process_logits(self, logits: Any, step: int) -> Any:
        """transformers' SuppressTokensLogitsProcessor (every step) and
        SuppressTokensAtBeginLogitsProcessor (the first new token): those tokens get -inf."""
        import numpy as np

        scores = logits.astype(np.float32)
        scores[self._suppress] = -np.inf
        if step == 0:
            scores[self._begin] = -np.inf
        return scores

    def token_budget(self, prompt_len: int, max_new_tokens: Any) -> int:
        """``max_new_tokens`` (None: up to max_target_positions, as transformers), cut to what
        the cache holds."""
        m = self.manifest
        # transformers: at most max_target_positions tokens in all; the cache holds the fed ones
        limit = min(m.max_target_positions, m.max_cache_len + 1) - prompt_len
        return max(0, limit if max_new_tokens is None else min(int(max_new_tokens), limit))

    # ------------------------------------------------------------------ a request

    def generate(self, input_features: Any, *, language: str | None = None, task: str | None = None,
                 max_new_tokens: int | None = None, on_token: Callable[[int], None] | None = None,
                 sampler: Any = None) -> Transcription:  # type: ignore[override]
        """The tokens for ``input_features [1, mel, frames]``: greedy, or drawn by ``sampler``
        (a :class:`circleops.generation.sampling.Sampler`, over the suppressed logits);
        ``max_new_tokens`` (None: up to max_target_positions, as transformers) is cut to what
        the cache holds."""
        import numpy as np

        m = self.manifest
        feats = np.asarray(input_features, dtype=np.float32)
        if list(feats.shape) != m.input_features:
            raise SpeechInputError(f"input_features of shape {list(feats.shape)}; the encoder graph takes "
                                   f"{m.input_features} (one window of the model's feature extractor).")
        self.reset()
        t0 = time.perf_counter()
        self.states = self.sessions["encoder"].run([feats])[0]
        t1 = time.perf_counter()
        init = self.start_tokens(self.states, language, task)
        t2 = time.perf_counter()
        # the core's loop (GenerationCore.generate: this class's generate takes features)
        result = GenerationCore.generate(self, init, max_new_tokens, on_token=on_token, sampler=sampler,
                                         keep_cache=True)
        lang = next((k.strip("<|>") for k, v in m.lang_to_id.items() if v in init[1:2]), None)
        return Transcription(result.tokens, init, language=lang, encode_seconds=t1 - t0,
                             prefill_seconds=t2 - t1 + result.prefill_seconds, decode_seconds=result.decode_seconds,
                             stopped_at_eos=result.stopped_at_eos)
