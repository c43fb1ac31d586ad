"""Every refusal that the model's sizes decide comes before any work (issue 32): the
parameter count from the safetensors headers or the config (circleops.sources.sizes), the target's
file-size limit, the cache length against the model's positions, and the machine's memory.
The model is never loaded: ``models.load`` raises if it is called."""
from __future__ import annotations

import json

import pytest
import torch

from circleops.sources import models
from circleops.sources import sizes
from circleops.cli import main

# A Llama-3.2-1B config: 1.24 B parameters, 4.9 GB in fp32
LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5)
LLAMA_1B_PARAMETERS = 1235814400  # sum(p.numel()) of transformers' LlamaForCausalLM of it


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before a refusal that its sizes decide")

    monkeypatch.setattr(models, "load", refuse)


@pytest.fixture
def config_1b(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_1B))
    return path


def _error(capsys, *args: str) -> str:
    code = main(["convert", *args])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


TINY = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.parametrize("family,extra", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("mistral", {}), ("qwen2", {}),
    ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}), ("olmo2", {"eos_token_id": 1, "pad_token_id": 1}),
    ("gemma", {"head_dim": 16}), ("gemma2", {"head_dim": 16}), ("gemma3_text", {"head_dim": 16})])
def test_parameters_from_the_config_match_the_model(family, extra):
    """The closed form of a dense family's parameter count is the count of the model
    transformers builds of the config (on meta: no memory)."""
    cfg = dict(model_type=family, **TINY, **extra)
    config = models.build_config(cfg, family)
    with torch.device("meta"):
        module = models.model_class(config, cfg, family)(config)
    assert sizes.dense_parameters(cfg) == sum(p.numel() for p in module.parameters())


def test_1b_config_parameters_and_bytes():
    assert sizes.dense_parameters(LLAMA_1B) == LLAMA_1B_PARAMETERS
    assert sizes.weight_bytes(LLAMA_1B_PARAMETERS, None) == 4 * LLAMA_1B_PARAMETERS
    assert sizes.weight_bytes(LLAMA_1B_PARAMETERS, "q4_0") == LLAMA_1B_PARAMETERS * 18 // 32
    assert sizes.weight_bytes(LLAMA_1B_PARAMETERS, None, torch.float16) == 2 * LLAMA_1B_PARAMETERS


def test_parameters_from_safetensors_headers(llama_dir, llama_model):
    """An HF directory's count is read from its safetensors headers: the model's own."""
    est = sizes.estimate(llama_dir, quantize="q8_0")
    assert est.parameters == sum(p.numel() for p in llama_model.parameters())
    assert est.weight_bytes == int(est.parameters * 34 / 32) and est.float_bytes == 4 * est.parameters


def test_onert_file_limit_refused_before_loading(capsys, tmp_path, config_1b, no_load):
    """One file past onert's 2 GiB is refused from the sizes alone. (Graphs past it are split into
    layer-range files instead: tests/generate/test_split.py, tests/cli/test_cli_convert.py.)"""
    out = tmp_path / "m.circle"
    err = _error(capsys, "--config", str(config_1b), "--target", "onert", "--verify", "-o", str(out))
    assert f"the model needs at least {4 * LLAMA_1B_PARAMETERS} bytes (> 2 GiB) for target onert" in err
    assert not out.exists()


def test_cache_length_refused_before_loading(capsys, tmp_path, config_1b, no_load):
    err = _error(capsys, "--config", str(config_1b), "--target", "tflite", "--graphs", "prefill,decode",
                 "--max-cache-len", "200000", "-o", str(tmp_path / "out"))
    assert "--max-cache-len 200000 is more than" in err and "max_position_embeddings 131072" in err


def test_machine_memory_refused_before_loading(capsys, tmp_path, config_1b, no_load, monkeypatch):
    monkeypatch.setattr(sizes, "machine_memory", lambda: (4 * 2**30, 2 * 2**30))  # a 4 GiB machine
    err = _error(capsys, "--config", str(config_1b), "--target", "tflite", "--graphs", "prefill,decode",
                 "-o", str(tmp_path / "out"))
    assert "1.24 B parameters" in err and "needs about 6.4 GB of memory" in err and "has 4.3 GB" in err
