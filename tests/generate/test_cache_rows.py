"""The "rows" cache form (manifest cache_update): the graphs return only the new k/v rows and
the Generator writes them into its caches in place. It must compute what the "full" form
(whole caches out and back in) computes, on every runtime, and older directories still run."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

import manifest_json
from generate_fixtures import TINY_CACHE, TINY_NEW, TINY_PREFILL, TINY_PROMPTS, one_torch_thread

from circleops.errors import ModelLoadError, TargetError
from circleops.generation.generator import Generator, store_caches
from circleops.recipes.llm import convert_graphs, default_cache_update
from circleops.package.manifest import MANIFEST_VERSION, Manifest, read_manifest
from circleops.options import HEAD_MAJOR, SLOT_MAJOR

# (target, runtime) of the rows-form fixtures: every runtime the Generator supports for them
CASES = [("onert", "onert"), ("onert", "reference"), ("tflite", "litert")]


@pytest.fixture(scope="module")
def full_form(tmp_path_factory, tiny_model):
    """The tiny Llama converted with cache_update="full" for onert and tflite (lazily)."""
    dirs = {}

    def get(target: str):
        if target not in dirs:
            dirs[target] = tmp_path_factory.mktemp(f"full_{target}")
            with one_torch_thread():
                convert_graphs(copy.deepcopy(tiny_model), dirs[target], target=target, prefill_len=TINY_PREFILL,
                               max_cache_len=TINY_CACHE, cache_update="full")
        return dirs[target]
    return get


def _trace(gen: Generator, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """The logits of the prompt's last token and of ``steps`` greedy decode steps."""
    gen.reset()
    logits = [np.array(gen.feed(prompt))]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(np.array(gen.decode(tokens[-1])))
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def test_targets_default_to_rows_where_attention_is_not_the_in_place_builtin():
    assert default_cache_update("onert") == "rows" and default_cache_update("tflite") == "rows"
    assert default_cache_update("circle") == "full"  # ONE's ATTENTION updates the caches in place


@pytest.mark.parametrize("target,runtime", CASES, ids=[f"{t}-{r}" for t, r in CASES])
def test_rows_form_gives_the_full_forms_logits(request, full_form, target, runtime):
    rows_dir = request.getfixturevalue(f"tiny_{target}").directory
    rows, full = Generator(rows_dir, runtime=runtime), Generator(full_form(target), runtime=runtime)
    assert (rows.manifest.cache_update, full.manifest.cache_update) == ("rows", "full")
    steps = 2 if runtime == "reference" else 6  # the interpreter runs the decomposed graphs slowly
    # a prompt of two prefill chunks (the second re-runs cached tokens), then decode steps
    prompt = list(range(1, TINY_PREFILL + 4))
    got, got_tokens = _trace(rows, prompt, steps)
    want, want_tokens = _trace(full, prompt, steps)
    assert got_tokens == want_tokens
    for a, b in zip(got, want):
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("target", ["onert", "tflite"])
def test_full_form_still_generates_transformers_tokens(full_form, tiny_expected, target):
    gen = Generator(full_form(target))
    for prompt in TINY_PROMPTS[:2]:
        assert gen.generate(prompt, TINY_NEW).tokens == tiny_expected[tuple(prompt)]


def _slots(gen: Generator) -> list[np.ndarray]:
    """The Generator's caches as [1, C, Hkv, D] views (they are head-major, v transposed)."""
    n = gen.manifest.num_layers
    return [c.transpose(0, 2, 1, 3) for c in gen.caches[:n]] + [c.transpose(0, 3, 1, 2) for c in gen.caches[n:]]


def test_rows_are_written_into_the_same_cache_arrays(tiny_onert):
    """No cache is copied per step: the decode graph gets the Generator's arrays, and each
    step changes exactly the slot at its position (the rest stays as it was)."""
    gen = Generator(tiny_onert.directory)
    prompt = TINY_PROMPTS[2]  # fills the prefill graph: no padding rows written past it
    assert len(prompt) == TINY_PREFILL
    token = int(gen.feed(prompt).argmax())
    assert gen.manifest.cache_layout == HEAD_MAJOR
    assert [list(c.shape) for c in gen.caches] == [[1, 2, TINY_CACHE, 16]] * 2 + [[1, 2, 16, TINY_CACHE]] * 2
    arrays = [id(c) for c in gen.caches]
    before = [c.copy() for c in _slots(gen)]
    assert all(not c[:, len(prompt):].any() for c in before)  # nothing written past the prompt
    gen.decode(token)
    assert [id(c) for c in gen.caches] == arrays
    p = len(prompt)
    for old, new in zip(before, _slots(gen)):
        assert np.array_equal(old[:, :p], new[:, :p]) and not new[:, p + 1:].any()
        assert new[:, p].any()


def test_store_caches_drops_rows_past_the_end():
    rows = [np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2) + 1 for _ in range(2)]  # S=3, Hkv=2, D=2
    slots = [np.zeros((1, 4, 2, 2), np.float32) for _ in range(2)]
    out = store_caches(slots, rows, 2, "rows", SLOT_MAJOR)
    assert out[0] is slots[0] and out[1] is slots[1]
    for c in slots:
        assert np.array_equal(c[0, 2:], rows[0][0, :2]) and not c[:, :2].any()
    heads = [np.zeros((1, 2, 4, 2), np.float32), np.zeros((1, 2, 2, 4), np.float32)]  # k [1, H, C, D], v [1, H, D, C]
    store_caches(heads, rows, 2, "rows", HEAD_MAJOR)
    assert np.array_equal(heads[0].transpose(0, 2, 1, 3), slots[0])
    assert np.array_equal(heads[1].transpose(0, 3, 1, 2), slots[1])
    assert store_caches(slots, rows, 0, "full") == rows  # full: the outputs are the caches


def _manifest(tmp_path, **kw) -> Manifest:
    return Manifest(directory=tmp_path, target="onert", dtype="fp32", files={"prefill": "p.circle", "decode": "d.circle"},
                    signatures={"prefill": None, "decode": None}, prefill_len=8, max_cache_len=32, num_layers=2,
                    cache_shape=[1, 32, 2, 16], vocab_size=256, inputs=["input_ids", "pos"], outputs=["logits"], **kw)


def test_manifest_round_trip_and_older_versions(tmp_path):
    _manifest(tmp_path, cache_update="rows").write()
    data = manifest_json.read(tmp_path)
    assert data["version"] == MANIFEST_VERSION == 4 and data["kind"] == "text" and data["text"]["cache_update"] == "rows"
    assert read_manifest(tmp_path).cache_update == "rows" and read_manifest(tmp_path).cache_layout == SLOT_MAJOR
    _manifest(tmp_path, cache_update="rows", cache_layout=HEAD_MAJOR).write()
    m = read_manifest(tmp_path)
    assert m.cache_layout == HEAD_MAJOR and m.cache_shapes == [[1, 2, 32, 16]] * 2 + [[1, 2, 16, 32]] * 2
    # a version-1 directory (written before the field, flat) reads as the full form it is
    data = manifest_json.write_legacy(tmp_path, 1, drop=["cache_update"], cache_layout="[1, C, Hkv, D]")
    assert (read_manifest(tmp_path).cache_update, read_manifest(tmp_path).cache_layout) == ("full", SLOT_MAJOR)
    for bad, match in (({"version": 5}, "version 1 or 2 or 3 or 4"), ({"version": 2, "cache_update": "half"}, "cache_update"),
                       ({"version": 2, "cache_layout": "[C, D]"}, "cache_layout"),
                       ({"version": 2, "cache_layout": HEAD_MAJOR}, "cache_layout")):  # whole caches are slot-major
        (tmp_path / "manifest.json").write_text(json.dumps({**data, **bad}))
        with pytest.raises(ModelLoadError, match=match):
            read_manifest(tmp_path)


def test_unknown_cache_update_is_refused(tmp_path, tiny_model):
    with pytest.raises(TargetError, match="cache_update takes one of full, rows"):
        convert_graphs(tiny_model, tmp_path / "out", target="onert", prefill_len=4, max_cache_len=8,
                       cache_update="half")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_decoder_step_in_rows_form_equals_the_full_form(tiny_model):
    """In torch (before any lowering): DecoderWithCache with rows out and head-major caches
    in gives the full form's logits, a 5-token prefill then decode steps."""
    import torch

    from circleops.adapters.decode import DecoderWithCache
    from circleops.errors import CircleOpsError

    full = DecoderWithCache(copy.deepcopy(tiny_model), 16)
    rows = DecoderWithCache(copy.deepcopy(tiny_model), 16, cache_update="rows", cache_layout=HEAD_MAJOR)
    n = rows.num_layers
    assert [tuple(c.shape) for c in rows.empty_caches()] == [(1, 2, 16, 16)] * 2 * n  # Hkv 2, C 16, D 16
    cf, cr = full.empty_caches(), rows.empty_caches()
    with torch.no_grad():
        for ids, p in (([5, 17, 42, 99, 3], 0), ([7], 5), ([8], 6)):
            args = (torch.tensor([ids]), torch.tensor([p]))
            want, *cf = full(*args, *cf)
            got, *new = rows(*args, *cr)
            assert all(tuple(r.shape) == (1, len(ids), 2, 16) for r in new)
            for i, r in enumerate(new):  # the caller's in-place write: k [1, H, C, D], v [1, H, D, C]
                if i < n:
                    cr[i][0, :, p:p + len(ids)] = r[0].transpose(0, 1)
                else:
                    cr[i][0, :, :, p:p + len(ids)] = r[0].permute(1, 2, 0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(CircleOpsError, match="cache_layout"):
        DecoderWithCache(copy.deepcopy(tiny_model), 16, cache_layout=HEAD_MAJOR)  # whole caches come out slot-major


def test_a_new_prompt_reuses_the_cache_arrays_zeroed(tiny_onert):
    """reset keeps the caches' arrays (no allocation per prompt) and zeroes every slot the last
    conversation wrote, padding rows included: a short prompt after a long generation sees the
    caches a fresh Generator has, and gets its logits."""
    gen = Generator(tiny_onert.directory)
    gen.generate(TINY_PROMPTS[2], TINY_NEW, stop_at_eos=False)
    arrays = [id(c) for c in gen.caches]
    assert any(c.any() for c in gen.caches)
    short = TINY_PROMPTS[0][:3]  # shorter than the prefill graph: padding rows are written too
    logits = gen.prefill(short)
    assert [id(c) for c in gen.caches] == arrays
    fresh = Generator(tiny_onert.directory)
    fresh_logits = fresh.prefill(short)
    assert all(np.array_equal(a, b) for a, b in zip(gen.caches, fresh.caches))
    assert np.array_equal(logits, fresh_logits)
    gen.reset()
    assert [id(c) for c in gen.caches] == arrays and not any(c.any() for c in gen.caches)
