"""GGUF input: Q4_0/Q8_0 tensors reach the file bit for bit, other types are requantized
and the report says so; the CLI's --quantize flag."""
from __future__ import annotations

import os
import re
import sys

import gguf
import numpy as np
import pytest
import torch

import circleops
from circleops.sources.models import load_gguf
from circleops.serialize import read_model
from onert_host import GGML_RUNTIME, ONERT_RUNS_GGML
from families import BY_NAME, example_ids

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "convert"))
from convert_fixtures import write_llama_gguf  # noqa: E402

# layer 0 in the asked format (carried over), layer 1's down_proj Q8_0 and the lm_head
# Q4_1 (requantized), the rest F32 (quantized from the float values)
TYPES = {"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_0",
         "token_embd.weight": "Q4_0", "blk.1.ffn_down.weight": "Q8_0", "output.weight": "Q4_1"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    model = BY_NAME["llama"].build()
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    write_llama_gguf(model, path, TYPES)
    return path


def _raw_blocks(path, name):
    (t,) = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == name]
    return np.asarray(t.data).reshape(int(t.shape[1]), -1)


def test_gguf_blocks_carried_over_bit_for_bit(tmp_path, mixed_gguf):
    model = load_gguf(mixed_gguf)
    out = tmp_path / "m.circle"
    report = circleops.convert(model, (example_ids(8),), out, target="onert", quantize="q4_0", verify=True)
    q = report.quantization
    carried = sorted(w.name.split("layers.")[-1] for w in q.weights if w.origin == "gguf")
    assert carried == ["0.mlp.up_proj.weight", "0.self_attn.k_proj.weight", "0.self_attn.q_proj.weight",
                       "model.model.embed_tokens.weight"], carried
    assert q.requantized_from == {"GGML_Q8_0": 1, "Q4_1": 1}
    summary = report.summary()
    assert "4 carried over bit for bit from the GGUF file" in summary
    assert "1 GGUF Q4_1 tensors requantized to GGML_Q8_0" in summary  # the lm_head: q4_0 keeps the head at Q8_0
    assert "1 GGUF GGML_Q8_0 tensors requantized to GGML_Q4_0" in summary
    tensors = {t.name: t for t in read_model(out).subgraphs[0].tensors if t.dtype == "GGML_Q4_0"}
    cfg = model.config
    for gguf_name, hf, heads in (("blk.0.attn_q.weight", "layers.0.self_attn.q_proj.weight", cfg.num_attention_heads),
                                 ("blk.0.attn_k.weight", "layers.0.self_attn.k_proj.weight", cfg.num_key_value_heads),
                                 ("blk.0.ffn_up.weight", "layers.0.mlp.up_proj.weight", None),
                                 ("token_embd.weight", "embed_tokens.weight", None)):
        raw = _raw_blocks(mixed_gguf, gguf_name)
        if heads:  # llama.cpp's row interleave undone on whole rows of blocks
            raw = _raw_unpermute(raw, heads)
        # q/k/v and gate/up are one fused weight (passes.fuse_linears): rows of blocks in order
        (t,) = [t for name, t in tensors.items() if any(part.endswith(hf) for part in _parts(name))]
        data = t.data.tobytes()
        at = data.find(raw.tobytes())
        assert at >= 0 and at % raw[0].nbytes == 0, hf
        blocks = np.frombuffer(data[at:at + raw.nbytes], np.uint8).reshape(raw.shape)
        # and those are the values transformers dequantized into the model
        deq = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0))
        assert torch.equal(deq, model.get_parameter("model." + hf)), hf


def _parts(name):
    """The weights a fused tensor's name lists: ``a.{q,k}_proj.w`` -> a.q_proj.w, a.k_proj.w."""
    m = re.fullmatch(r"(.*)\{(.*)\}(.*)", name)
    return [m[1] + p + m[3] for p in m[2].split(",")] if m else [name]


def _raw_unpermute(blocks, heads):
    rows = blocks.shape[0]
    return blocks.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(blocks.shape)


def test_cli_quantize(tmp_path, mixed_gguf, capsys):
    # in-process (circleops.cli.main, as the console script calls it): a subprocess would pay
    # torch's and transformers' imports again for the same code path
    from circleops.cli import main

    out = tmp_path / "m.circle"
    code = main(["convert", str(mixed_gguf), "-o", str(out), "--target", "onert", "--quantize", "q8_0", "--verify",
                 "--seq-len", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "as GGML_Q8_0" in captured.out and f"verify:  {GGML_RUNTIME}" in captured.out
    assert ("warning: verified on circleops' reference interpreter, not onert" in captured.out) != ONERT_RUNS_GGML
    assert "1 carried over bit for bit" in captured.out  # blk.1.ffn_down
    code = main(["convert", str(mixed_gguf), "-o", str(tmp_path / "m.tflite"), "--target", "tflite", "--quantize",
                 "q4_0"])
    assert code == 2 and "only in Circle" in capsys.readouterr().err
    assert not (tmp_path / "m.tflite").exists()


def test_gguf_blocks_read_only_when_quantizing_and_cached(tmp_path, mixed_gguf, monkeypatch):
    """gguf.GGUFReader parses every metadata field first (2.5 s on SmolLM2): an fp32 convert
    never reads the blocks, and with a cache directory a second quantized convert maps the
    kept .npy files instead of parsing the GGUF again, writing the same bytes."""
    from circleops.quantize import gguf as gguf_pass

    calls = []
    real = gguf_pass.read_blocks
    monkeypatch.setattr(gguf_pass, "read_blocks", lambda *a: calls.append(a) or real(*a))
    cache = tmp_path / "blocks"

    def convert(quantize, name):
        model = load_gguf(mixed_gguf)
        gguf_pass.attach(model, mixed_gguf, cache if quantize else None)
        circleops.convert(model, (example_ids(8),), tmp_path / name, target="onert", quantize=quantize)
        return (tmp_path / name).read_bytes()

    convert(None, "fp32.circle")
    assert calls == []  # neither loading nor an fp32 convert parsed the GGUF for blocks
    first = convert("q4_0", "a.circle")
    assert len(calls) == 1 and (cache / "index.json").is_file()
    assert convert("q4_0", "b.circle") == first and len(calls) == 1  # from the cache
    (cache / "index.json").write_text("{not json")  # damaged: read the GGUF again, same bytes
    assert convert("q4_0", "c.circle") == first and len(calls) == 2
    assert convert("q4_0", "d.circle") == first and len(calls) == 2  # and the index is whole again
