"""Each graph's session opens at its own thread count (circleops.generate.graph_threads): a
budget (``Generator(threads=N)``, ``generate --threads N``) runs the prefill graphs at N and
onert's decode step at 1 (measured faster: bench/results/09-llm-speed.yaml); a mapping and a
NUM_THREADS set in the environment are honoured exactly; the tokens do not change."""
from __future__ import annotations

import os

import pytest

from generate_fixtures import TINY_NEW, TINY_PROMPTS

import circleops.generate as generate_module
from circleops.cli import main as cli
from circleops.errors import TargetError
from circleops.generate import Generator, graph_threads


@pytest.fixture
def opened(monkeypatch):
    """graph file name -> the NUM_THREADS its session was created under (None: unset)."""
    seen: dict[str, str | None] = {}
    real = generate_module.open_session

    def spy(runtime, path, signature=None, **kwargs):
        seen[os.path.basename(str(path)).split(".")[0] if signature is None else signature] = \
            os.environ.get("NUM_THREADS")
        return real(runtime, path, signature, **kwargs)

    monkeypatch.setattr(generate_module, "open_session", spy)
    monkeypatch.delenv("NUM_THREADS", raising=False)
    return seen


def test_a_budget_runs_prefill_at_it_and_onert_decode_at_one(tiny_onert, opened):
    gen = Generator(tiny_onert.directory, threads=2)
    prefills = list(gen.manifest.prefill_graphs.values())
    assert gen.threads == {**{g: 2 for g in prefills}, "decode": 1}
    assert opened == {**{g: "2" for g in prefills}, "decode": "1"}
    assert "NUM_THREADS" not in os.environ  # set only while each session is created
    for prompt in TINY_PROMPTS:  # the same greedy tokens as transformers
        assert gen.generate(prompt, TINY_NEW).tokens == tiny_onert.expected[tuple(prompt)]


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
    from circleops.manifest import read_manifest

    m = read_manifest(tiny_onert.directory)
    m.num_threads = 2  # what convert --threads 2 writes
    assert graph_threads(m, "onert") == {**{g: 2 for g in m.prefill_graphs.values()}, "decode": 1}
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


def test_cli_threads_reaches_the_sessions(tiny_onert, opened, capsys):
    ids = ",".join(str(i) for i in TINY_PROMPTS[0])
    assert cli(["generate", str(tiny_onert.directory), "--token-ids", ids, "--max-new-tokens", "2",
                "--threads", "2", "-q"]) == 0
    assert opened["decode"] == "1"
    assert {v for k, v in opened.items() if k != "decode"} == {"2"}
