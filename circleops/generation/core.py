"""The generation core: one loop over a written set of graphs, whatever the model kind.

A kind (text: :class:`circleops.generation.generator.Generator`, image + prompt:
:class:`circleops.generation.vision.VisionGenerator`, Whisper:
:class:`circleops.generation.speech.SpeechGenerator`) reads its manifest, names its graphs
and supplies only what differs, through the hooks below; the core owns the rest:

* sessions: one per graph, opened once at its own thread count (:meth:`GenerationCore.open`,
  circleops.generation.sessions.graph_threads);
* the self-attention caches (circleops.generation.caches: "rows" or "full" updates, the
  layouts) and the per-request constant inputs (:attr:`GenerationCore.constants`: e.g. an
  encoder's cross-attention K/V, fed after the caches to every step);
* the chunk plan of a prompt over the prefill graphs (circleops.generation.chunks);
* the loop: greedy or a :class:`circleops.generation.sampling.Sampler`, the stop rules,
  streaming (``on_token``) and timings (:class:`Generation`).

The hooks, with the text model's behaviour as their default:

=========================  ===============================================================
``prefill_inputs``         a prefill run's inputs (ids, pos, row, ``prefill_extras``,
                           caches, constants)
``prefill_extras``         inputs after a chunk's ids/pos/row (a VLM's image embeddings)
``prefill_outputs``        the cache outputs of a prefill run (what else it returns, e.g.
                           Whisper's cross K/V, the kind keeps as :attr:`constants`)
``step_extras``            inputs of every decode step after ids and pos (a list)
``plan``                   the prefill runs of a prompt (a prefix-LM's prefix in one run)
``process_logits``         the logits a token is chosen from (Whisper's suppressed tokens)
``token_budget``           how many tokens a request may generate (refuse or cut)
``keep_stop_token``        whether the stop token is one of the output tokens
=========================  ===============================================================

A request that needs work before its prompt (an encoder run, image embeddings) does it
after :meth:`GenerationCore.reset` and calls :meth:`GenerationCore.generate` with
``keep_cache=True`` (CONTRIBUTING.md, "How to add a generation kind").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from circleops.errors import CircleOpsError
from circleops.generation.caches import WindowStore, cache_window, clear_slots, store_caches, write_rows, zero_caches
from circleops.generation.chunks import (GGML_RUN_OVERHEAD, ONE_THREAD_RUN_OVERHEAD, PREFILL_RUN_OVERHEAD,
                                         plan_chunks)
from circleops.generation.sessions import choose_runtime, graph_threads, open_graph
from circleops.inputs.token_ids import check_token_ids
from circleops.runtime import Session

DEFAULT_MAX_NEW_TOKENS = 64


class GenerationLimitError(CircleOpsError):
    """The prompt or the generation does not fit the graphs' prefill length or cache."""


@dataclass
class Generation:
    """The result of one generation."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included when it stopped there (text)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # decode graph runs (the first new token comes from the prefill)
    prefill_runs: int = 0  # prefill graph runs for the prompt (chunks)
    prefill_chunks: list[int] = field(default_factory=list)  # the length of each prefill run
    stopped_at_eos: bool = False
    runtime: str = ""
    cache_io: str = ""  # how the decode steps' caches reached the runtime: "in place", "copied", "" (GenerationCore.cache_io)
    text: str | None = None

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def timing_line(self, prefill_len: int | None = None) -> str:
        chunks = self.prefill_chunks or ([prefill_len] * self.prefill_runs if prefill_len else [])
        if len(set(chunks)) > 1:
            how = f"runs of {' + '.join(map(str, chunks))} positions"
        elif chunks:
            how = f"graph length {chunks[0]}{f', {len(chunks)} runs' if len(chunks) > 1 else ''}"
        else:
            how = "decode graph"
        line = (f"circleops generate [{self.runtime}]: prefill {len(self.prompt_ids)}-token prompt "
                f"({how}) in {self.prefill_seconds:.3f} s; ")
        if self.decode_steps:
            line += (f"decode {self.decode_steps} tokens in {self.decode_seconds:.2f} s = "
                     f"{self.decode_tokens_per_second:.1f} tokens/s ({1000 * self.decode_seconds / self.decode_steps:.1f} "
                     f"ms/token{f', KV caches {self.cache_io}' if self.cache_io else ''})")
        else:
            line += "no decode steps"
        return line + (f"; stopped at EOS after {len(self.tokens)} new tokens" if self.stopped_at_eos else "")


def check_fits(slots: int, used: int, prompt_len: int, max_new_tokens: Any, directory: Any,
               max_positions: int | None = None) -> None:
    """GenerationLimitError unless a prompt of ``prompt_len`` tokens plus ``max_new_tokens``
    fit a cache of ``slots`` with ``used`` of them taken (the files in ``directory``). Needs no
    session: a CLI refuses before it opens a model's graphs (seconds for a 1B model's files).
    ``max_positions`` (the model's, from the manifest) decides whether a longer cache could help:
    past them the error names the model's limit instead of a conversion that would be refused."""
    if prompt_len < 1:
        raise GenerationLimitError("the prompt is empty: give at least one token.")
    if max_new_tokens < 0:
        raise GenerationLimitError(f"--max-new-tokens must be 0 or more, got {max_new_tokens}.")
    need = used + prompt_len + max_new_tokens
    if need > slots:
        before = f"the {used} tokens already in the cache, " if used else ""
        room = max(0, slots - used - prompt_len)
        if max_positions is not None and need > max_positions:
            longest = max(0, max_positions - used - prompt_len)
            advice = (f"; the model has {max_positions} positions (max_position_embeddings), so no cache holds "
                      f"{need} tokens" + (f": convert again with --max-cache-len {max_positions} for at most {longest} "
                                          f"new tokens." if max_positions > slots else "."))
        else:
            advice = f", or convert again with --max-cache-len {need} or more."
        raise GenerationLimitError(
            f"{before}the prompt ({prompt_len} token{'' if prompt_len == 1 else 's'}) plus --max-new-tokens "
            f"{max_new_tokens} is {need} tokens, more than the {slots} slots of the KV cache in {directory}. "
            f"Generate at most {room} new tokens{advice}")


@dataclass(frozen=True)
class CacheSpec:
    """The self-attention caches of a kind's graphs: each array's shape (k caches, then v
    caches), the tokens they hold, their layout and how the graphs return them
    (circleops.generation.caches)."""

    shapes: list[list[int]]
    slots: int
    layout: str
    update: str  # "rows" or "full"
    dtype: str = "float32"  # the caches' numpy dtype: the graphs' float type (float16 for --dtype fp16)


class GenerationCore:
    """Sessions, caches, the chunk plan and the generation loop over one set of graphs; a
    kind subclasses it, reads its manifest, calls :meth:`open` and sets what :meth:`open`
    documents. The KV cache persists between calls: :meth:`feed` appends tokens after the ones
    already in it (``history``), so a chat turn costs only its new tokens."""

    keep_stop_token = True  # the stop token is one of the output tokens (transformers' text generate)
    # decode steps write their new cache rows straight into the runtime's input memory where
    # it gives it (LiteRT: WindowStore); False: every step copies its cache window (the path
    # runtimes without it take), kept to compare the two
    caches_in_place = True
    manifest: Any
    runtime: str
    runtime_note: str | None
    threads: dict[str, int | None]
    sessions: dict[str, Session]

    def open(self, manifest: Any, runtime: str | None, threads: int | Mapping[str, int] | None,
             rows: Mapping[str, int]) -> None:
        """Choose the runtime (circleops.generation.sessions.choose_runtime), plan each graph's
        threads over ``rows`` (graph -> rows its matmuls run; few rows run fewer threads) and
        open one session per graph in ``self.sessions``. The kind then sets
        ``prefill_graphs`` ({length: graph}, longest first), ``decode_graph``, ``cache``
        (a :class:`CacheSpec`) and ``one_row`` (a prefill returns one row's logits), and
        calls :meth:`start`."""
        import numpy as np

        self.manifest = manifest
        self.runtime, self.runtime_note = choose_runtime(manifest, runtime)
        self.threads = graph_threads(manifest, self.runtime, threads, rows)
        self.sessions = {g: open_graph(manifest, g, self.runtime, threads=self.threads[g]) for g in rows}
        self._np = np
        self._ids = np.zeros((1, 1), dtype=np.int64)
        self._pos = np.zeros(1, dtype=np.int64)
        self.window_sessions: dict[int, list[tuple[int, Session]]] = {}
        # [(window W, decode session)], narrowest first: a step at pos <= W reads only slots < W
        self.decode_windows: list[tuple[int, Session]] = []
        self.step_extras: list[Any] = []  # decode inputs after ids and pos, per request
        self.constants: list[Any] = []  # inputs after the caches, per request (cross-attention K/V)

    def start(self, prefill_graphs: Mapping[int, str], decode_graph: str, cache: CacheSpec, one_row: bool) -> None:
        """The graphs' roles (see :meth:`open`); empty caches and history."""
        self.prefill_graphs = dict(prefill_graphs)
        self.prefill_sessions = {n: self.sessions[g] for n, g in self.prefill_graphs.items()}
        self.decode_session = self.sessions[decode_graph]
        self.cache, self.one_row = cache, one_row
        self.max_cache_len = cache.slots
        self._caches: list[Any] = []
        self.history: list[int] = []  # the tokens whose keys/values fill cache slots 0..len-1
        self._written = 0  # cache slots 0.._written-1 may be non-zero (padding rows included)
        # the decode sessions' input memory holding the caches' window (cache_update "rows" only)
        self._store = WindowStore(cache.layout) if cache.update == "rows" else None
        self._checked: dict[int, Session] = {}  # id -> decode session whose cache rows were checked once
        self._logits_shared = False  # the last step's logits are its session's output memory (_step)
        self.prefill_runs = 0  # runs of the prefill graphs so far (chunks)
        self.chunks: list[int] = []  # the length of each of those runs

    @property
    def caches(self) -> list[Any]:
        """The self-attention caches (k caches then v caches, numpy, in the cache layout), whole:
        rows a decode step left in a LiteRT session's own input memory are copied in first
        (:meth:`WindowStore.flush`). The decode loop itself reads ``_caches``."""
        store = getattr(self, "_store", None)
        if store is not None:
            store.flush()
        return self._caches

    @caches.setter
    def caches(self, value: list[Any]) -> None:
        store = getattr(self, "_store", None)
        if store is not None:
            store.flush()  # into the arrays they belong to, before those are replaced
        self._caches = value

    @property
    def prefill_session(self) -> Session:
        """The session of the longest prefill graph."""
        return self.prefill_sessions[max(self.prefill_sessions)]

    @property
    def position(self) -> int:
        """Cache slots holding real tokens (the next token's position)."""
        return len(self.history)

    def reset(self) -> None:
        """Forget the conversation: the next feed starts at slot 0 with empty caches."""
        self.history = []
        if self.caches and self.cache.update == "rows":
            # the same arrays, the written slots zeroed in place: new ones for every prompt
            # (60 x 393 KB for SmolLM2, page faults included) cost 9-10 ms of CPU per prompt
            # on onert (bench/llm_profile.py), a tenth of a 5-token prompt's prefill at q4_0
            clear_slots(self.caches, self._written, self.cache.layout)
        else:
            self.caches = []
        self._written = 0
        self._caches_changed()

    def _caches_changed(self) -> None:
        """The caches were written other than by a decode step (a prefill, a reset): the
        decode sessions' own copies of them are stale (:class:`WindowStore`)."""
        if getattr(self, "_store", None) is not None:
            self._store.changed()

    @property
    def cache_io(self) -> str:
        """How the last decode step's caches reached the runtime: "in place" (written a step's
        rows at a time into the runtime's own input memory: LiteRT), "copied" (the window
        copied in every step: LiteRT without host-memory buffers, or ``caches_in_place``
        False), or "" (a runtime that takes the caches as arrays each run: onert, reference)."""
        store = getattr(self, "_store", None)
        return store.path if store is not None else ""

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """GenerationLimitError unless prompt + new tokens fit the cache (after the tokens
        already in it): :func:`check_fits`."""
        check_fits(self.max_cache_len, self.position, prompt_len, max_new_tokens, self.manifest.directory,
                   getattr(self.manifest, "max_positions", None))

    def _ensure_caches(self) -> None:
        """Zero caches when there are none (a new conversation). With rows outputs they are
        the arrays every step reads and the core writes each step's rows into."""
        if not self.caches:
            self.caches = zero_caches(self.cache.shapes, self.cache.dtype)

    # ------------------------------------------------------------------ hooks

    def prefill_inputs(self, ids: Any, pos: int, row: int, caches: list[Any]) -> list[Any]:
        """The inputs of a prefill run of the chunk ``ids`` [1, N] at ``pos`` whose logits
        row is ``row``: ids, pos, the row (when the graph returns one row), the
        :meth:`prefill_extras`, the caches and the request's constants."""
        np = self._np
        head = [ids, np.array([pos], dtype=np.int64)]
        if self.one_row:
            head.append(np.array([row], dtype=np.int64))
        return [*head, *self.prefill_extras(ids, pos), *caches, *self.constants]

    def prefill_extras(self, ids: Any, pos: int) -> list[Any]:
        """Inputs a prefill graph takes after its ids, pos and logits row, for the chunk
        ``ids`` [1, N] at ``pos``: none for a text model (a vision-language model's prefill
        also takes the chunk's image embeddings: circleops.generation.vision.VisionGenerator)."""
        return []

    def prefill_outputs(self, outputs: Sequence[Any]) -> Sequence[Any]:
        """The cache outputs of a prefill run (after its logits): all the rest, for a text model."""
        return outputs[1:]

    def process_logits(self, logits: Any, step: int) -> Any:
        """The scores the ``step``-th new token (0: the first) is chosen from: the logits
        themselves, for a text model (Whisper suppresses tokens here)."""
        return logits

    def token_budget(self, prompt_len: int, max_new_tokens: Any) -> int:
        """How many tokens a request of ``prompt_len`` may generate: ``max_new_tokens``, which
        must fit the cache (:meth:`check_fits`)."""
        self.check_fits(prompt_len, max_new_tokens)
        return max_new_tokens

    def plan(self, start: int, end: int) -> list[tuple[int, int]]:
        """The prefill runs that write tokens ``start..end-1``: :func:`plan_chunks` over the
        lengths of the prefill graphs."""
        return plan_chunks(start, end, list(self.prefill_sessions), self.run_overhead)

    @property
    def run_overhead(self) -> int:
        """What one prefill run costs beyond its rows, in rows, for these files' weights."""
        from circleops.quantize import GGML_FORMATS

        if getattr(self.manifest, "quantize", None) in GGML_FORMATS:
            return GGML_RUN_OVERHEAD
        one_thread = all(self.threads.get(g) == 1 for g in self.prefill_graphs.values())
        return ONE_THREAD_RUN_OVERHEAD if one_thread else PREFILL_RUN_OVERHEAD

    # ------------------------------------------------------------------ steps

    def run_chunk(self, length: int, ids: Sequence[int], pos: int, row: int) -> Any:
        """One run of the prefill graph of ``length``: ``ids`` (at most ``length``, right-padded)
        written at slots pos.. of the caches; returns the logits of ``ids[row]`` [V]."""
        np = self._np
        m = self.manifest
        buf = np.full((1, length), m.pad_token_id, dtype=np.int64)
        buf[0, :len(ids)] = ids
        self._ensure_caches()
        session, caches = self.prefill_sessions[length], self.caches
        window = next(((w, s) for w, s in self.window_sessions.get(length, ()) if pos <= w), None)
        if window is not None:  # the slots before pos are all this graph attends to
            session, caches = window[1], cache_window(self.caches, window[0], self.cache.layout)
        outs = session.run(self.prefill_inputs(buf, pos, row, caches))
        self.caches = store_caches(self.caches, self.prefill_outputs(outs), pos, self.cache.update, self.cache.layout)
        self._caches_changed()
        self._written = max(self._written, min(pos + length, self.max_cache_len))
        self.prefill_runs += 1
        self.chunks.append(length)
        return outs[0][0, 0 if self.one_row else row]

    def feed(self, token_ids: Sequence[int]) -> Any:
        """Write ``token_ids`` into the cache after :attr:`history`; returns the logits of
        the last one [V].

        One token is a decode step. More go through the prefill graphs in the chunks that
        :meth:`plan` gives; a chunk's causal mask over the cache makes it attend to
        everything before it. Each prefill run computes the logits of one row only (the
        last token's, in the last run).
        """
        new = check_token_ids(token_ids, self.manifest.vocab_size, "the tokens to feed", error=GenerationLimitError)
        if not new:
            raise GenerationLimitError("nothing to feed: give at least one token.")
        start, end = self.position, self.position + len(new)
        if end > self.max_cache_len:
            raise GenerationLimitError(f"the KV cache of {self.max_cache_len} slots is full: {start} tokens are in it "
                                       f"and {len(new)} more do not fit.")
        if len(new) == 1 and start > 0:
            return self.decode(new[0])
        tokens = self.history + new
        logits = None
        for length, s in self.plan(start, end):
            chunk = tokens[s:s + length]
            logits = self.run_chunk(length, chunk, s, min(end, s + length) - 1 - s)
        self.history = tokens
        return logits

    def prefill(self, prompt_ids: Sequence[int]) -> Any:
        """Start over with ``prompt_ids`` (any length up to the cache): returns the logits of
        its last token [V]."""
        self.reset()
        self.check_fits(len(prompt_ids), 0)
        return self.feed(prompt_ids)

    def decode(self, token: int) -> Any:
        """Feed one token at the next position; returns its logits [V]."""
        logits = self._step(token)
        return logits.copy() if self._logits_shared else logits

    def _step(self, token: int) -> Any:
        """:meth:`decode`, but the logits may be the session's own output memory, which its
        next run overwrites (then ``_logits_shared`` is True): for a caller that is done with
        them before then (the greedy loop's argmax), not a copy of 4 x vocabulary bytes a step."""
        if self.position >= self.max_cache_len:
            raise GenerationLimitError(f"the KV cache of {self.max_cache_len} slots is full.")
        if not 0 <= token < self.manifest.vocab_size:  # the common case without building a list
            check_token_ids([token], self.manifest.vocab_size, "the token to decode", error=GenerationLimitError)
        self._ids[0, 0] = token
        pos = self._pos[0] = self.position
        if not self._caches:
            self._ensure_caches()
        session, width = self.decode_session, self.max_cache_len
        window = next(((w, s) for w, s in self.decode_windows if pos <= w), None)
        if window is not None:  # the slots before the position are all this step attends to
            width, session = window
        store = self._store
        caches = (store.inputs(session, 2 + len(self.step_extras), self._caches, width, self.caches_in_place)
                  if store is not None else None)
        if caches is None:  # the window copied into the run (a view: the runtime copies it)
            caches = self.caches if window is None else cache_window(self.caches, width, self.cache.layout)
        outs = session.run([self._ids, self._pos, *self.step_extras, *caches, *self.constants])
        rows = outs[1:]
        if self.cache.update == "rows" and self._checked.get(id(session)) is session:
            # a session's graph returns rows of the same shapes every step (checked on its first);
            # rows that stay in the session's own input memory reach the caches at the next
            # flush (WindowStore.stored), the others are written now
            if store is None or not store.stored(session, rows, pos, defer=True):
                write_rows(self._caches, rows, pos, self.cache.layout)
        else:
            self.caches = store_caches(self.caches, rows, pos, self.cache.update, self.cache.layout)
            if store is not None:  # the session's own copy gets the rows too (or goes stale)
                store.stored(session, rows, pos)
            self._checked[id(session)] = session
        self._written = max(self._written, self.position + 1)
        self.history.append(int(token))
        # the session's memory (its next run overwrites it): decode copies it
        self._logits_shared = store is not None and store.outputs_shared(session)
        return outs[0][0, 0]

    # ------------------------------------------------------------------ the loop

    def pick(self, logits: Any, sampler: Any, step: int) -> int:
        """The ``step``-th new token: greedy, or drawn by ``sampler`` (its repetition penalty
        sees the prompt and the tokens so far, as transformers' does)."""
        scores = self.process_logits(logits, step)
        if sampler is None:
            return int(scores.argmax())
        return sampler(scores, self.history)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: Any = DEFAULT_MAX_NEW_TOKENS, *,
                 stop_at_eos: bool = True, on_token: Callable[[int], None] | None = None,
                 sampler: Any = None, keep_cache: bool = False, stop_ids: Sequence[int] | None = None) -> Generation:
        """Up to ``max_new_tokens`` tokens after ``prompt_ids`` (:meth:`token_budget`): greedy,
        or drawn by ``sampler`` (a :class:`circleops.generation.sampling.Sampler`).

        Stops after an EOS token (kept in ``tokens`` when :attr:`keep_stop_token`, as
        transformers' text generate does) when ``stop_at_eos`` (``stop_ids``: other ids to
        stop at). ``on_token`` is called with each new output token as it is produced.
        ``keep_cache``: continue after the tokens already in the cache (a chat turn, or a
        request whose kind prepared it after :meth:`reset`) instead of starting over.
        """
        prompt_ids = check_token_ids(prompt_ids, self.manifest.vocab_size, "the prompt", error=GenerationLimitError)
        if not keep_cache:
            self.reset()
        budget = self.token_budget(len(prompt_ids), max_new_tokens)
        eos = (set(self.manifest.eos_token_ids) | set(stop_ids or ())) if stop_at_eos else set()
        result = Generation(prompt_ids=prompt_ids, runtime=self.runtime)
        if budget == 0:
            return result
        t = time.perf_counter()
        runs = self.prefill_runs
        token = self.pick(self.feed(prompt_ids), sampler, 0)
        result.prefill_seconds = time.perf_counter() - t
        result.prefill_runs = self.prefill_runs - runs
        result.prefill_chunks = self.chunks[len(self.chunks) - result.prefill_runs:]
        t = time.perf_counter()
        self._decode_loop(result, token, budget, eos, on_token, sampler)
        result.decode_seconds = time.perf_counter() - t
        result.cache_io = self.cache_io if result.decode_steps else ""
        return result

    def _decode_loop(self, result: Generation, token: int, budget: int, eos: set[int],
                     on_token: Callable[[int], None] | None, sampler: Any) -> None:
        """From the first new ``token`` on: emit it, stop at a stop token or the budget, else
        decode it and pick the next."""
        tokens = result.tokens
        while True:
            stop = token in eos
            if not stop or self.keep_stop_token:
                tokens.append(token)
                if on_token is not None:
                    on_token(token)
            if stop:
                result.stopped_at_eos = True
                break
            if len(tokens) >= budget:
                break
            # greedy: the argmax reads the logits before the next run, so they need no copy
            logits = self._step(token) if sampler is None else self.decode(token)
            token = self.pick(logits, sampler, len(tokens))
            result.decode_steps += 1
