"""One onert file with a signature per generation graph, weights shared (circleops.runtime.onert_c).

onert 0.1.0 runs only subgraph 0 of a file, so target onert writes a file per graph, each
with every weight; onert 0.2.0.dev250922's C API selects a signature (nnfw_set_signature_run)
on one prepared session. Which one a convert writes follows the installed onert; the
manifest says which (``signature_api``). The C API tests need onert 0.2.0.dev: .ci/run
installs it in a venv of its own and runs this file there (the base environment keeps
onert 0.1.0, where they are skipped and the fallback tests run).
"""
from __future__ import annotations

import collections
import copy
import json
import os

import pytest

import manifest_json
from families import BY_NAME
from generate_fixtures import TINY_CACHE, TINY_PROMPTS, hf_greedy

from circleops.errors import TargetError
from circleops.generation.generator import Generator
from circleops.package.files import signature_files
from circleops.recipes.llm import convert_graphs
from circleops.runtime import onert_c, selects_signatures
from circleops.serialize import read_model
from circleops.targets import PROFILES

C_API = onert_c.available()
needs_c_api = pytest.mark.skipif(not C_API, reason="the installed onert (0.1.0) has no nnfw_set_signature_run; "
                                                   ".ci/run runs this file with onert 0.2.0.dev250922")
NEW = 10


@pytest.fixture(scope="module")
def model():
    return BY_NAME["llama"].build(num_hidden_layers=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def expected(model):
    return {tuple(p): hf_greedy(model, p, NEW) for p in TINY_PROMPTS[:2]}


def _convert(model, out, **kw):
    return convert_graphs(copy.deepcopy(model), out, target="onert", prefill_len=4, max_cache_len=TINY_CACHE,
                          **kw)


def test_the_file_layout_follows_the_installed_onert():
    assert onert_c.library_path() is not None  # the wheel's own libonert.so
    assert signature_files(PROFILES["onert"], None) is C_API
    assert selects_signatures("onert") is C_API
    assert signature_files(PROFILES["onert"], False) is False
    assert signature_files(PROFILES["tflite"], True) is False  # LiteRT selects signatures anyway


def _opcodes(path):
    return {op.opcode for sub in read_model(str(path)).subgraphs for op in sub.operators}


@pytest.fixture(scope="module")
def per_graph(model, tmp_path_factory):
    """A directory of a file per graph (what onert 0.1.0 runs)."""
    out = tmp_path_factory.mktemp("per_graph") / "out"
    _convert(model, out, onert_signatures=False)
    return out


def test_a_file_per_graph_when_asked(per_graph):
    data = manifest_json.read(per_graph)
    assert data["files"] == {g: f"{g}.circle" for g in ("prefill", "decode")}
    assert set(data["signatures"].values()) == {None} and "signature_api" not in data and data["version"] == 4


def test_a_file_shared_by_signatures_holds_its_weights_once_in_onert(tmp_path):
    """onert's CPU backend copies a constant CONV_2D filter (transposed) in every subgraph
    that uses it, while FULLY_CONNECTED reads the loaded weight: the 1B shape's fp32 split
    files with three signatures held ~2.4x their weights in onert (generate 11.7 GB,
    bench/results/39). So a file whose graphs share the weights writes every linear as
    FULLY_CONNECTED (pipeline.stages.target_profile ``shared_weights``); a file of its own
    keeps the faster 1x1 CONV_2D (here the lm_head, 8x wider than the hidden state)."""
    wide = BY_NAME["llama"].build(num_hidden_layers=1, tie_word_embeddings=True, vocab_size=512)
    for signatures, want in ((False, "decode.circle"), (True, "model.circle")):
        convert_graphs(copy.deepcopy(wide), tmp_path / str(signatures), target="onert", graphs="decode",
                       prefill_len=4, max_cache_len=TINY_CACHE, onert_signatures=signatures)
        ops = _opcodes(tmp_path / str(signatures) / want)
        assert ("CONV_2D" in ops) is not signatures and "FULLY_CONNECTED" in ops, (signatures, ops)


@pytest.mark.skipif(C_API, reason="the refusal of onert 0.1.0")
def test_signature_files_on_onert_0_1_are_refused_with_what_to_install(model, tmp_path):
    _convert(model, tmp_path / "out", onert_signatures=True)
    with pytest.raises(TargetError, match=r"onert-signatures"):
        Generator(tmp_path / "out", runtime="onert")
    assert Generator(tmp_path / "out", runtime="reference").generate(TINY_PROMPTS[0], 3).tokens


@needs_c_api
def test_one_file_shared_by_every_graph_gives_transformers_tokens(model, expected, tmp_path):
    out = tmp_path / "out"
    _convert(model, out, verify=True)  # verify runs each signature on onert (in a child process)
    data = manifest_json.read(out)
    assert set(data["files"].values()) == {"model.circle"} and data["signature_api"] == "nnfw-c"
    assert data["signatures"] == {g: g for g in data["files"]} and data["version"] == 4
    gen = Generator(out, runtime="onert")
    sessions = [*gen.prefill_sessions.values(), gen.decode_session]
    assert all(isinstance(s, onert_c.SignatureSession) for s in sessions)
    assert len({id(s._native) for s in sessions}) == 1  # one native session: the weights once
    for prompt, want in expected.items():  # prefill -> decode -> prefill again on one session
        assert gen.generate(list(prompt), NEW).tokens == want


@needs_c_api
def test_split_parts_with_signatures(model, expected, tmp_path, monkeypatch):
    """A split model on onert 0.2: one file per layer range, each with every graph's signature."""
    from circleops.package.split import TABLE_BYTES, WEIGHT_SHARE, part_bytes

    sizes = part_bytes(model)
    limit = int((sizes.embedding + sizes.layers[0] + TABLE_BYTES) / WEIGHT_SHARE) + 4096
    out = tmp_path / "out"
    _convert(model, out, max_file_bytes=limit)
    data = manifest_json.read(out)
    assert data["parts"] == [[0, 1], [1, 2], [2, 3]]
    assert data["part_files"]["decode"] == data["part_files"]["prefill"] == ["part0.circle", "part1.circle",
                                                                             "part2.circle"]
    loads = _count_loads(monkeypatch)
    gen = Generator(out, runtime="onert")
    for prompt, want in expected.items():
        assert gen.generate(list(prompt), NEW).tokens == want
    # each part loaded once, its graphs' signatures switched on that one session (a part opened
    # per graph would hold its weights once per graph: the 1B shape's parts are 4.94 GB)
    parts = sorted(str(out / f) for f in set(data["part_files"]["decode"]))
    assert sorted(loads) == parts and set(loads.values()) == {1}, loads
    assert all(os.path.realpath(p) in _mapped_files() for p in parts)  # the weights are the files' pages (weights_mapped)


def _count_loads(monkeypatch):
    """{file: times onert's C API loaded it} from now on."""
    loads = collections.Counter()
    init = onert_c._Native.__init__

    def counted(self, path, *args, **kw):
        loads[str(path)] += 1
        init(self, path, *args, **kw)

    monkeypatch.setattr(onert_c._Native, "__init__", counted)
    return loads


def _mapped_files():
    """The files this process maps now (/proc/self/maps)."""
    return {line.split(None, 5)[5].strip() for line in open("/proc/self/maps") if len(line.split(None, 5)) == 6}


@pytest.mark.skipif(not onert_c.library_path(), reason="needs onert")
def test_onert_keeps_a_file_per_graph_mapped_not_copied(per_graph):
    """onert 0.1.0's Python API (a file per graph) loads with USE_MMAPED_DATA as the C API
    does: the constants stay pages of the file, so the files are in this process's maps after
    the load (onert unmaps a file whose constants it copied: the heap held them). The tokens
    on such files: tests/generate/test_generate.py."""
    gen = Generator(per_graph, runtime="onert")
    assert all(os.path.realpath(per_graph / f) in _mapped_files() for f in ("prefill.circle", "decode.circle"))
    assert gen.generate([5, 17, 42], 2).tokens  # and they run
