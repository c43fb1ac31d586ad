"""A Hugging Face model id as MODEL: resolved from a local HF cache (the layout huggingface_hub
writes: models--org--name/snapshots/<rev>/ and refs/main), offline; a clear error when the
model is neither cached nor downloadable."""
from __future__ import annotations

import shutil

import pytest

from circleops.sources import hub
from circleops.cli import main
from circleops.errors import ModelLoadError
from circleops.recipes.tasks import read_task_record

REV = "0123456789abcdef0123456789abcdef01234567"


def _cache_with(tmp_path, repo_id: str, model_dir) -> tuple:
    """An HF hub cache holding ``repo_id`` as a copy of ``model_dir``, as huggingface_hub lays it out."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / REV)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return cache, repo / "snapshots" / REV


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("HF_HUB_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_hub_id_converts_from_the_cache_offline(tiny_dir, tmp_path, clean_env, capsys):
    cache, snapshot = _cache_with(tmp_path, "tiny-org/vit-classifier", tiny_dir("vit"))
    clean_env.setenv("HF_HOME", str(cache.parent))  # HF_HOME/hub, as transformers reads it
    clean_env.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "vit.circle"
    assert main(["convert", "tiny-org/vit-classifier", "-o", str(out), "--target", "onert", "--verify"]) == 0
    assert "verify:  onert" in capsys.readouterr().out
    record = read_task_record(out)
    assert record["task"] == "image-classification" and record["model_dir"] == str(snapshot.resolve())


def test_hub_id_of_a_causal_lm_from_hf_hub_cache(tiny_dir, tmp_path, clean_env, capsys):
    cache, _ = _cache_with(tmp_path, "tiny-org/llama", tiny_dir("llama"))
    clean_env.setenv("HF_HUB_CACHE", str(cache))
    clean_env.setenv("HF_HUB_OFFLINE", "1")
    assert main(["convert", "tiny-org/llama", "-o", str(tmp_path / "l.circle"), "--seq-len", "4"]) == 0
    assert "outputs: logits [1, 4, 64]" in capsys.readouterr().out


def test_not_cached_and_offline_is_a_clear_error(tmp_path, clean_env, capsys):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    clean_env.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "x.circle"
    assert main(["convert", "nobody/not-a-model", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "nobody/not-a-model" in err and str(tmp_path / "empty") in err and "HF_HUB_OFFLINE" in err
    assert "Traceback" not in err and not out.exists()


def test_not_cached_and_unreachable_is_a_clear_error(tmp_path, clean_env):
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    clean_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache .*downloading it failed"):
        hub.resolve_model("nobody/not-a-model")


@pytest.mark.parametrize("spec, is_id", [("org/name", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
                                         ("smollm2", False), ("dir/model.gguf", False), ("a/b/c", False),
                                         ("./org/name", False), ("/abs/path", False)])
def test_what_reads_as_a_hub_id(spec, is_id):
    assert hub.is_repo_id(spec) is is_id


def test_a_local_directory_wins_over_a_hub_id(tiny_dir, tmp_path, clean_env, monkeypatch):
    local = tmp_path / "org" / "vit"
    shutil.copytree(tiny_dir("vit"), local)
    monkeypatch.chdir(tmp_path)
    clean_env.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve_model("org/vit") == "org/vit"
