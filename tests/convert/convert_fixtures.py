"""Small models on disk for the convert and CLI tests: an HF directory saved from
tests/families.py, a GGUF written from the same weights, a config.json, a .pt2.

Imported by tests/convert/conftest.py and tests/cli/conftest.py; all session-scoped.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from families import BY_NAME, example_ids

SEQ = 8


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved per head; transformers undoes this on load.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_llama_gguf(model: torch.nn.Module, path: Path, types: dict[str, str] | None = None) -> None:
    """A Llama as an F32 GGUF file, laid out as llama.cpp's converter writes it; ``types``
    maps GGUF tensor names to a GGML block type ("Q4_0", "Q8_0", "Q4_1") to store them so."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("circleops tiny llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    for name, t in model.state_dict().items():
        v = t.numpy()
        if name in _GGUF_TOP:
            gguf_name = _GGUF_TOP[name]
        else:
            parts = name.split(".")
            layer, module = int(parts[2]), ".".join(parts[3:-1])
            if module == "self_attn.q_proj":
                v = _permute_for_gguf(v, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                v = _permute_for_gguf(v, c.num_key_value_heads)
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[module]}.weight"
        kind = (types or {}).get(gguf_name)
        if kind is None:
            w.add_tensor(gguf_name, np.ascontiguousarray(v))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(v), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def llama_model() -> torch.nn.Module:
    return BY_NAME["llama"].build()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, llama_model) -> Path:
    """The tiny random Llama of tests/families.py saved with save_pretrained."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    llama_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_gguf(tmp_path_factory, llama_model) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_llama_gguf(llama_model, path)
    return path


@pytest.fixture(scope="session")
def llama_config(tmp_path_factory, llama_model) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    cfg = llama_model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="session")
def llama_pt2(tmp_path_factory, llama_model) -> Path:
    """The tiny Llama exported (input_ids -> logits) and saved with torch.export.save."""
    from circleops.pipeline.convert import CausalLMLogits

    path = tmp_path_factory.mktemp("pt2") / "tiny-llama.pt2"
    with torch.no_grad():
        ep = torch.export.export(CausalLMLogits(llama_model), (example_ids(SEQ),))
    torch.export.save(ep, str(path))
    return path
