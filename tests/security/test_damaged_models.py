"""Damaged or mismatched models: never converted silently with random weights, and bad
config values are a clear error, not a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from circleops.sources import models
from circleops.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
MISSING = "model.layers.0.mlp.down_proj.weight"


def _drop_tensor(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    del state[name]
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def damaged_llama(tmp_path):
    from families import BY_NAME

    torch.manual_seed(0)
    BY_NAME["llama"].build().save_pretrained(tmp_path)
    _drop_tensor(tmp_path, MISSING)
    return tmp_path


def test_missing_tensor_is_an_error_naming_it(damaged_llama):
    with pytest.raises(ModelLoadError, match=rf"missing from the checkpoint .*{MISSING}.*--allow-random-init"):
        models.load(str(damaged_llama))


def test_allow_random_init_opts_in(damaged_llama):
    loaded = models.load(str(damaged_llama), allow_random_init=True)
    assert dict(loaded.module.named_parameters())[MISSING].device.type == "cpu"


def test_base_model_loaded_as_lm_head_model_is_an_error(tmp_path):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=32)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        models.load(str(tmp_path))
    text = str(err.value)
    assert "BertLMHeadModel" in text and "cls.predictions" in text and "pooler.dense" in text


def test_complete_directory_still_loads(tmp_path):
    from families import BY_NAME

    BY_NAME["llama"].build().save_pretrained(tmp_path)
    assert models.load(str(tmp_path)).kind == "hf"


@pytest.mark.parametrize("key, value", [("hidden_size", -16), ("num_attention_heads", 0),
                                        ("num_hidden_layers", -1), ("vocab_size", -5)])
def test_bad_config_values_are_a_clear_error(tmp_path, key, value):
    from families import BY_NAME

    BY_NAME["llama"].build().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config"):
        models.load(str(tmp_path))
    with pytest.raises(ModelLoadError):
        models.load(None, config=str(tmp_path / "config.json"))


def _cli(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "circleops.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=ENV, timeout=600)


def test_cli_refuses_a_damaged_directory_and_converts_it_with_the_flag(damaged_llama, tmp_path):
    out = tmp_path / "m.circle"
    proc = _cli("convert", str(damaged_llama), "-o", str(out), "--quiet", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert MISSING in proc.stderr and "Traceback" not in proc.stderr and not out.exists()
    proc = _cli("convert", str(damaged_llama), "-o", str(out), "--quiet", "--allow-random-init", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.exists()


def test_cli_bad_config_value_is_one_paragraph(tmp_path):
    from families import BY_NAME

    d = tmp_path / "m"
    BY_NAME["llama"].build().save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = -16
    (d / "config.json").write_text(json.dumps(cfg))
    proc = _cli("convert", str(d), "-o", str(tmp_path / "m.circle"), "--quiet", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
