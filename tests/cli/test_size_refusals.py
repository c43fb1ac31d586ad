"""Every refusal that the model's sizes decide comes before any work (issue 32): the
parameter count from the safetensors headers or the config (circleops.sources.sizes), the target's
file-size limit, the cache length against the model's positions, and the machine's memory.
The model is never loaded: ``models.load`` raises if it is called."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch

from families import BY_NAME
from header_only import header_only_dir

from circleops.inputs.user_files import read_safetensors_header
from circleops.package import split
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


# Llama-3.2-3B's config: 3.21 B parameters, 12.85 GB in fp32
LLAMA_3B = dict(LLAMA_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)
GIB_24 = (24 * 2**30, 20 * 2**30)  # the 24 GiB machine the 1B and 3B shapes were measured on


GIB_16 = (16 * 2**30, 13 * 2**30)


@pytest.mark.parametrize("verify, needed", [(False, "19.8 GB"), (True, "20.3 GB")])
def test_integer_graphs_memory_refused_before_loading(capsys, tmp_path, no_load, monkeypatch, verify, needed):
    """The int16 recipe's graphs peak at 1.54x the fp32 weights at 1B (1.58x with --verify, results
    74): the 3B shape on a machine it does not fit (16 GiB) is refused from its headers, not
    OOM-killed an hour in (it passes the 1.3x check every other convert is held to: 16.7 GB)."""
    monkeypatch.setattr(sizes, "machine_memory", lambda: GIB_16)
    model = header_only_dir(tmp_path / "llama-3b", LLAMA_3B)
    err = _error(capsys, str(model), "--graphs", "prefill,decode", "--target", "circle", "--quantize", "int16",
                 "--weight-bits", "4", *(["--verify"] if verify else []), "-o", str(tmp_path / "out"))
    assert "3.21 B parameters" in err and f"needs about {needed} of memory" in err and "at 1B" in err, err


@pytest.mark.parametrize("verify, needed", [(False, "22.1 GB"), (True, "22.9 GB")])
def test_uint8_graphs_memory_refused_before_loading(capsys, tmp_path, no_load, monkeypatch, verify, needed):
    """uint8's graphs peak at 1.72x the fp32 weights at 1B (1.78x with --verify; results 72 / 74): the
    3B shape is refused from its headers on a machine it does not fit (16 GiB); the 1.3x every
    other convert is held to (16.7 GB) let it start."""
    monkeypatch.setattr(sizes, "machine_memory", lambda: GIB_16)
    model = header_only_dir(tmp_path / "llama-3b", LLAMA_3B)
    err = _error(capsys, str(model), "--graphs", "prefill,decode", "--target", "circle", "--quantize", "uint8",
                 *(["--verify"] if verify else []), "-o", str(tmp_path / "out"))
    assert "3.21 B parameters" in err and f"needs about {needed} of memory" in err and "uint8 --graphs" in err, err


def test_integer_graphs_peak_leaves_what_fits(tmp_path, monkeypatch):
    """What those peaks leave on the 24 GiB machine: the 1B shape's int16 and uint8 graphs with
    --verify, the 3B shape's int16 and uint8 graphs with and without it (1.58x / 1.54x: 20.3 / 19.8 GB,
    results 74; refused at results 65's 2.25x / 2.17x), and the 3B shape's float and weight-only
    formats (1.3x: 16.7 GB)."""
    monkeypatch.setattr(sizes, "machine_memory", lambda: GIB_24)
    one_b = sizes.estimate(header_only_dir(tmp_path / "1b", LLAMA_1B), quantize="int16")
    sizes.check(one_b, "circle", peak=sizes.convert_peak("int16", graphs=True, verify=True))
    one_b8 = sizes.estimate(header_only_dir(tmp_path / "1b-uint8", LLAMA_1B), quantize="uint8")
    sizes.check(one_b8, "circle", peak=sizes.convert_peak("uint8", graphs=True, verify=True))  # 8.8 GB: it ran
    three_b = header_only_dir(tmp_path / "3b", LLAMA_3B)
    for verify in (False, True):
        for quantize in ("int16", "uint8"):  # uint8: 22.1 / 22.9 GB since results 74 (27.0 / 45.9 GB before)
            sizes.check(sizes.estimate(three_b, quantize=quantize), "circle",
                        peak=sizes.convert_peak(quantize, graphs=True, verify=verify))
    for quantize, target in ((None, "tflite"), ("w8", "tflite"), ("q4_0", "onert")):
        est = sizes.estimate(three_b, quantize=quantize)
        sizes.check(est, target, file_limit=False, peak=sizes.convert_peak(quantize, graphs=True, verify=True))
    assert sizes.convert_peak("int16", graphs=False) == sizes.CONVERT_PEAK  # one graph: not measured apart


@pytest.fixture
def dir_1b(tmp_path):
    return header_only_dir(tmp_path / "llama-1b", LLAMA_1B)


# each refusal the sizes decide, as the CLI is asked for it: (argv after MODEL -o OUT, the error)
REFUSALS = {
    "onert-file": (["--target", "onert"], "bytes (> 2 GiB) for target onert"),
    "cache-length": (["--graphs", "prefill,decode", "--max-cache-len", "200000"], "max_position_embeddings 131072"),
    "unsplittable": (["--graphs", "prefill,decode", "--target", "onert", "--max-file-bytes", "100000000"],
                     "cannot be split into files of at most 100000000 bytes: layer 0 alone take 243286016 bytes"),
    "integer-split": (["--graphs", "prefill,decode", "--target", "circle", "--quantize", "uint8",
                       "--max-file-bytes", str(3 * 10**9)], "--quantize uint8 --graphs writes one file of every layer"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
@pytest.mark.parametrize("source", ["headers", "config"])
def test_refusals_come_before_torch(case, source, dir_1b, tmp_path):
    """Each refusal the sizes decide, from the safetensors headers or the config alone, in a fresh
    CLI process that never imports torch or transformers (importing them was 4-10 s of CPU and
    30-48 s of wall time of such a refusal on a loaded machine; the refusal itself is ms)."""
    argv, message = REFUSALS[case]
    if case == "onert-file":
        out = str(tmp_path / "m.circle")
    else:
        out = str(tmp_path / "out")
    model = [str(dir_1b)] if source == "headers" else ["--config", str(dir_1b / "config.json")]
    code = ("import contextlib, io, json, sys\nfrom circleops.cli import main\nerr = io.StringIO()\n"
            f"with contextlib.redirect_stderr(err):\n    code = main(['convert', *{model!r}, '-o', {out!r}, *{argv!r}])\n"
            "print(json.dumps([code, err.getvalue(), sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, err, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status == 2 and message in err and "Traceback" not in err, err
    assert heavy == [], heavy


@pytest.mark.parametrize("family, tied", [("llama", True), ("llama", False), ("gemma3", True)])
def test_split_sizes_from_headers_are_the_models(family, tied, tmp_path):
    """The split plan's sizes from the safetensors headers (and from a dense config's sizes) are
    the loaded model's (split.part_bytes) in each format's bytes, so the refusal from the
    headers is the plan's own."""
    model = BY_NAME[family].build(tie_word_embeddings=tied, vocab_size=512)
    model.save_pretrained(tmp_path)
    headers = {n: i["shape"] for n, i in read_safetensors_header(tmp_path / "model.safetensors").items()}
    cfg = json.loads((tmp_path / "config.json").read_text())
    for quantize in (None, "q4_0", "w8"):
        for target in (None, "onert"):  # onert: a tied table read from the quantized head, not stored
            want = split.part_bytes(model, quantize, target)
            assert split.named_part_bytes(headers, tied, quantize, target) == want, (quantize, target)
            assert split.named_part_bytes(sizes.dense_shapes(cfg), tied, quantize, target) == want, (quantize, target)


def test_vlm_cache_length_refused_before_torch(tmp_path):
    """A vision-language model's cache longer than its text model's positions, from config.json
    and the headers in a fresh CLI process that imports no torch (the VLM recipe's module does)."""
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    (vlm / "config.json").write_text(json.dumps({"model_type": "idefics3", "architectures": [
        "Idefics3ForConditionalGeneration"], "text_config": {"model_type": "llama", "max_position_embeddings": 128}}))
    blob = json.dumps({"model.text_model.norm.weight": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}).encode()
    (vlm / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(32))
    out = str(tmp_path / "out")
    code = ("import contextlib, io, json, sys\nfrom circleops.cli import main\nerr = io.StringIO()\n"
            f"with contextlib.redirect_stderr(err):\n    code = main(['convert', {str(vlm)!r}, '-o', {out!r}, "
            "'--graphs', 'vision,prefill,decode', '--max-cache-len', '200'])\n"
            "print(json.dumps([code, err.getvalue(), sorted(m for m in ('torch', 'transformers') if m in sys.modules)]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, err, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status == 2 and "--max-cache-len 200 is more than" in err and "max_position_embeddings 128" in err, err
    assert heavy == [], heavy
