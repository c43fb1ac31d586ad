"""Prefill graphs that read only the first W cache slots (target tflite's default, manifest
``prefill_windows``): a chunk at pos <= W runs the narrowest such graph, with the same logits
and caches as the full-cache graph; a chunk past every window runs the full one."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import manifest_json
from circleops.errors import ModelLoadError, TargetError
from circleops.generation.generator import Generator, cache_window
from circleops.recipes.llm import DECODE_MIN_WINDOW, convert_graphs, decode_windows, default_cache_windows
from circleops.package.manifest import read_manifest
from families import BY_NAME
from generate_fixtures import one_torch_thread

PREFILL, SHORT, CACHE, NEW = 16, 4, 128, 4


@pytest.fixture(scope="module")
def model():
    return BY_NAME["llama"].build(max_position_embeddings=512)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("windows")
    convert_graphs(BY_NAME["llama"].build(max_position_embeddings=512), d, target="tflite",
                   prefill_len=(PREFILL, SHORT), max_cache_len=CACHE, verify=True)
    return d


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 256, (n,), generator=g).tolist()


class _Counting:
    """A session wrapper counting its runs."""

    def __init__(self, session):
        self.session, self.runs = session, 0

    def run(self, inputs):
        self.runs += 1
        return self.session.run(inputs)


def test_tflite_writes_windows_down_to_twice_the_prefill(out):
    assert default_cache_windows("tflite", 64, 512, "rows") == (256, 128)
    assert default_cache_windows("onert", 64, 512, "rows") == ()  # a file per graph: every window a copy of the weights
    assert default_cache_windows("tflite", 64, 512, "full") == ()
    m = read_manifest(out)
    assert m.windowed_prefills == {"prefill_c64": (PREFILL, 64), "prefill_c32": (PREFILL, 32)}
    assert manifest_json.read(out)["text"]["prefill_windows"] == {
        "prefill_c64": [PREFILL, 64], "prefill_c32": [PREFILL, 32]}
    gen = Generator(out)
    shapes = {w: [tuple(s.shape) for s in session.inputs[3:]] for w, session in gen.window_sessions[PREFILL]}
    assert set(shapes) == {32, 64} and all(len(s) == 2 * 2 for s in shapes.values())
    for w, s in shapes.items():  # head-major k [1, Hkv, W, D], v [1, Hkv, D, W]
        assert s[0][2] == w and s[-1][3] == w and s[0][:2] == s[-1][:2]


def test_windows_give_the_full_cache_graphs_logits(out, model):
    """A 100-token prompt: chunks at 0, 16, 32 run the 32-slot graph, 48 and 64 the 64-slot
    one, the rest the full cache; the logits, the caches and the decode steps after them
    equal those of the full-cache graphs alone, and the model's."""
    prompt = _prompt(100)
    windowed, full = Generator(out), Generator(out)
    full.window_sessions = {}  # every chunk through the full-cache graph
    counted = {w: _Counting(s) for w, s in windowed.window_sessions[PREFILL]}
    windowed.window_sessions[PREFILL] = [(w, counted[w]) for w, _ in windowed.window_sessions[PREFILL]]
    starts = [s for n, s in windowed.plan(0, 96)]
    got, want = windowed.prefill(prompt[:96]), full.prefill(prompt[:96])
    assert {w: c.runs for w, c in counted.items()} == {32: sum(s <= 32 for s in starts),
                                                       64: sum(32 < s <= 64 for s in starts)}
    assert counted[32].runs == 3 and counted[64].runs == 2 and len(starts) > 5
    assert np.abs(got - want).max() < 1e-5
    assert all(np.array_equal(a, b) or np.abs(a - b).max() < 1e-5 for a, b in zip(windowed.caches, full.caches))
    steps = [got] + [windowed.decode(t) for t in prompt[96:]]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, 95:].numpy()
    assert np.abs(np.stack(steps) - ref).max() < 1e-4


@pytest.mark.parametrize("n", [5, 40, 100])
def test_windows_keep_transformers_tokens(out, model, n):
    prompt = _prompt(n)
    result = Generator(out).generate(prompt, NEW, stop_at_eos=False)
    with torch.no_grad(), one_torch_thread():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                            attention_mask=torch.ones(1, n, dtype=torch.long))
    assert result.tokens == hf[0, n:].tolist()


def test_decode_windows_down_to_the_minimum(out):
    assert decode_windows(None, "tflite", 512, "rows") == (256, 128, 64, 32) and DECODE_MIN_WINDOW == 32
    assert decode_windows(None, "onert", 512, "rows") == () and decode_windows(None, "tflite", 512, "full") == ()
    assert decode_windows((100,), "tflite", 512, "rows") == (100,)  # --cache-windows names them for both
    m = read_manifest(out)
    assert m.windowed_decodes == {"decode_c64": 64, "decode_c32": 32}
    assert manifest_json.read(out)["text"]["decode_windows"] == {"decode_c64": 64, "decode_c32": 32}
    gen = Generator(out)
    for w, session in gen.decode_windows:  # head-major k [1, Hkv, W, D], v [1, Hkv, D, W]
        assert session.inputs[2].shape[2] == w and session.inputs[-1].shape[3] == w


def test_decode_windows_give_the_full_cache_steps(out, model):
    """Decode steps from pos 20 to 75: those at pos <= 32 run the 32-slot graph, up to 64 the
    64-slot one, the rest the full cache; each step's logits equal the full-cache graph's
    (a Generator without windows) and the model's."""
    prompt = _prompt(76)
    windowed, full = Generator(out), Generator(out)
    full.decode_windows = []
    counted = {w: _Counting(s) for w, s in windowed.decode_windows}
    windowed.decode_windows = [(w, counted[w]) for w, _ in windowed.decode_windows]
    steps, want = [windowed.prefill(prompt[:20])], [full.prefill(prompt[:20])]
    for t in prompt[20:]:
        steps.append(windowed.decode(t))
        want.append(full.decode(t))
    # positions 20..75: <= 32 -> 13 steps, 33..64 -> 32 steps, 65..75 full
    assert {w: c.runs for w, c in counted.items()} == {32: 13, 64: 32}
    assert np.abs(np.stack(steps) - np.stack(want)).max() < 1e-5
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, 19:].numpy()
    assert np.abs(np.stack(steps) - ref).max() < 1e-4


def test_cache_window_views_are_the_first_slots():
    k = np.arange(1 * 2 * 8 * 3, dtype=np.float32).reshape(1, 2, 8, 3)
    v = np.arange(1 * 2 * 3 * 8, dtype=np.float32).reshape(1, 2, 3, 8)
    wk, wv = cache_window([k, v], 4, "k [1, Hkv, C, D], v [1, Hkv, D, C]")
    assert np.array_equal(wk, k[:, :, :4]) and np.array_equal(wv, v[..., :4]) and np.shares_memory(wk, k)
    (slot,) = cache_window([np.zeros((1, 8, 2, 3))], 5)
    assert slot.shape == (1, 5, 2, 3)


def test_bad_windows_are_refused(tmp_path, out):
    with pytest.raises(TargetError, match="out of range"):
        convert_graphs(BY_NAME["llama"].build(), tmp_path / "a", target="tflite", prefill_len=8, max_cache_len=32,
                       cache_windows=[32])
    with pytest.raises(TargetError, match="cache_update='rows'"):
        convert_graphs(BY_NAME["llama"].build(), tmp_path / "b", target="tflite", prefill_len=8, max_cache_len=32,
                       cache_windows=[16], cache_update="full")
    bad = tmp_path / "m"
    bad.mkdir()
    manifest_json.edit(out, {"prefill_windows": {"prefill_c64": [PREFILL, CACHE]}}, to=bad)  # as large as the cache
    (bad / "model.tflite").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="prefill_windows"):
        read_manifest(bad)
    manifest_json.edit(out, {"decode_windows": {"decode_c64": CACHE}}, to=bad)  # as large as the cache
    with pytest.raises(ModelLoadError, match="decode_windows"):
        read_manifest(bad)
    manifest_json.edit(out, {"decode_windows": {"decode_c99": 16}}, to=bad)  # a graph the directory lacks
    with pytest.raises(ModelLoadError, match="decode_windows"):
        read_manifest(bad)


def test_cli_cache_windows(tmp_path, capsys):
    """`convert --graphs --cache-windows`: the windows asked for, 'none' for none, nonsense refused
    before the model loads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from circleops.cli import main

    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(llama))
    base = ["convert", str(llama), "--graphs", "prefill,decode", "--seq-len", "4", "--max-cache-len", "32",
            "--target", "tflite", "-q"]
    assert main([*base, "-o", str(tmp_path / "default")]) == 0
    assert read_manifest(tmp_path / "default").windowed_prefills == {"prefill_c16": (4, 16), "prefill_c8": (4, 8)}
    assert main([*base, "--cache-windows", "none", "-o", str(tmp_path / "none")]) == 0
    m = read_manifest(tmp_path / "none")
    assert m.prefill_windows is None and m.decode_windows is None and set(m.files) == {"prefill", "decode"}
    assert main([*base, "--cache-windows", "12", "-o", str(tmp_path / "twelve")]) == 0
    assert read_manifest(tmp_path / "twelve").windowed_prefills == {"prefill_c12": (4, 12)}
    assert read_manifest(tmp_path / "twelve").windowed_decodes == {"decode_c12": 12}
    assert Generator(tmp_path / "twelve").generate([5, 17, 42, 7, 9, 11, 3], 3).tokens
    capsys.readouterr()
    assert main([*base, "--cache-windows", "half", "-o", str(tmp_path / "bad")]) == 2
    assert "--cache-windows takes cache slot counts" in capsys.readouterr().err


def test_generators_on_one_file_in_threads(out):
    """Two Generators on one directory share its LiteRT Interpreter (one per file and thread
    count): run from two threads at once they give the tokens each gives alone."""
    import threading

    prompts = [_prompt(40), _prompt(70)]
    alone = [Generator(out).generate(p, NEW, stop_at_eos=False).tokens for p in prompts]
    gens = [Generator(out), Generator(out)]
    assert gens[0].prefill_session._it is gens[1].prefill_session._it
    got: dict[int, list[list[int]]] = {0: [], 1: []}

    def work(i):
        for _ in range(4):
            got[i].append(gens[i].generate(prompts[i], NEW, stop_at_eos=False).tokens)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {i: [alone[i]] * 4 for i in (0, 1)}


def _windows_in_place(gen) -> dict[int, bool]:
    """Window -> whether that decode session's own input memory equals the caches' first W slots."""
    views = {id(s): v for s, v in gen._store._views.values()}
    out = {}
    for w, session in [*gen.decode_windows, (CACHE, gen.decode_session)]:
        mine = views.get(id(session))
        if mine is not None:
            out[w] = all(np.array_equal(v, c) for v, c in zip(mine, cache_window(gen.caches, w, gen.cache.layout)))
    return out


def test_caches_read_in_place_stay_current(out):
    """LiteRT's decode steps write only their new rows into the session's own input buffers
    (WindowStore, issue 34): over steps through the 32- and 64-slot windows and the full
    cache, a chunk fed between them (a prefill: the buffers go stale and are copied again) and
    a new prompt, each step's logits and the caches equal the copying path's bit for bit, and
    the buffer the step read equals the caches' window. Not writing the rows into the buffer
    makes the next step read a stale window (logits off by ~1 on this model). The steps' outputs
    are read in place too (their buffers' memory, no TensorBuffer.read): the logits a step
    returned stay what they were after the next step overwrites that memory."""
    from circleops.runtime import litert

    if litert._c_api() is None:
        pytest.skip("this LiteRT wheel has no LiteRtGetTensorBufferHostMemory: generation copies its caches")
    in_place, copied = Generator(out), Generator(out)
    copied.caches_in_place = False
    prompt = _prompt(90)
    for gen in (in_place, copied):
        gen.prefill(prompt[:20])
    kept = None  # (a step's logits as returned, a copy of them)
    for i, t in enumerate(prompt[20:]):
        if i == 50:  # pos 70: a 6-token chunk through the prefill graph between decode steps
            got, want = in_place.feed(prompt[70:76]), copied.feed(prompt[70:76])
            assert np.array_equal(got, want)
        if 50 <= i < 56:
            continue
        got, want = in_place.decode(t), copied.decode(t)
        assert np.array_equal(got, want), f"step {i} at pos {in_place.position - 1}"
        assert in_place.cache_io == "in place" and copied.cache_io == "copied"
        if kept is not None:
            assert np.array_equal(*kept), f"step {i} overwrote the logits the step before returned"
        kept = (got, got.copy())
        ran = next(w for w in (32, 64, CACHE) if in_place.position - 1 <= w)  # the step's window
        session = dict([*in_place.decode_windows, (CACHE, in_place.decode_session)])[ran]
        assert in_place._store.outputs_shared(session) and not copied._store.outputs_shared(session)
        assert _windows_in_place(in_place)[ran]  # the buffer it read, written a row a step, is the window
    assert all(np.array_equal(a, b) for a, b in zip(in_place.caches, copied.caches))
    again = [g.generate(prompt[:10], NEW, stop_at_eos=False) for g in (in_place, copied)]
    assert again[0].tokens == again[1].tokens and again[0].cache_io == "in place"
    assert "KV caches in place" in again[0].timing_line()


def test_caches_copied_where_litert_gives_no_views(out, monkeypatch):
    """Without LiteRT's host-memory symbol (an older or foreign wheel) the caches go in by copy,
    with the same tokens, and the generation says so."""
    from circleops.runtime import litert

    prompt = _prompt(40)
    want = Generator(out).generate(prompt, NEW, stop_at_eos=False).tokens
    monkeypatch.setattr(litert, "_C_API", [None])
    result = Generator(out).generate(prompt, NEW, stop_at_eos=False)
    assert result.tokens == want and result.cache_io == "copied"
    assert "KV caches copied" in result.timing_line()


def test_a_step_on_its_own_memory_still_checks_the_other_inputs(out):
    """A decode step passing the session's own input memory for its caches (input_views) skips
    their checks and copies (issue 34); the inputs that are not that memory (ids, pos) are still
    checked: a float id or a [1, 2] ids array is refused by name, not cast or truncated into the
    buffer."""
    from circleops.errors import RuntimeRunError
    from circleops.runtime import litert

    if litert._c_api() is None:
        pytest.skip("this LiteRT wheel has no LiteRtGetTensorBufferHostMemory: no input memory to pass")
    gen = Generator(out)
    gen.prefill(_prompt(5))
    gen.decode(7)  # binds the decode session's views
    session = gen.decode_windows[0][1]
    views = session.input_views()
    # LiteRT's own run: the suite wraps every Session in a cross-check whose reference
    # interpreter would refuse these inputs too (tests/conftest.py)
    own = next(c for c in type(session).__mro__ if c.__module__ == litert.__name__).run
    good = [np.zeros((1, 1), np.int64), np.array([5], np.int64), *views[2:]]
    assert len(own(session, good)) == len(session.outputs)
    for bad, what in ((np.zeros((1, 1), np.float32), "is float32"), (np.zeros((1, 2), np.int64), r"has shape \[1, 2\]")):
        with pytest.raises(RuntimeRunError, match=f"input #0 .*{what}"):
            own(session, [bad, *good[1:]])


def test_greedy_loop_reads_the_logits_in_place(out, monkeypatch):
    """Greedy generation on LiteRT picks each token from the decode step's own output memory
    (its argmax is done before the next run overwrites it): no copy of the vocabulary-sized
    logits per step (issue 34); decode(), which returns logits the caller may keep, still
    copies. The tokens equal those of a generator whose steps copy their outputs."""
    from circleops.runtime import litert

    if litert._c_api() is None:
        pytest.skip("this LiteRT wheel has no LiteRtGetTensorBufferHostMemory: outputs are read by copy")
    prompt = _prompt(12)
    want = Generator(out)
    want.caches_in_place = False  # every step reads its outputs through copies
    want = want.generate(prompt, 2 * NEW, stop_at_eos=False).tokens
    gen = Generator(out)

    def copying(token):
        raise AssertionError("the greedy loop copied a step's logits (Generator.decode)")

    monkeypatch.setattr(gen, "decode", copying)
    result = gen.generate(prompt, 2 * NEW, stop_at_eos=False)
    assert result.tokens == want and result.decode_steps == 2 * NEW - 1 and result.cache_io == "in place"
    assert gen._logits_shared  # the last step's logits were the session's memory, not a copy
    monkeypatch.undo()
    first = gen.decode(5)
    kept = first.copy()
    gen.decode(6)
    assert np.array_equal(first, kept)  # decode's logits survive the next step
