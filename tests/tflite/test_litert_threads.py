"""LiteRT sessions run with the thread count NUM_THREADS gives, as onert's do (it used to be
always 2), and a NUM_THREADS that is not a count is refused by name."""
from __future__ import annotations

import ai_edge_litert.interpreter
import numpy as np
import pytest
import torch

import circleops
from circleops.errors import RuntimeRunError
from circleops.runtime import litert


@pytest.fixture
def tflite_file(tmp_path):
    path = tmp_path / "linear.tflite"
    ep = torch.export.export(torch.nn.Linear(4, 3), (torch.randn(1, 4),))
    circleops.save(ep, str(path), target="tflite")
    return path


@pytest.fixture
def interpreter_threads(monkeypatch):
    """The num_threads each LiteRT Interpreter is created with."""
    seen: list[int] = []
    real = ai_edge_litert.interpreter.Interpreter

    class Spy(real):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("num_threads"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ai_edge_litert.interpreter, "Interpreter", Spy)
    compiled = litert._compiled_model  # signature sessions: LiteRT's CompiledModel with a weight cache

    def spy_compiled(path, threads, cache):
        seen.append(threads)
        return compiled(path, threads, cache)

    monkeypatch.setattr(litert, "_compiled_model", spy_compiled)
    return seen


@pytest.mark.parametrize("value, threads", [("1", 1), ("3", 3), (None, litert.NUM_THREADS)])
def test_num_threads_reaches_the_interpreter(tflite_file, interpreter_threads, monkeypatch, value, threads):
    if value is None:
        monkeypatch.delenv("NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("NUM_THREADS", value)
    session = litert.Session(tflite_file)
    assert interpreter_threads == [threads]
    assert session.num_threads == threads
    x = np.ones((1, 4), np.float32)
    assert session.run([x])[0].shape == (1, 3)


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_num_threads_is_named(tflite_file, monkeypatch, value):
    monkeypatch.setenv("NUM_THREADS", value)
    with pytest.raises(RuntimeRunError, match="NUM_THREADS"):
        litert.Session(tflite_file)


def test_generation_graphs_run_with_the_manifests_threads(tmp_path, interpreter_threads, monkeypatch):
    """`convert --graphs --threads N --target tflite` records N; the Generator opens each
    graph (its signatures share one LiteRT Interpreter per thread count) with it, as for onert;
    the user's NUM_THREADS wins over the manifest."""
    import copy

    from families import BY_NAME

    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest

    monkeypatch.delenv("NUM_THREADS", raising=False)
    convert_graphs(copy.deepcopy(BY_NAME["llama"].build()), tmp_path / "g", target="tflite", prefill_len=8,
                   max_cache_len=32, threads=1)
    assert read_manifest(tmp_path / "g").num_threads == 1
    interpreter_threads.clear()
    gen = Generator(tmp_path / "g")
    # prefill, prefill_c16 (the first 16 cache slots) and decode: one Interpreter of the file shared
    sessions = [*gen.prefill_sessions.values(), *(s for _, s in gen.window_sessions[8]), gen.decode_session]
    # [1, 1]: the model that packed the new file's weight cache, then the one loaded over the
    # finished cache that the sessions share (litert._mapped_cache_model)
    assert interpreter_threads == [1, 1] and len({id(s._it) for s in sessions}) == 1 and len(sessions) == 3
    assert gen.generate([5, 17, 42], 2).tokens
    interpreter_threads.clear()
    monkeypatch.setenv("NUM_THREADS", "3")
    three = Generator(tmp_path / "g")
    assert interpreter_threads == [3]  # another thread count: an Interpreter of its own
    interpreter_threads.clear()
    mixed = Generator(tmp_path / "g", threads={"decode": 2})  # the prefills at NUM_THREADS: three's Interpreter
    assert interpreter_threads == [2] and mixed.prefill_session._it is three.prefill_session._it
    assert mixed.decode_session._it is not three.decode_session._it
