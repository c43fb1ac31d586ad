"""circleops.sources.models: every way to name a model loads the same weights as transformers does."""
from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from circleops.sources import models
from circleops.errors import ModelLoadError
from families import FAMILIES, example_ids


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.fixture
def no_fallback(monkeypatch):
    """The fast path (meta + mmap safetensors) must place every weight by itself."""
    def fail(*a, **k):
        raise AssertionError("load_hf_dir fell back to from_pretrained")
    monkeypatch.setattr(models, "_from_pretrained", fail)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_hf_dir_fast_path_matches_the_saved_model(family, tmp_path, no_fallback):
    model = family.build()
    model.save_pretrained(tmp_path)
    loaded = models.load_hf_dir(tmp_path)
    assert type(loaded) is type(model)
    assert not any(p.device.type == "meta" for p in loaded.parameters())
    ids = example_ids(8)
    torch.testing.assert_close(_logits(loaded, ids), _logits(model, ids), rtol=0, atol=0)


def test_tied_embeddings_are_tied_again(tmp_path, no_fallback):
    from families import BY_NAME

    model = BY_NAME["llama"].build(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    loaded = models.load_hf_dir(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(_logits(loaded, example_ids(8)), _logits(model, example_ids(8)), rtol=0, atol=0)


def test_hf_dir_loads_in_fp16(llama_dir, llama_model, no_fallback):
    loaded = models.load_hf_dir(llama_dir, dtype=torch.float16)
    assert {p.dtype for p in loaded.parameters()} == {torch.float16}
    ref = llama_model.state_dict()["model.layers.0.mlp.up_proj.weight"].half()
    assert torch.equal(loaded.state_dict()["model.layers.0.mlp.up_proj.weight"], ref)


def test_gguf_matches_the_model_it_was_written_from(llama_gguf, llama_model):
    loaded = models.load(str(llama_gguf))
    assert loaded.kind == "hf"
    ids = example_ids(8)
    torch.testing.assert_close(_logits(loaded.module, ids), _logits(llama_model, ids), rtol=0, atol=0)


def test_config_builds_random_weights_deterministically(llama_config):
    a = models.load(None, config=str(llama_config))
    b = models.load(None, config=str(llama_config))
    c = models.load(None, config=str(llama_config), seed=1)
    wa, wb, wc = (m.module.state_dict()["model.layers.1.self_attn.q_proj.weight"] for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert "random weights" in a.source


def test_config_in_fp16_is_built_in_fp16(llama_config):
    loaded = models.load(None, config=str(llama_config), dtype=torch.float16)
    assert {p.dtype for p in loaded.module.parameters()} == {torch.float16}


def test_pt2_loads_with_its_example_inputs(llama_pt2):
    loaded = models.load(str(llama_pt2))
    assert loaded.kind == "exported"
    (ids,) = loaded.example_args()
    assert ids.shape == (1, 8) and ids.dtype == torch.int64
    with pytest.raises(ModelLoadError, match="fixed input shapes"):
        loaded.example_args(16)


def test_example_args_are_deterministic_and_range_checked(llama_dir):
    loaded = models.load(str(llama_dir))
    (a,), (b,) = loaded.example_args(16), loaded.example_args(16)
    assert torch.equal(a, b) and a.shape == (1, 16) and int(a.max()) < loaded.config.vocab_size
    for bad in (0, loaded.max_seq_len + 1):
        with pytest.raises(ModelLoadError, match=rf"--seq-len {bad} is out of range .* 1\.\.128"):
            loaded.example_args(bad)


@pytest.mark.parametrize("case, match", [
    ("missing", "model not found"),
    ("no_config", "without config.json"),
    ("no_weights", "no \\*.safetensors weights"),
    ("bad_json", "not valid JSON"),
    ("bad_pt2", "is not a .pt2 archive"),
    ("config_as_model", "is a config file: pass it as --config"),
    ("bad_safetensors", "cannot read weights"),
])
def test_load_errors_say_what_is_wrong(case, match, tmp_path, llama_config):
    if case == "missing":
        spec = tmp_path / "nope"
    elif case == "no_config":
        spec = tmp_path
        (tmp_path / "model.safetensors").write_bytes(b"")
    elif case == "no_weights":
        spec = tmp_path
        (tmp_path / "config.json").write_text(llama_config.read_text())
    elif case == "bad_json":
        spec = tmp_path
        (tmp_path / "config.json").write_text("{not json")
    elif case == "bad_pt2":
        spec = tmp_path / "m.pt2"
        spec.write_bytes(b"not a zip file")
    elif case == "config_as_model":
        spec = llama_config
    else:
        spec = tmp_path
        (tmp_path / "config.json").write_text(llama_config.read_text())
        (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ModelLoadError, match=match):
        models.load(str(spec))


def _build_in_process(cache: str, barrier_dir: str) -> str:
    os.environ["CIRCLEOPS_CACHE"] = cache

    def build(tmp: Path) -> None:
        if barrier_dir:  # every process is building before any renames: a real race
            Path(barrier_dir, str(os.getpid())).touch()
            deadline = time.monotonic() + 30
            while len(os.listdir(barrier_dir)) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        (tmp / "weights.bin").write_bytes(os.urandom(1 << 20))
        (tmp / "config.json").write_text(json.dumps({"pid": os.getpid()}))

    return str(models.cached_dir("thing", {"format": 1}, build))


def test_cache_is_built_atomically_by_parallel_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")  # torch is imported already: fork is cheap
    with ctx.Pool(3) as pool:
        barrier = tmp_path.parent / (tmp_path.name + "-barrier")
        barrier.mkdir()
        paths = pool.starmap(_build_in_process, [(str(tmp_path), str(barrier))] * 3)
    assert len(set(paths)) == 1
    final = Path(paths[0])
    assert sorted(p.name for p in final.iterdir()) == ["circleops-cache.json", "config.json", "weights.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]  # no temporary directory left behind
    # a valid cache is reused, not rebuilt
    pid = json.loads((final / "config.json").read_text())["pid"]
    assert _build_in_process(str(tmp_path), "") == str(final)
    assert json.loads((final / "config.json").read_text())["pid"] == pid


def test_stale_cache_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("CIRCLEOPS_CACHE", str(tmp_path))
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "x").write_text(str(len(calls)))

    models.cached_dir("thing", {"format": 1}, build)
    path = models.cached_dir("thing", {"format": 2}, build)
    assert len(calls) == 2 and (path / "x").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["thing"]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_random_build_initializes_like_transformers(family):
    """build_random (parameters allocated once, one init pass) draws every parameter from
    the same distribution as cls(config): constants equal, random tensors the same scale."""
    import transformers

    config = family.config()
    cls = getattr(transformers, family.model_cls)
    torch.manual_seed(0)
    ref = {n: p.detach() for n, p in cls(config).named_parameters(remove_duplicate=False)}
    fast = models.build_random(cls, config)
    got = {n: p.detach() for n, p in fast.named_parameters(remove_duplicate=False)}
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        p = got[name]
        assert p.dtype == r.dtype and p.shape == r.shape and p.device.type == "cpu", name
        if r.numel() == 1 or float(r.std()) == 0.0:
            assert torch.equal(p, r), name
        else:
            assert abs(float(p.std()) - float(r.std())) < 0.15 * float(r.std()), name
            assert abs(float(p.mean()) - float(r.mean())) < 0.15 * float(r.std()) + 1e-3, name
    again = models.build_random(cls, config).state_dict()
    assert all(torch.equal(again[k], v) for k, v in fast.state_dict().items())  # seeded: the same every time
