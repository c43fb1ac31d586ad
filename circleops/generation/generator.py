"""``circleops generate DIR --prompt TEXT``: generation with the written prefill and decode
graphs (``circleops convert MODEL --graphs prefill,decode``).

The prompt runs through the prefill graph (in chunks of its length when longer: any prompt
up to the cache length), which fills the KV caches; then the decode graph runs once per new
token with the caches passed in as numpy arrays. Graphs of manifest cache_update "rows"
(target onert's and tflite's) return only the step's new k/v rows, which the Generator
writes into its caches at the position in place; "full" ones return the whole updated
caches, which become the next step's inputs. Each runtime session is created
once and reused for every step, so a token costs one decode run: generation time grows
linearly with the number of new tokens. Greedy by default; a ``circleops.generation.sampling.Sampler``
draws tokens instead. The cache persists between calls (``keep_cache``, ``feed``), which
``circleops chat`` uses to continue a conversation without prefilling it again.

:class:`Generator` is the text kind of the generation core (circleops.generation.core: the
sessions, caches, chunk plan and loop); this module also gathers the names a text
generation uses (the runtime choice, the caches, the chunk plan, the tokenizer), which
are defined in the core's modules.

    from circleops.generation.generator import Generator
    gen = Generator("out/")                       # runtime from the manifest (onert for target onert)
    result = gen.generate([1, 2, 3], max_new_tokens=32)
    result.tokens, result.prefill_seconds, result.decode_tokens_per_second
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from circleops.errors import ModelLoadError
from circleops.generation.caches import cache_window, clear_slots, empty_caches, float_dtype, store_caches
from circleops.generation.chunks import (GGML_RUN_OVERHEAD, ONE_THREAD_RUN_OVERHEAD, PREFILL_RUN_OVERHEAD,
                                         plan_chunks)
from circleops.generation.core import (DEFAULT_MAX_NEW_TOKENS, CacheSpec, Generation, GenerationCore,
                                       GenerationLimitError, check_fits)
from circleops.generation.sessions import (GRAPH_THREAD_CAPS, check_runtime, choose_runtime, graph_threads, open_graph,
                                           text_graph_rows)
from circleops.generation.tokenizers import (FastTokenizer, TextStream, check_tokenizer_dir, encode_prompt, hf_tokenizer,
                                             load_tokenizer)
from circleops.options import HEAD_MAJOR, SLOT_MAJOR
from circleops.package.manifest import GRAPH_NAMES, MANIFEST, Manifest, read_manifest
from circleops.runtime import Session

__all__ = ["Generator", "generate", "Generation", "GenerationLimitError", "DEFAULT_MAX_NEW_TOKENS",
           "choose_runtime", "check_runtime", "graph_threads", "open_graph", "GRAPH_THREAD_CAPS",
           "empty_caches", "store_caches", "clear_slots", "cache_window", "plan_chunks", "PREFILL_RUN_OVERHEAD",
           "GGML_RUN_OVERHEAD", "ONE_THREAD_RUN_OVERHEAD", "TextStream", "FastTokenizer", "check_tokenizer_dir",
           "load_tokenizer", "hf_tokenizer", "encode_prompt", "SLOT_MAJOR", "HEAD_MAJOR"]


def _check_caches(manifest: Any, decode: Session) -> None:
    """ModelLoadError unless the decode graph takes the caches the manifest describes (a
    manifest's num_layers or cache_shape is what the caches are allocated from)."""
    import dataclasses
    from collections import Counter

    shapes = [tuple(spec.shape) for spec in decode.inputs]
    # one layer's (k, v) shapes times num_layers, counted: the manifest's own list of
    # 2 x num_layers shapes is not built before num_layers is known to be the graph's
    k, v = (tuple(s) for s in dataclasses.replace(manifest, num_layers=1).cache_shapes)
    want = Counter({k: 0, v: 0})
    want[k] += manifest.num_layers
    want[v] += manifest.num_layers
    got = Counter(s for s in shapes if s in want)
    if len(shapes) != len(manifest.inputs) or got != want:
        raise ModelLoadError(f"{manifest.directory}/{MANIFEST} does not describe its decode graph: it lists "
                             f"{len(manifest.inputs)} inputs and {2 * manifest.num_layers} caches of shapes "
                             f"{sorted(want)}, the graph takes {len(shapes)} inputs of shapes {shapes}. "
                             f"Convert again with --graphs.")


def _check_vocab(manifest: Any, sessions: Mapping[str, Session]) -> None:
    """ModelLoadError unless each graph's logits are ``manifest.vocab_size`` wide: the token
    ids are checked against that size before they reach a graph's embedding table."""
    for graph, session in sessions.items():
        shape = list(session.outputs[0].shape) if session.outputs else []
        if not shape or shape[-1] != manifest.vocab_size:
            raise ModelLoadError(f"{manifest.directory}/{MANIFEST} says vocab_size {manifest.vocab_size}, and the "
                                 f"{graph} graph's logits have shape {shape}. Convert again with --graphs.")


class Generator(GenerationCore):
    """Generation on the files a text manifest describes; sessions are created once.

    ``source``: the directory written by ``circleops convert --graphs`` (or its Manifest).
    ``runtime``: "onert", "reference" or "litert"; None takes the manifest's default
    (onert for target onert, litert for tflite, reference for circle; the reference
    interpreter for GGML weights on a CPU whose onert cannot run them: ``runtime_note``
    says so). ``threads``: the thread budget (each graph's count: :func:`graph_threads`;
    ``self.threads`` holds the plan), or {graph: count} honoured exactly.

    The KV cache persists between calls: :meth:`feed` appends tokens after the ones already
    in it (``history``), so a chat turn costs only its new tokens. A prompt runs through the
    prefill graphs (one or several lengths) in chunks (see :meth:`plan`), so any prompt up to
    the cache length works.
    """

    def __init__(self, source: Any, runtime: str | None = None, *, threads: int | Mapping[str, int] | None = None):
        m = source if isinstance(source, Manifest) else read_manifest(source)
        missing = [g for g in (*GRAPH_NAMES, *m.prefill_graphs.values(), *m.windowed_prefills, *m.windowed_decodes)
                   if g not in m.files]
        if missing:
            raise ModelLoadError(f"{m.directory} lacks the {' and '.join(missing)} graph: generation needs the "
                                 f"prefill and decode graphs. Convert with --graphs prefill,decode.")
        if m.text2text is not None:
            raise ModelLoadError(f"{m.directory} holds an encoder-decoder text model, whose decoder reads the "
                                 f"encoder's output: run it with circleops.generation.text2text.Text2TextGenerator "
                                 f"(circleops generate DIR --prompt TEXT).")
        if m.vision is not None and type(self).prefill_extras is Generator.prefill_extras:
            raise ModelLoadError(f"{m.directory} holds a vision-language model, whose prefill graphs also take image "
                                 f"embeddings: run it with circleops.generation.vision.VisionGenerator (circleops "
                                 f"generate DIR --image PATH --prompt TEXT).")
        # each graph at its own thread count (graph_threads: the budget, less where measured faster)
        self.open(m, runtime, threads, text_graph_rows(m))
        # length -> [(window W, session)], narrowest first: a chunk at pos <= W reads only slots < W
        for g, (n, w) in sorted(m.windowed_prefills.items(), key=lambda item: item[1][1]):
            self.window_sessions.setdefault(n, []).append((w, self.sessions[g]))
        # the caches are checked against the decode graph before their shapes are listed (a
        # manifest's num_layers of 10^12 would make that list itself a MemoryError)
        _check_caches(m, self.sessions["decode"])
        self.start(m.prefill_graphs, "decode", CacheSpec(m.cache_shapes, m.max_cache_len, m.cache_layout,
                                                         m.cache_update, float_dtype(m)), one_row=m.prefill_one_row)
        self.decode_windows = [(w, self.sessions[g]) for g, w in sorted(m.windowed_decodes.items(),
                                                                        key=lambda item: item[1])]
        _check_vocab(m, {**{g: self.prefill_sessions[n] for n, g in m.prefill_graphs.items()},
                         "decode": self.decode_session})


def generate(directory: str | Path, prompt: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
             runtime: str | None = None, stream: Any = None, chat: bool = False, sampler: Any = None,
             threads: int | Mapping[str, int] | None = None) -> Generation:
    """Greedy generation from the graphs in ``directory``.

    ``prompt``: text (tokenized with the saved tokenizer) or token ids. ``stream``: a file
    to write the text to as it is produced (needs the tokenizer). ``result.text`` holds the
    decoded new text when a tokenizer is there. ``threads``: as for :class:`Generator`.
    """
    manifest = read_manifest(directory)
    tokenizer = None
    if isinstance(prompt, str):
        tokenizer = load_tokenizer(manifest)
        ids = encode_prompt(tokenizer, prompt, chat, max_tokens=manifest.max_cache_len)
    else:
        ids = [int(i) for i in prompt]
        if manifest.tokenizer and stream is not None:
            tokenizer = load_tokenizer(manifest)
    check_fits(manifest.max_cache_len, 0, len(ids), max_new_tokens, manifest.directory,  # before any graph opens
               manifest.max_positions)
    gen = Generator(manifest, runtime=runtime, threads=threads)
    streamer = TextStream(tokenizer, stream) if tokenizer is not None and stream is not None else None
    result = gen.generate(ids, max_new_tokens, on_token=streamer, sampler=sampler)
    if streamer is not None:
        result.text = streamer.close()
    elif tokenizer is not None:
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result
