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

    from circleops.generation.generator import Generator
    gen = Generator("out/")                       # runtime from the manifest (onert for target onert)
    result = gen.generate([1, 2, 3], max_new_tokens=32)
    result.tokens, result.prefill_seconds, result.decode_tokens_per_second
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from circleops.inputs.chat_template import template_budget
from circleops.errors import CircleOpsError, ModelLoadError, TargetError
from circleops.package.manifest import GRAPH_NAMES, MANIFEST, Manifest, confined, confined_tokenizer, graph_runtimes, read_manifest
from circleops.options import HEAD_MAJOR, SLOT_MAJOR
from circleops.runtime import RUNTIMES, Session, open_session, runtime_info, selects_signatures
from circleops.inputs.token_ids import check_token_ids
from circleops.inputs.remote_code import refuse_remote_code

DEFAULT_MAX_NEW_TOKENS = 64
# What one prefill run costs beyond its rows, in rows: the chunk plan (plan_chunks)
# minimises sum(length + this) over the runs. onert on SmolLM2-135M (fp32, 2 threads, idle,
# bench/README.md "bench/ttft.py"): a run of L = 8, 16, 64 positions took about
# (L + 24) x 4.6 ms: every run reads all the weights, whatever its length.
PREFILL_RUN_OVERHEAD = 24
# The same for GGML weights on onert, whose GGML FULLY_CONNECTED costs the same per row at 8
# rows as at 64 (bench/onert_matmul.py --ggml): SmolLM2 q4_0, 1 thread, CPU of a run of L
# rows about (L + 1.5) x 8.9 ms; planned so, a 20-token prompt took 0.38x the CPU of one
# 64-row run, 100 tokens 0.80x, 300 tokens 0.90x, the same first token (bench/results/09-llm-speed.yaml).
GGML_RUN_OVERHEAD = 2
# fp32 files whose prefill graphs all run one thread (the 8-row one with FULLY_CONNECTED
# linears, the 64-row one a 1x1 CONV_2D): a 20-token prompt as three runs of 8 took 0.5-0.6x
# the CPU of one run of 64; 100 and 300 tokens tied with any plan (SmolLM2, loaded). With 2
# threads the 64-row graph gets a core more, so PREFILL_RUN_OVERHEAD stays there.
ONE_THREAD_RUN_OVERHEAD = 8


class GenerationLimitError(CircleOpsError):
    """The prompt or the generation does not fit the graphs' prefill length or cache."""


# --------------------------------------------------------------------------- runtimes

def choose_runtime(manifest: Any, runtime: str | None) -> tuple[str, str | None]:
    """``runtime`` (None: the manifest's default), checked against its files, and a note to
    show when the default had to change (circleops.runtime.choose_runtime: onert cannot run
    GGML weights on a CPU without AVX-512, so a quantized onert directory then runs on the
    reference interpreter; onert asked for by name is refused there with a HostCPUError)."""
    from circleops.runtime import choose_runtime as choose

    if runtime is not None:
        check_runtime(manifest, runtime)
    runtime, note = choose(runtime, manifest.target, manifest.quantize, "run")
    check_runtime(manifest, runtime)
    return runtime, note


def check_runtime(manifest: Any, runtime: str) -> None:
    """Refuse a runtime that cannot run the manifest's files, saying which can."""
    if runtime not in RUNTIMES:
        raise TargetError(f"unknown runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    if runtime in graph_runtimes(manifest.target):
        return
    from circleops.targets import PROFILES

    info, fmt = runtime_info(runtime), PROFILES[manifest.target].format
    own = next((t for t in PROFILES if PROFILES[t].runtime == runtime), None)  # the target made for it
    if fmt not in info.formats:
        other = own or next(t for t in PROFILES if PROFILES[t].format in info.formats)
        why = (f"{info.label} runs {' and '.join('.' + f for f in info.formats)} files, and these are .{fmt} files: "
               f"convert with --target {other} (`circleops convert MODEL --graphs prefill,decode --target {other} "
               f"-o DIR`)")
    else:
        why = (f"the files of target {manifest.target} hold ops {info.label} does not run (ATTENTION)"
               + (f"; convert with --target {own} for {runtime}" if own else ""))
    raise TargetError(f"--runtime {runtime} cannot run {manifest.directory}: {why}. Runtimes for these files: "
                      f"{', '.join(graph_runtimes(manifest.target))}.")


# Graphs of fewer rows than this run at most this many threads on a runtime, whatever the
# budget (Generator's ``threads``): measured on SmolLM2-135M (bench/results/09-llm-speed.yaml,
# issue 26). onert's decode step gains nothing from a second thread (fp32: 29.1 vs 29.2
# ms/token idle; its FULLY_CONNECTED runs on one thread whatever NUM_THREADS says) and GGML
# weights lose: onert runs each GGML FULLY_CONNECTED as a ggml graph that starts
# NUM_THREADS-1 workers per call (q4_0 decode 8.5 ms/token at 1 thread, 15.5 at 2, idle; a
# 5-token prompt through the 8-row graph 45 ms at both, and 5x the CPU at 2 on a loaded
# machine). Its 64-row prefill does use a second core (q4_0 300-token prompt 1404 -> 983 ms idle).
GRAPH_THREAD_CAPS: dict[str, tuple[int, int]] = {"onert": (16, 1)}


def graph_threads(manifest: Any, runtime: str, threads: int | Mapping[str, int] | None = None) -> dict[str, int | None]:
    """The thread count each graph's session opens with (None: the runtime's own default).

    ``threads``: an int is the budget: every graph runs at it, except where
    :data:`GRAPH_THREAD_CAPS` says fewer threads measured faster for graphs of that few rows
    on that runtime (onert's decode and 8-row prefill: 1). A mapping {graph: count} is honoured exactly for the graphs
    it names. Without ``threads``, a ``NUM_THREADS`` set in the environment (the runtime's own
    variable) is honoured exactly for every graph; otherwise the manifest's ``num_threads``
    (what ``convert --threads`` made the files for; 1 for GGML weights) is the budget.
    """
    windowed = getattr(manifest, "windowed_prefills", {})
    graphs = [*manifest.prefill_graphs.values(), *windowed, "decode"]
    exact: Mapping[str, int] = threads if isinstance(threads, Mapping) else {}
    for graph, count in exact.items():
        if graph not in graphs:
            raise TargetError(f"threads names graph {graph!r}, which {manifest.directory} does not have "
                              f"(it has {', '.join(graphs)}).")
    budget = None if isinstance(threads, Mapping) else threads
    for count in ([budget] if budget is not None else []) + list(exact.values()):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise TargetError(f"threads must be a whole number of 1 or more, got {count!r}.")
    env = runtime_info(runtime).threads_env
    if budget is None and not (env and os.environ.get(env, "").strip()):
        budget = getattr(manifest, "num_threads", None)
    few_rows, cap = GRAPH_THREAD_CAPS.get(runtime, (0, 0))
    rows = {**{g: n for n, g in manifest.prefill_graphs.items()}, **{g: n for g, (n, _) in windowed.items()},
            "decode": 1}
    plan: dict[str, int | None] = {}
    for graph in graphs:
        if graph in exact:
            plan[graph] = exact[graph]
        elif budget is None:
            plan[graph] = None  # the environment's NUM_THREADS, or the runtime's default
        else:
            plan[graph] = min(budget, cap) if rows[graph] < few_rows else budget
    return plan


def open_graph(manifest: Any, graph: str, runtime: str, *, isolated: bool = False,
               threads: int | None = None) -> Session:
    """A prepared runtime session on ``graph`` of the manifest's files: ``session.run`` takes
    numpy inputs in the manifest's input order and returns outputs in its output order.
    ``isolated``: a native runtime in a child process (open_session), for one-shot checks.
    ``threads``: the session's thread count (the runtime's NUM_THREADS while it is created);
    None: the environment's NUM_THREADS if set, else the manifest's ``num_threads``."""
    check_runtime(manifest, runtime)
    if graph not in manifest.files:
        raise ModelLoadError(f"{manifest.directory} has no {graph} graph (it has {', '.join(manifest.files)}). "
                             f"Convert with --graphs prefill,decode.")
    files = manifest.graph_files(graph) if hasattr(manifest, "graph_files") else [manifest.files[graph]]
    if len(files) > 1:  # a split model: one file per layer range, run as one graph (circleops.package.split)
        from circleops.runtime.chain import ChainSession

        sessions = [_open_file(manifest, graph, f, runtime, isolated, threads) for f in files]
        return ChainSession(sessions, manifest.parts, one_row=graph != "decode" and manifest.prefill_one_row)
    return _open_file(manifest, graph, files[0], runtime, isolated, threads)


def _open_file(manifest: Any, graph: str, name: str, runtime: str, isolated: bool, threads: int | None) -> Session:
    """open_graph's session on one file ``name`` of ``graph``."""
    confined(manifest.directory, name, f"the file of graph {graph!r}", manifest.directory / MANIFEST)
    path = manifest.directory / name
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing (listed in {manifest.directory}/manifest.json). Convert again.")
    signature = manifest.signatures.get(graph)
    info = runtime_info(runtime)
    if signature is not None and not selects_signatures(runtime):
        how = (" (this directory's files need onert's C API: pip install circleops[onert-signatures], onert "
               "0.2.0.dev250922 or later)" if getattr(manifest, "signature_api", None) else "")
        raise TargetError(f"{path} keeps the graphs as signatures, which {info.label} 0.1.0 cannot select{how}; "
                          f"convert with --target onert --onert-signatures off for one file per graph, or run with "
                          f"--runtime reference.")
    env = info.threads_env
    if threads is None and env and env not in os.environ:
        # the thread count the graphs were made for (convert --threads; 1 for GGML weights:
        # onert's GGML kernel starts NUM_THREADS-1 workers per call, and on 2 busy cores 2
        # threads decoded SmolLM2 16x slower than 1, bench/README.md). The user's NUM_THREADS wins.
        threads = getattr(manifest, "num_threads", None)
    if not (env and threads):
        return open_session(runtime, path, signature, isolated=isolated)
    saved = os.environ.get(env)
    os.environ[env] = str(threads)  # onert and LiteRT read it when the session is created
    try:
        return open_session(runtime, path, signature, isolated=isolated)
    finally:
        if saved is None:
            del os.environ[env]
        else:
            os.environ[env] = saved


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


# --------------------------------------------------------------------------- generation

def empty_caches(manifest: Any) -> list[Any]:
    """Zero caches for the manifest's graphs (k caches then v caches, in its cache_layout)."""
    import numpy as np

    return [np.zeros(shape, dtype=np.float32) for shape in manifest.cache_shapes]


def _check_cache_outputs(caches: list[Any], outputs: Sequence[Any], cache_layout: str) -> None:
    """ModelLoadError unless a graph's new k/v rows fit the caches (a damaged or foreign graph
    file, or a manifest that does not describe it)."""
    ok = len(outputs) == len(caches)
    half = len(caches) // 2
    for i, (cache, out) in enumerate(zip(caches, outputs)):
        if not ok:
            break
        shape = tuple(getattr(out, "shape", ()))
        c = tuple(cache.shape)
        heads_dim = c[2:] if cache_layout != HEAD_MAJOR else (c[1], c[3]) if i < half else (c[1], c[2])
        ok = len(shape) == 4 and shape[0] == 1 and shape[2:] == heads_dim
    if not ok:
        raise ModelLoadError(f"the graph returned caches of shapes {[list(getattr(o, 'shape', ())) for o in outputs]}, "
                             f"which do not fit the manifest's {len(caches)} caches of shapes "
                             f"{sorted({tuple(c.shape) for c in caches})}; the graph file or its "
                             f"manifest.json is damaged. Convert again with --graphs.")


def store_caches(caches: list[Any], outputs: Sequence[Any], pos: int, cache_update: str,
                 cache_layout: str = SLOT_MAJOR) -> list[Any]:
    """The caches after a step whose cache outputs are ``outputs`` (manifest ``cache_update``):
    "full" -> the outputs themselves (whole updated caches); "rows" -> ``caches``, each with
    its output's S new rows [1, S, Hkv, D] written at slots pos..pos+S-1 in place, in the
    caches' ``cache_layout`` (no cache is copied; slots past the end are dropped, as the
    "full" form drops them)."""
    if cache_update != "rows":
        return list(outputs)  # the next run's input check (check_inputs) sees their shapes
    _check_cache_outputs(caches, outputs, cache_layout)
    half = len(caches) // 2
    for i, (cache, rows) in enumerate(zip(caches, outputs)):
        if cache_layout == HEAD_MAJOR:
            if i < half:  # k [1, Hkv, C, D]
                n = min(rows.shape[1], cache.shape[2] - pos)
                cache[0, :, pos:pos + n, :] = rows[0, :n].transpose(1, 0, 2)
            else:  # v [1, Hkv, D, C]
                n = min(rows.shape[1], cache.shape[3] - pos)
                cache[0, :, :, pos:pos + n] = rows[0, :n].transpose(1, 2, 0)
        else:
            n = min(rows.shape[1], cache.shape[1] - pos)
            cache[:, pos:pos + n] = rows[:, :n]
    return caches


def clear_slots(caches: list[Any], n: int, cache_layout: str = SLOT_MAJOR) -> None:
    """Zero cache slots 0..n-1 of ``caches`` (k caches then v caches) in place, in their
    ``cache_layout``: they are then as :func:`empty_caches` makes them."""
    half = len(caches) // 2
    for i, cache in enumerate(caches):
        if cache_layout == HEAD_MAJOR:
            if i < half:  # k [1, Hkv, C, D]
                cache[:, :, :n, :] = 0
            else:  # v [1, Hkv, D, C]
                cache[:, :, :, :n] = 0
        else:  # [1, C, Hkv, D]
            cache[:, :n] = 0


def cache_window(caches: list[Any], window: int, cache_layout: str = SLOT_MAJOR) -> list[Any]:
    """Views of the first ``window`` slots of ``caches`` (k caches then v caches, in their
    ``cache_layout``): the cache inputs of a prefill graph that reads only those slots."""
    half = len(caches) // 2
    if cache_layout == HEAD_MAJOR:  # k [1, Hkv, C, D], v [1, Hkv, D, C]
        return [c[:, :, :window, :] if i < half else c[:, :, :, :window] for i, c in enumerate(caches)]
    return [c[:, :window] for c in caches]  # [1, C, Hkv, D]


def plan_chunks(start: int, end: int, lengths: Sequence[int],
                overhead: int = PREFILL_RUN_OVERHEAD) -> list[tuple[int, int]]:
    """The prefill runs that write tokens ``start..end-1`` into the cache: (graph length,
    position) pairs, in order, computing the fewest positions when each run counts
    ``overhead`` more (a dynamic program over ``lengths``; ties go to the longer graph).

    Every run but the last covers new tokens only. The last one is aligned to end at the
    last token: it re-runs tokens already in the cache (their keys and values come out the
    same) instead of padding, so nothing is written past the last real token and a prompt
    may fill the cache exactly. Only when fewer tokens than its length exist in all does it
    start at 0, right-padded (the padding's slots are overwritten before any query sees them).
    """
    longest_first = sorted(set(lengths), reverse=True)
    left = end - start
    cost, pick = [0] * (left + 1), [0] * (left + 1)
    for x in range(1, left + 1):
        cost[x], pick[x] = min((n + overhead + cost[max(0, x - n)], -n) for n in longest_first)
        pick[x] = -pick[x]
    runs, s, x = [], start, left
    while x > pick[x]:
        runs.append((pick[x], s))
        s, x = s + pick[x], x - pick[x]
    if x:
        runs.append((pick[x], max(0, end - pick[x])))
    return runs


@dataclass
class Generation:
    """The result of one greedy generation."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included when it stopped there
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # decode graph runs (the first new token comes from the prefill)
    prefill_runs: int = 0  # prefill graph runs for the prompt (chunks)
    prefill_chunks: list[int] = field(default_factory=list)  # the length of each prefill run
    stopped_at_eos: bool = False
    runtime: str = ""
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
                     f"ms/token)")
        else:
            line += "no decode steps"
        return line + (f"; stopped at EOS after {len(self.tokens)} new tokens" if self.stopped_at_eos else "")


class Generator:
    """Generation on the files a manifest describes; sessions are created once.

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
        import numpy as np

        self.manifest = source if isinstance(source, Manifest) else read_manifest(source)
        m = self.manifest
        missing = [g for g in (*GRAPH_NAMES, *m.prefill_graphs.values(), *m.windowed_prefills) if g not in m.files]
        if missing:
            raise ModelLoadError(f"{m.directory} lacks the {' and '.join(missing)} graph: generation needs the "
                                 f"prefill and decode graphs. Convert with --graphs prefill,decode.")
        if m.vision is not None and type(self).prefill_extras is Generator.prefill_extras:
            raise ModelLoadError(f"{m.directory} holds a vision-language model, whose prefill graphs also take image "
                                 f"embeddings: run it with circleops.recipes.vlm.VisionGenerator (circleops generate DIR "
                                 f"--image PATH --prompt TEXT).")
        self.runtime, self.runtime_note = choose_runtime(m, runtime)
        # prefill length -> its session, longest first
        # each graph at its own thread count (graph_threads: the budget, less where measured faster)
        self.threads = graph_threads(m, self.runtime, threads)
        self.prefill_sessions = {n: open_graph(m, g, self.runtime, threads=self.threads[g])
                                 for n, g in m.prefill_graphs.items()}
        # length -> [(window W, session)], narrowest first: a chunk at pos <= W reads only slots < W
        self.window_sessions: dict[int, list[tuple[int, Session]]] = {}
        for g, (n, w) in sorted(m.windowed_prefills.items(), key=lambda item: item[1][1]):
            self.window_sessions.setdefault(n, []).append(
                (w, open_graph(m, g, self.runtime, threads=self.threads[g])))
        self.decode_session = open_graph(m, "decode", self.runtime, threads=self.threads["decode"])
        _check_caches(m, self.decode_session)
        _check_vocab(m, {**{g: self.prefill_sessions[n] for n, g in m.prefill_graphs.items()},
                         "decode": self.decode_session})
        self._np = np
        self._ids = np.zeros((1, 1), dtype=np.int64)
        self._pos = np.zeros(1, dtype=np.int64)
        self.caches: list[Any] = []
        self.history: list[int] = []  # the tokens whose keys/values fill cache slots 0..len-1
        self._written = 0  # cache slots 0.._written-1 may be non-zero (padding rows included)
        self.prefill_runs = 0  # runs of the prefill graphs so far (chunks)
        self.chunks: list[int] = []  # the length of each of those runs

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
        if self.caches and self.manifest.cache_update == "rows":
            # the same arrays, the written slots zeroed in place: new ones for every prompt
            # (60 x 393 KB for SmolLM2, page faults included) cost 9-10 ms of CPU per prompt
            # on onert (bench/llm_profile.py), a tenth of a 5-token prompt's prefill at q4_0
            clear_slots(self.caches, self._written, self.manifest.cache_layout)
        else:
            self.caches = []
        self._written = 0

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """GenerationLimitError unless prompt + new tokens fit the cache (after the tokens
        already in it)."""
        m = self.manifest
        if prompt_len < 1:
            raise GenerationLimitError("the prompt is empty: give at least one token.")
        if max_new_tokens < 0:
            raise GenerationLimitError(f"--max-new-tokens must be 0 or more, got {max_new_tokens}.")
        used = self.position
        if used + prompt_len + max_new_tokens > m.max_cache_len:
            before = f"the {used} tokens already in the cache, " if used else ""
            raise GenerationLimitError(
                f"{before}the prompt ({prompt_len} token{'' if prompt_len == 1 else 's'}) plus --max-new-tokens "
                f"{max_new_tokens} is {used + prompt_len + max_new_tokens} tokens, more than the {m.max_cache_len} "
                f"slots of the KV cache in {m.directory}. Generate at most {max(0, m.max_cache_len - used - prompt_len)} "
                f"new tokens, or convert again with --max-cache-len {used + prompt_len + max_new_tokens} or more.")

    def _ensure_caches(self) -> None:
        """Zero caches when there are none (a new conversation). With rows outputs they are
        the arrays every step reads and the Generator writes each step's rows into."""
        if not self.caches:
            self.caches = empty_caches(self.manifest)

    def run_chunk(self, length: int, ids: Sequence[int], pos: int, row: int) -> Any:
        """One run of the prefill graph of ``length``: ``ids`` (at most ``length``, right-padded)
        written at slots pos.. of the caches; returns the logits of ``ids[row]`` [V]."""
        np = self._np
        m = self.manifest
        buf = np.full((1, length), m.pad_token_id, dtype=np.int64)
        buf[0, :len(ids)] = ids
        self._ensure_caches()
        head = [buf, np.array([pos], dtype=np.int64)]
        if m.prefill_one_row:
            head.append(np.array([row], dtype=np.int64))
        head.extend(self.prefill_extras(buf, pos))
        session, caches = self.prefill_sessions[length], self.caches
        window = next(((w, s) for w, s in self.window_sessions.get(length, ()) if pos <= w), None)
        if window is not None:  # the slots before pos are all this graph attends to
            session, caches = window[1], cache_window(self.caches, window[0], m.cache_layout)
        outs = session.run([*head, *caches])
        self.caches = store_caches(self.caches, outs[1:], pos, m.cache_update, m.cache_layout)
        self._written = max(self._written, min(pos + length, m.max_cache_len))
        self.prefill_runs += 1
        self.chunks.append(length)
        return outs[0][0, 0 if m.prefill_one_row else row]

    def prefill_extras(self, ids: Any, pos: int) -> list[Any]:
        """Inputs a prefill graph takes after its ids, pos and logits row, for the chunk
        ``ids`` [1, N] at ``pos``: none for a text model (a vision-language model's prefill
        also takes the chunk's image embeddings: circleops.recipes.vlm.VisionGenerator)."""
        return []

    def plan(self, start: int, end: int) -> list[tuple[int, int]]:
        """The prefill runs that write tokens ``start..end-1``: :func:`plan_chunks` over the
        lengths of this manifest's prefill graphs."""
        return plan_chunks(start, end, list(self.prefill_sessions), self.run_overhead)

    @property
    def run_overhead(self) -> int:
        """What one prefill run costs beyond its rows, in rows, for these files' weights."""
        from circleops.quantize import GGML_FORMATS

        if self.manifest.quantize in GGML_FORMATS:
            return GGML_RUN_OVERHEAD
        one_thread = all(self.threads.get(g) == 1 for g in self.manifest.prefill_graphs.values())
        return ONE_THREAD_RUN_OVERHEAD if one_thread else PREFILL_RUN_OVERHEAD

    def feed(self, token_ids: Sequence[int]) -> Any:
        """Write ``token_ids`` into the cache after :attr:`history`; returns the logits of
        the last one [V].

        One token is a decode step. More go through the prefill graphs in the chunks that
        :meth:`plan` gives; a chunk's causal mask over the cache makes it attend to
        everything before it. Each prefill run computes the logits of one row only (the
        last token's, in the last run).
        """
        m = self.manifest
        new = check_token_ids(token_ids, m.vocab_size, "the tokens to feed", error=GenerationLimitError)
        if not new:
            raise GenerationLimitError("nothing to feed: give at least one token.")
        start, end = self.position, self.position + len(new)
        if end > m.max_cache_len:
            raise GenerationLimitError(f"the KV cache of {m.max_cache_len} slots is full: {start} tokens are in it "
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
        if self.position >= self.manifest.max_cache_len:
            raise GenerationLimitError(f"the KV cache of {self.manifest.max_cache_len} slots is full.")
        if not 0 <= token < self.manifest.vocab_size:  # the common case without building a list
            check_token_ids([token], self.manifest.vocab_size, "the token to decode", error=GenerationLimitError)
        self._ids[0, 0] = token
        self._pos[0] = self.position
        self._ensure_caches()
        outs = self.decode_session.run([self._ids, self._pos, *self.caches])
        m = self.manifest
        self.caches = store_caches(self.caches, outs[1:], self.position, m.cache_update, m.cache_layout)
        self._written = max(self._written, self.position + 1)
        self.history.append(int(token))
        return outs[0][0, 0]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                 stop_at_eos: bool = True, on_token: Callable[[int], None] | None = None,
                 sampler: Any = None, keep_cache: bool = False, stop_ids: Sequence[int] | None = None) -> Generation:
        """Up to ``max_new_tokens`` tokens after ``prompt_ids``: greedy, or drawn by
        ``sampler`` (a :class:`circleops.generation.sampling.Sampler`; its repetition penalty sees the
        prompt and the tokens so far, as transformers' does).

        Stops after an EOS token (kept in ``tokens``, as transformers does) when
        ``stop_at_eos`` (``stop_ids``: other ids to stop at). ``on_token`` is called with
        each new token as it is produced. ``keep_cache``: continue after the tokens already
        in the cache (a chat turn) instead of starting over.
        """
        prompt_ids = check_token_ids(prompt_ids, self.manifest.vocab_size, "the prompt", error=GenerationLimitError)
        if not keep_cache:
            self.reset()
        self.check_fits(len(prompt_ids), max_new_tokens)
        eos = (set(self.manifest.eos_token_ids) | set(stop_ids or ())) if stop_at_eos else set()
        result = Generation(prompt_ids=prompt_ids, runtime=self.runtime)
        if max_new_tokens == 0:
            return result

        def pick(logits: Any) -> int:
            if sampler is None:
                return int(logits.argmax())
            return sampler(logits, self.history)

        t = time.perf_counter()
        runs = self.prefill_runs
        token = pick(self.feed(prompt_ids))
        result.prefill_seconds = time.perf_counter() - t
        result.prefill_runs = self.prefill_runs - runs
        result.prefill_chunks = self.chunks[len(self.chunks) - result.prefill_runs:]
        t = time.perf_counter()
        while True:
            result.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos:
                result.stopped_at_eos = True
                break
            if len(result.tokens) >= max_new_tokens:
                break
            token = pick(self.decode(token))
            result.decode_steps += 1
        result.decode_seconds = time.perf_counter() - t
        return result


# --------------------------------------------------------------------------- text

class TextStream:
    """Writes the decoded text of the new tokens as they arrive (whole characters only:
    a byte-level BPE token can end inside a UTF-8 sequence)."""

    def __init__(self, tokenizer: Any, out: Any = None):
        self.tokenizer = tokenizer
        self.out = out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> str:
        text = self.text()
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
        return text


def check_tokenizer_dir(directory: Path) -> Any:
    """ModelLoadError naming the file unless every JSON file of the tokenizer directory reads
    (circleops.inputs.user_files.read_json: not empty, UTF-8, JSON, not nested past the limit) and
    tokenizer.json loads in the ``tokenizers`` library (which refuses e.g. a negative id);
    returns that ``tokenizers.Tokenizer`` (None without tokenizer.json or the library)."""
    from circleops.inputs.user_files import check_json_files

    fix = "The tokenizer is damaged: convert the model again."
    check_json_files(directory, error=ModelLoadError, fix=fix)
    path = directory / "tokenizer.json"
    if path.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the Rust library's one exception type for a bad file
            raise ModelLoadError(f"{path} is not a tokenizer the tokenizers library can load: "
                                 f"{' '.join(str(err).split())[:200]}. {fix}") from None
    return None


class FastTokenizer:
    """The saved tokenizer.json through the ``tokenizers`` library: what generation needs
    (encode, decode) without importing torch and transformers (seconds of start-up)."""

    def __init__(self, directory: Path):
        import tokenizers  # noqa: F401 - ImportError: the caller falls back to transformers

        self.directory = directory
        self.tokenizer = check_tokenizer_dir(directory)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(manifest: Any) -> Any:
    """The tokenizer saved next to the graphs: a FastTokenizer over tokenizer.json when
    there is one, else transformers.AutoTokenizer."""
    if not manifest.tokenizer:
        raise ModelLoadError(f"{manifest.directory} has no tokenizer (the model was converted without one, e.g. "
                             f"from --config): pass the prompt as token ids with --token-ids 1,2,3.")
    # checked again here: a Manifest can be built by hand, not only read (read_manifest checks)
    path = confined_tokenizer(manifest.directory, manifest.tokenizer, manifest.directory / MANIFEST)
    if not path.is_dir():
        raise ModelLoadError(f"the tokenizer directory {path} listed in manifest.json is missing. Convert again.")
    refuse_remote_code(path)  # its tokenizer.json alone would tokenize differently from the custom class
    if (path / "tokenizer.json").is_file():
        try:
            return FastTokenizer(path)
        except ImportError:
            pass
    return hf_tokenizer(path)


def hf_tokenizer(path: Path) -> Any:
    """transformers' AutoTokenizer of a saved tokenizer directory (chat templates need it)."""
    check_tokenizer_dir(path)  # a damaged file is named here, not a traceback inside transformers
    try:
        return _auto_tokenizer(path)
    except CircleOpsError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers on a value of the wrong type in a user's file
        raise ModelLoadError(f"transformers cannot load the tokenizer in {path}: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}. The tokenizer files (tokenizer_config.json) are "
                             f"damaged: convert the model again.") from None


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    from circleops.sources.models import quiet_transformers

    refuse_remote_code(path)
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``, special tokens added as the tokenizer's post-processor says
    (as ``tokenizer(prompt)`` does); with ``chat`` the chat template around one user turn."""
    if chat:
        if isinstance(tokenizer, FastTokenizer):
            tokenizer = hf_tokenizer(tokenizer.directory)  # templates are rendered by transformers
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("--chat: this tokenizer has no chat template; drop --chat.")
        with template_budget(tokenizer):  # a model's template is someone else's program
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.encode(prompt)
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def generate(directory: str | Path, prompt: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
             runtime: str | None = None, stream: Any = None, chat: bool = False, sampler: Any = None,
             threads: int | Mapping[str, int] | None = None) -> Generation:
    """Greedy generation from the graphs in ``directory``.

    ``prompt``: text (tokenized with the saved tokenizer) or token ids. ``stream``: a file
    to write the text to as it is produced (needs the tokenizer). ``result.text`` holds the
    decoded new text when a tokenizer is there. ``threads``: as for :class:`Generator`.
    """
    gen = Generator(directory, runtime=runtime, threads=threads)
    tokenizer = None
    if isinstance(prompt, str):
        tokenizer = load_tokenizer(gen.manifest)
        ids = encode_prompt(tokenizer, prompt, chat)
    else:
        ids = [int(i) for i in prompt]
        if gen.manifest.tokenizer and stream is not None:
            tokenizer = load_tokenizer(gen.manifest)
    gen.check_fits(len(ids), max_new_tokens)
    streamer = TextStream(tokenizer, stream) if tokenizer is not None and stream is not None else None
    result = gen.generate(ids, max_new_tokens, on_token=streamer, sampler=sampler)
    if streamer is not None:
        result.text = streamer.close()
    elif tokenizer is not None:
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result
