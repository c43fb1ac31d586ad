"""The verify's runtime child for a big file: a fresh interpreter, one per LiteRT file.

At the Gemma-3-1B shape the fp32 `convert --target tflite --verify` peaked in its LiteRT
child at 5.41 GB = 1.37x the fp32 weights: a forked child's resident set counts the parent's
pages it shares (1.15 GB there: torch, the reference logits), on top of the file's 4.0 GB of
packed weights; and each of the eleven graphs opened its own child, which loaded and
compiled the whole file again (issue 32). Now a file of FRESH_FROM_BYTES or more runs in a
fresh interpreter (circleops.runtime.fresh_child), and inside sharing_children() the
signatures of one LiteRT file share one child. Here on a tiny Llama's tflite file with the
threshold lowered to 0: the child holds none of a 512 MB block the parent has touched, and
a signature served by the child that ran another gives bit for bit what a child of its own gives.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from circleops.generation.caches import empty_caches
from circleops.package.manifest import read_manifest
from circleops.recipes.llm import convert_graphs
from circleops.runtime import isolated
from families import BY_NAME
from generate_fixtures import one_torch_thread

pytest.importorskip("ai_edge_litert")

# bytes the parent touches: a fork's RssAnon counts them; a fresh child's own anonymous memory
# (the interpreter, numpy, torch, LiteRT on the tiny file: 0.17 GB measured) stays far under
BALLAST = 512 << 20


@pytest.fixture(scope="module")
def tflite_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify_child")
    with one_torch_thread():
        convert_graphs(BY_NAME["llama"].build(), out, target="tflite", prefill_len=8, max_cache_len=16,
                       cache_windows=(), source="tiny llama")
    return out


def _inputs(manifest, graph):
    caches = empty_caches(manifest)
    if graph == "decode":
        return [np.array([[5]], np.int64), np.array([3], np.int64), *caches]
    ids = np.array([[5, 17, 3, 9, 0, 0, 0, 0]], np.int64)
    return [ids, np.zeros(1, np.int64), np.array([3], np.int64), *caches]


def _open(manifest, graph):
    path = manifest.directory / manifest.files[graph]
    return isolated.IsolatedSession("litert", path, manifest.signatures.get(graph))


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def test_a_big_files_child_holds_none_of_the_parents_memory(tflite_dir, monkeypatch):
    monkeypatch.setattr(isolated, "FRESH_FROM_BYTES", 0)  # the tiny file counts as big
    manifest = read_manifest(tflite_dir)
    ballast = np.ones(BALLAST // 8)  # touched: resident anonymous pages of this process
    session = _open(manifest, "decode")
    try:
        out = session.run(_inputs(manifest, "decode"))
        assert np.isfinite(out[0]).all()
        child = session.child_memory()
    finally:
        session.close()
    # a fork's RssAnon counts every anonymous page it shares with the parent, the ballast too
    assert 0 < child["RssAnon"] < BALLAST, child
    assert ballast.sum() == BALLAST // 8


def test_one_child_serves_every_signature_of_a_litert_file(tflite_dir, monkeypatch):
    monkeypatch.setattr(isolated, "FRESH_FROM_BYTES", 0)
    manifest = read_manifest(tflite_dir)
    assert len(set(manifest.files.values())) == 1 and {"prefill", "decode"} <= set(manifest.signatures)
    session = _open(manifest, "decode")  # outside a scope: a child of its own, ended with the session
    pid = session.child_pid
    alone = session.run(_inputs(manifest, "decode"))
    session.close()
    assert not _alive(pid)
    with isolated.sharing_children():
        prefill = _open(manifest, "prefill")
        pid = prefill.child_pid
        shared = {"prefill": prefill.run(_inputs(manifest, "prefill"))}
        prefill.close()  # the session goes, the child (and what it loaded) stays for the next
        assert _alive(pid)
        decode = _open(manifest, "decode")
        assert decode.child_pid == pid
        shared["decode"] = decode.run(_inputs(manifest, "decode"))
        del decode
    assert not _alive(pid)  # the scope ended it
    assert np.isfinite(shared["prefill"][0]).all()
    for got, want in zip(shared["decode"], alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_model_that_packed_the_weight_cache_is_replaced_by_one_mapping_it(tflite_dir, tmp_path, monkeypatch):
    """XNNPACK keeps its packing buffers with the model that built the weight cache (a tiny
    Gemma3's 0.28 GB file: 0.43 GB of heap after building, 0.17 GB loaded over the finished
    cache): the session runs on a model loaded again over the finished cache."""
    import weakref

    from circleops.runtime import litert

    monkeypatch.setenv(isolated.WEIGHT_CACHE_ENV, str(tmp_path))
    made = []

    class Recorded(litert._Compiled):
        def __init__(self, path, threads, cache):
            cached = cache.exists()
            super().__init__(path, threads, cache)
            made.append((weakref.ref(self), cached))

    monkeypatch.setattr(litert, "_Compiled", Recorded)
    monkeypatch.setattr(litert, "_SHARED", weakref.WeakValueDictionary())
    manifest = read_manifest(tflite_dir)
    path = manifest.directory / manifest.files["decode"]
    session = litert.Session(path, manifest.signatures["decode"])
    assert [cached for _, cached in made] == [False, True]  # built, then loaded over the finished cache
    assert made[0][0]() is None and made[1][0]() is session._it  # the builder is gone
    out = session.run(_inputs(manifest, "decode"))
    del session
    made.clear()
    again = litert.Session(path, manifest.signatures["decode"])  # the cache exists: loaded once
    assert [cached for _, cached in made] == [True]
    for got, want in zip(again.run(_inputs(manifest, "decode")), out, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_fresh_child_killed_for_memory_is_reported_as_such(tflite_dir):
    """The kernel's OOM killer sends SIGKILL: from a fresh child as from a fork, the error says
    out of memory, with the child's peak, not a fault in the file."""
    import signal

    from circleops.errors import RuntimeCrashError

    manifest = read_manifest(tflite_dir)
    session = isolated.IsolatedSession("litert", manifest.directory / manifest.files["decode"],
                                       manifest.signatures["decode"], fresh=True)
    pid = session.child_pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(RuntimeCrashError, match="killed by SIGKILL while running .*out of memory"):
        session.run(_inputs(manifest, "decode"))
    assert not _alive(pid)
