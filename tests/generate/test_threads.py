"""Each graph's session opens at its own thread count (circleops.generation.sessions.graph_threads): a
budget (``Generator(threads=N)``, ``generate --threads N``) runs the long prefill graph at N
and onert's graphs of few rows (decode, the short prefill) at 1 (measured faster:
bench/results/09-llm-speed.yaml); a mapping and a NUM_THREADS set in the environment are
honoured exactly; the tokens do not change."""
from __future__ import annotations

import os

import pytest

from generate_fixtures import TINY_CACHE, TINY_NEW, TINY_PROMPTS, Converted

import circleops.generation.sessions as sessions_module
from circleops.cli import main as cli
from circleops.errors import TargetError
from circleops.generation.generator import Generator, graph_threads


@pytest.fixture(scope="module")
def two_lengths(tmp_path_factory, tiny_model, tiny_expected) -> Converted:
    """The tiny Llama on onert with a 16-row and a 4-row prefill graph."""
    import copy

    from circleops.recipes.llm import convert_graphs

    out = tmp_path_factory.mktemp("tiny_16_4")
    convert_graphs(copy.deepcopy(tiny_model), out, target="onert", prefill_len="16,4", max_cache_len=TINY_CACHE,
                   source="tiny llama")
    return Converted(out, tiny_expected)


@pytest.fixture
def opened(monkeypatch):
    """graph file name -> the NUM_THREADS its session was created under (None: unset)."""
    seen: dict[str, str | None] = {}
    real = sessions_module.open_session

    def spy(runtime, path, signature=None, **kwargs):
        seen[os.path.basename(str(path)).split(".")[0] if signature is None else signature] = \
            os.environ.get("NUM_THREADS")
        return real(runtime, path, signature, **kwargs)

    monkeypatch.setattr(sessions_module, "open_session", spy)
    monkeypatch.delenv("NUM_THREADS", raising=False)
    return seen


def test_a_budget_runs_long_prefill_at_it_and_few_rows_at_one(two_lengths, opened):
    gen = Generator(two_lengths.directory, threads=2)
    assert gen.manifest.prefill_graphs == {16: "prefill", 4: "prefill_4"}
    assert gen.threads == {"prefill": 2, "prefill_4": 1, "decode": 1}
    assert opened == {"prefill": "2", "prefill_4": "1", "decode": "1"}
    assert "NUM_THREADS" not in os.environ  # set only while each session is created
    for prompt in TINY_PROMPTS:  # the same greedy tokens as transformers
        assert gen.generate(prompt, TINY_NEW).tokens == two_lengths.expected[tuple(prompt)]
    gen.generate(list(range(3, 20)), 2)  # a 17-token prompt: both prefill graphs run
    assert sorted(set(gen.chunks)) == [4, 16]


def test_a_mapping_is_honoured_exactly(tiny_onert, opened):
    gen = Generator(tiny_onert.directory, threads={"decode": 2})
    assert opened["decode"] == "2" and gen.threads["decode"] == 2
    # the graphs it does not name: the manifest's count (none here: the runtime's default)
    assert all(opened[g] is None for g in gen.manifest.prefill_graphs.values())


def test_the_users_num_threads_is_honoured_for_every_graph(tiny_onert, opened, monkeypatch):
    monkeypatch.setenv("NUM_THREADS", "3")
    gen = Generator(tiny_onert.directory)
    assert set(opened.values()) == {"3"} and len(opened) == len(gen.threads)
    assert os.environ["NUM_THREADS"] == "3"  # the user's value is left as it was
    gen = Generator(tiny_onert.directory, threads=2)  # the argument beats the environment
    assert opened["decode"] == "1" and os.environ["NUM_THREADS"] == "3"


def test_the_manifest_count_is_the_default_budget(tiny_onert, opened):
    from circleops.package.manifest import read_manifest

    m = read_manifest(tiny_onert.directory)
    m.num_threads = 2  # what convert --threads 2 writes
    assert graph_threads(m, "onert") == {**{g: 1 for g in m.prefill_graphs.values()}, "decode": 1}  # 8 rows
    assert graph_threads(m, "reference") == {**{g: 2 for g in m.prefill_graphs.values()}, "decode": 2}
    m.num_threads = 1  # GGML files' default
    assert set(graph_threads(m, "onert").values()) == {1}


def test_litert_runs_every_graph_at_the_budget(tiny_tflite, monkeypatch):
    monkeypatch.delenv("NUM_THREADS", raising=False)
    gen = Generator(tiny_tflite.directory, threads=1)
    assert {s.num_threads for s in (*gen.prefill_sessions.values(), gen.decode_session)} == {1}
    gen = Generator(tiny_tflite.directory, threads=3)  # no cap measured for LiteRT's decode
    assert {s.num_threads for s in (*gen.prefill_sessions.values(), gen.decode_session)} == {3}


@pytest.mark.parametrize("threads, message", [(0, "1 or more"), ({"decode": -1}, "1 or more"),
                                              ({"prefill_99": 2}, "does not have")])
def test_bad_threads_are_named(tiny_onert, threads, message):
    with pytest.raises(TargetError, match=message):
        Generator(tiny_onert.directory, threads=threads)


def test_cli_threads_reaches_the_sessions(two_lengths, opened, capsys):
    ids = ",".join(str(i) for i in TINY_PROMPTS[0])
    assert cli(["generate", str(two_lengths.directory), "--token-ids", ids, "--max-new-tokens", "2",
                "--threads", "2", "-q"]) == 0
    assert opened == {"prefill": "2", "prefill_4": "1", "decode": "1"}


def test_graphs_run_at_one_thread_are_lowered_for_one(two_lengths):
    """onert's few-row graphs run one thread, so their multi-row linears are FULLY_CONNECTED
    (circleops.recipes.llm.graph_options); the 16-row prefill keeps the 1x1 CONV_2D (faster with
    a second core) for its linears."""
    from circleops.serialize import read_model

    def linears(graph: str) -> dict[str, int]:
        ops = [op.opcode for op in read_model(str(two_lengths.directory / f"{graph}.circle")).subgraphs[0].operators]
        return {k: ops.count(k) for k in ("CONV_2D", "FULLY_CONNECTED")}

    long, short, decode = linears("prefill"), linears("prefill_4"), linears("decode")
    # the one-row lm_head is the same in every graph (CONV_2D only for an 8x wider output);
    # every other linear is FULLY_CONNECTED in 4 rows, as in decode, and CONV_2D in 16
    assert short == decode and short["CONV_2D"] <= 1 and short["FULLY_CONNECTED"] > 0
    assert sum(long.values()) == sum(short.values())
    assert long["CONV_2D"] == sum(short.values()) - 1 + short["CONV_2D"]


def test_ggml_files_plan_short_runs(two_lengths, monkeypatch):
    """The chunk plan counts a run's overhead by the files' weights and threads: GGML products
    cost the same per row in short runs, so an 8-token prompt is two 4-row runs there, one
    padded 16-row run in fp32 (circleops.generation.generator.GGML_RUN_OVERHEAD, PREFILL_RUN_OVERHEAD,
    ONE_THREAD_RUN_OVERHEAD)."""
    from circleops.generation.generator import ONE_THREAD_RUN_OVERHEAD, PREFILL_RUN_OVERHEAD

    gen = Generator(two_lengths.directory)
    assert gen.plan(0, 8) == [(16, 0)]
    assert gen.run_overhead == Generator(two_lengths.directory, threads=2).run_overhead == PREFILL_RUN_OVERHEAD
    # every prefill graph at one thread: a run counts less
    assert Generator(two_lengths.directory, threads=1).run_overhead == ONE_THREAD_RUN_OVERHEAD < PREFILL_RUN_OVERHEAD
    monkeypatch.setattr(gen.manifest, "quantize", "q4_0")
    assert gen.plan(0, 8) == [(4, 0), (4, 4)]
    assert gen.generate(TINY_PROMPTS[0], TINY_NEW).tokens == two_lengths.expected[tuple(TINY_PROMPTS[0])]
