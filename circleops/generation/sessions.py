"""Runtime sessions of a written set of graphs: which runtime runs the files
(:func:`choose_runtime`), each graph's thread count (:func:`graph_threads`) and one prepared
session per graph (:func:`open_graph`; a split graph's files run as one chain)."""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping

from circleops.errors import ModelLoadError, TargetError
from circleops.package.manifest import MANIFEST, confined, graph_runtimes
from circleops.runtime import RUNTIMES, Session, open_session, runtime_info, selects_signatures


def choose_runtime(manifest: Any, runtime: str | None) -> tuple[str, str | None]:
    """``runtime`` (None: the manifest's default), checked against its files, and a note to
    show when the default had to change (circleops.runtime.choose_runtime: onert cannot run
    GGML weights on a CPU without AVX-512, so a quantized onert directory then runs on the
    reference interpreter; onert asked for by name is refused there with a HostCPUError)."""
    from circleops.runtime import choose_runtime as choose

    if runtime is not None:
        check_runtime(manifest, runtime)
    # a manifest without a weight format (a speech model's) runs as fp32
    runtime, note = choose(runtime, manifest.target, getattr(manifest, "quantize", None), "run")
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


def graph_threads(manifest: Any, runtime: str, threads: int | Mapping[str, int] | None = None,
                  rows: Mapping[str, int] | None = None) -> dict[str, int | None]:
    """The thread count each graph's session opens with (None: the runtime's own default).

    ``threads``: an int is the budget: every graph runs at it, except where
    :data:`GRAPH_THREAD_CAPS` says fewer threads measured faster for graphs of that few rows
    on that runtime (onert's decode and 8-row prefill: 1). A mapping {graph: count} is honoured exactly for the graphs
    it names. Without ``threads``, a ``NUM_THREADS`` set in the environment (the runtime's own
    variable) is honoured exactly for every graph; otherwise the manifest's ``num_threads``
    (what ``convert --threads`` made the files for; 1 for GGML weights) is the budget.
    ``rows``: graph -> the rows its matmuls run, in the order the graphs are planned (None:
    a text manifest's, :func:`text_graph_rows`).
    """
    rows = text_graph_rows(manifest) if rows is None else rows
    graphs = list(rows)
    exact: Mapping[str, int] = threads if isinstance(threads, Mapping) else {}
    for graph, count in exact.items():
        if graph not in graphs:
            raise TargetError(f"threads names graph {graph!r}, which {manifest.directory} does not have "
                              f"(it has {', '.join(graphs)}).")
    budget = None if isinstance(threads, Mapping) else threads
    from circleops.pipeline.validate import validate_threads

    for count in ([budget] if budget is not None else []) + list(exact.values()):
        validate_threads(count)
    env = runtime_info(runtime).threads_env
    if budget is None and not (env and os.environ.get(env, "").strip()):
        budget = getattr(manifest, "num_threads", None)
    few_rows, cap = GRAPH_THREAD_CAPS.get(runtime, (0, 0))
    plan: dict[str, int | None] = {}
    for graph in graphs:
        if graph in exact:
            plan[graph] = exact[graph]
        elif budget is None:
            plan[graph] = None  # the environment's NUM_THREADS, or the runtime's default
        else:
            plan[graph] = min(budget, cap) if rows[graph] < few_rows else budget
    return plan


def text_graph_rows(manifest: Any) -> dict[str, int]:
    """Graph -> rows of a text manifest's graphs: each prefill graph's length (the windowed
    ones too), then the decode graphs' one row (the windowed ones too)."""
    windowed = getattr(manifest, "windowed_prefills", {})
    return {**{g: n for n, g in manifest.prefill_graphs.items()}, **{g: n for g, (n, _) in windowed.items()},
            "decode": 1, **{g: 1 for g in getattr(manifest, "windowed_decodes", {})}}


def open_graph(manifest: Any, graph: str, runtime: str, *, isolated: bool = False,
               threads: int | None = None) -> Session:
    """A prepared runtime session on ``graph`` of the manifest's files: ``session.run`` takes
    numpy inputs in the manifest's input order and returns outputs in its output order.
    ``isolated``: a native runtime in a child process (open_session), for one-shot checks; a
    split graph's parts are then opened one at a time, each closed before the next opens
    (ChainSession ``lazy``: one part's weights in memory at once).
    ``threads``: the session's thread count (the runtime's NUM_THREADS while it is created);
    None: the environment's NUM_THREADS if set, else the manifest's ``num_threads``."""
    check_runtime(manifest, runtime)
    if graph not in manifest.files:
        raise ModelLoadError(f"{manifest.directory} has no {graph} graph (it has {', '.join(manifest.files)}). "
                             f"Convert with --graphs prefill,decode.")
    files = manifest.graph_files(graph) if hasattr(manifest, "graph_files") else [manifest.files[graph]]
    head = getattr(manifest, "part_embedding", None) == "head"
    if len(files) > 1 or head:
        # a split model: one file per layer range, run as one graph (circleops.package.split);
        # or one file that takes the embeddings: a chain of one, the ids' rows read from its head
        from circleops.runtime.chain import ChainSession

        embed = _head_embedding(manifest, graph) if head else None
        ranges = manifest.parts if len(files) > 1 else [[0, manifest.num_layers]]
        one_row = graph != "decode" and manifest.prefill_one_row
        if isolated:
            openers = [functools.partial(_open_file, manifest, graph, f, runtime, isolated, threads) for f in files]
            return ChainSession(openers, ranges, one_row=one_row, embed=embed, lazy=True,
                                paths=[str(manifest.directory / f) for f in files])
        sessions = [_open_file(manifest, graph, f, runtime, isolated, threads) for f in files]
        return ChainSession(sessions, ranges, one_row=one_row, embed=embed)
    return _open_file(manifest, graph, files[0], runtime, isolated, threads)


def _head_embedding(manifest: Any, graph: str) -> Any:
    """The HeadEmbedding of ``graph``'s embeddings: the decode graph's head (every graph's file
    holds the same head values, one set of blocks: read one, so onert 0.1.0's file per graph
    has one file's head pages and flatbuffer tables touched, not three), shared by the graphs."""
    from circleops.runtime.chain import HeadEmbedding

    source = "decode" if "decode" in manifest.files else graph
    name = manifest.graph_files(source)[-1] if hasattr(manifest, "graph_files") else manifest.files[source]
    confined(manifest.directory, name, f"the file of graph {source!r}", manifest.directory / MANIFEST)
    path = manifest.directory / name
    key = (str(path), manifest.signatures.get(source), path.stat().st_mtime_ns)
    if key not in _HEADS:
        _HEADS.clear()  # one directory's head at a time: a view of its mapped file
        _HEADS[key] = HeadEmbedding(path, key[1])
    return _HEADS[key]


_HEADS: dict[tuple, Any] = {}


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


