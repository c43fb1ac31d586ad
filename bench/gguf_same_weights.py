"""A GGUF holding the very blocks of a circleops q4_0 onert file, for ik_llama.cpp (issue 32).

    python bench/gguf_same_weights.py OUT_DIR MODEL_DIR out.gguf
    python bench/gguf_same_weights.py --f32 MODEL_DIR out-f32.gguf   # then llama-quantize it

OUT_DIR: `circleops convert MODEL_DIR --graphs prefill,decode --target onert --quantize q4_0`
(any graph file of it: every file holds every weight); MODEL_DIR: the HF directory (config and
the norms, which circleops keeps in fp32). The GGUF is llama.cpp's "llama" architecture:
every Q4_0 linear and the Q4_0 token embedding byte for byte from the Circle file (circleops'
fused q/k/v and gate/up weights split back by rows: a Q4_0 block lies along a row, so rows
move whole blocks), the Q8_0 output head likewise, q and k rows permuted as llama.cpp's
convert_hf_to_gguf permutes them (its RoPE pairs neighbours, HF's halves), llama3's RoPE
factors as rope_freqs. The vocabulary is placeholder text (the benchmark feeds token ids),
with the byte tokens llama.cpp's SentencePiece loader looks up.

--f32 writes the HF directory's own fp32 weights instead (memory-mapped, not copied; q and k
permuted alike), for ik_llama.cpp's F32 row and for its llama-quantize to make Q4_0 / Q8_0 of
the same weights where no circleops q4_0 file exists (its onert q4_0 kernels need AVX-512).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

Q4_ROW = 18  # bytes per Q4_0 block of 32
Q8_ROW = 34


def circle_weights(out_dir: Path) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    """{tensor name: (GGML dtype, shape, blocks as uint8 [rows, bytes per row])} of one graph file."""
    from circleops.package.manifest import read_manifest
    from circleops.serialize.reader import read_model

    m = read_manifest(out_dir)
    files = list(dict.fromkeys(m.graph_files("decode")))  # every weight (all parts of a split model)
    found = {}
    for f in files:
        model = read_model(out_dir / f)
        for sg in model.subgraphs:
            for t in sg.tensors:
                if str(getattr(t, "dtype", "")).startswith("GGML") and t.data is not None and t.name not in found:
                    per = Q4_ROW if t.dtype == "GGML_Q4_0" else Q8_ROW
                    found[t.name] = (t.dtype, tuple(t.shape), np.asarray(t.data).reshape(t.shape[0], t.shape[1] // 32 * per))
        del model
    return found


def permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute over whole rows: [n_head, 2, d/2] -> [n_head, d/2, 2]."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def rope_factors(cfg: dict) -> np.ndarray | None:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rp.get("rope_type") != "llama3":
        return None
    base = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    factor, low, high = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def new_writer(gguf, path: str, cfg: dict, file_type: int):
    """A GGUFWriter with llama.cpp's hyperparameters of ``cfg`` and a placeholder vocabulary."""
    arch = cfg["model_type"]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    layers, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    rp = cfg.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(min(cfg.get("max_position_embeddings", 4096), 131072))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    writer.add_file_type(file_type)
    writer.add_vocab_size(vocab)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    return writer


def mapped_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every fp32 tensor of the HF directory's safetensors as a read-only memmap view (no copy:
    a 1.5B model's 6 GB stay file pages the kernel can drop)."""
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if t["dtype"] != "F32":
                raise SystemExit(f"{f}: {name} is {t['dtype']}; --f32 reads fp32 checkpoints only")
            a, b = t["data_offsets"]
            out[name] = mm[8 + n + a:8 + n + b].view(np.float32).reshape(t["shape"])
    return out


def write_f32(model_dir: Path, path: str) -> int:
    """An F32 GGUF of the HF directory's own fp32 weights (llama-quantize makes Q4_0 / Q8_0 of it)."""
    import gguf

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "qwen2"):
        raise SystemExit(f"only llama and qwen2 shapes: {cfg.get('model_type')}")
    st = mapped_tensors(model_dir)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = new_writer(gguf, path, cfg, gguf.LlamaFileType.ALL_F32)
    factors = rope_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    writer.add_tensor("token_embd.weight", st["model.embed_tokens.weight"])
    if "lm_head.weight" in st and not cfg.get("tie_word_embeddings", False):
        writer.add_tensor("output.weight", st["lm_head.weight"])
    writer.add_tensor("output_norm.weight", st["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg["num_hidden_layers"]):
        for hf, short in names.items():
            for kind in ("weight", "bias"):
                t = st.get(f"model.layers.{i}.{hf}.{kind}")
                if t is None:
                    continue
                if cfg["model_type"] == "llama" and short in ("attn_q", "attn_k"):
                    t = permute(t, n_head if short == "attn_q" else n_kv)
                writer.add_tensor(f"blk.{i}.{short}.{kind}", t)
    return _finish(writer, path)


def _finish(writer, path) -> int:
    """Write the GGUF's header, metadata and tensors, close it, say its size."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {path}: {Path(path).stat().st_size / 1e9:.3f} GB")
    return 0


def main(argv: list[str]) -> int:
    import gguf
    from safetensors import safe_open

    if len(argv) == 3 and argv[0] == "--f32":
        return write_f32(Path(argv[1]), argv[2])
    if len(argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out_dir, model_dir, path = Path(argv[0]), Path(argv[1]), argv[2]
    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") not in ("llama", "qwen2"):
        raise SystemExit(f"only llama and qwen2 shapes: {cfg.get('model_type')}")
    arch = cfg["model_type"]
    w = circle_weights(out_dir)
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    layers, hidden, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    writer = new_writer(gguf, path, cfg, gguf.LlamaFileType.MOSTLY_Q4_0)
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0

    def add(name: str, rows: np.ndarray, cols: int, dtype: str) -> None:
        writer.add_tensor(name, np.ascontiguousarray(rows),  # byte shape: gguf derives [rows, cols]
                          raw_dtype=q4 if dtype == "GGML_Q4_0" else q8)

    p = "model.model."
    dt, shape, emb = w[p + "embed_tokens.weight"]
    add("token_embd.weight", emb, shape[1], dt)
    head = w.get(p + "embed_tokens.weight_q8_0") or w.get("model.lm_head.weight")
    add("output.weight", head[2], head[1][1], head[0])
    factors = rope_factors(cfg)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as st:
        names = set(st.keys())
        writer.add_tensor("output_norm.weight", st.get_tensor("model.norm.weight").float().numpy())
        for i in range(layers):
            lp = f"{p}layers.{i}."
            dt, shape, qkv = w[lp + "self_attn.{q,k,v}_proj.weight"]
            q, k, v = np.split(qkv, [n_head * head_dim, (n_head + n_kv) * head_dim])
            if arch == "llama":
                q, k = permute(q, n_head), permute(k, n_kv)
            add(f"blk.{i}.attn_q.weight", q, shape[1], dt)
            add(f"blk.{i}.attn_k.weight", k, shape[1], dt)
            add(f"blk.{i}.attn_v.weight", v, shape[1], dt)
            dt, shape, o = w[lp + "self_attn.o_proj.weight"]
            add(f"blk.{i}.attn_output.weight", o, shape[1], dt)
            dt, shape, gu = w[lp + "mlp.{gate,up}_proj.weight"]
            gate, up = np.split(gu, 2)
            add(f"blk.{i}.ffn_gate.weight", gate, shape[1], dt)
            add(f"blk.{i}.ffn_up.weight", up, shape[1], dt)
            dt, shape, down = w[lp + "mlp.down_proj.weight"]
            add(f"blk.{i}.ffn_down.weight", down, shape[1], dt)
            hp = f"model.layers.{i}."
            writer.add_tensor(f"blk.{i}.attn_norm.weight", st.get_tensor(hp + "input_layernorm.weight").float().numpy())
            writer.add_tensor(f"blk.{i}.ffn_norm.weight", st.get_tensor(hp + "post_attention_layernorm.weight").float().numpy())
            for proj, short in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v")):
                if hp + f"self_attn.{proj}_proj.bias" in names:
                    writer.add_tensor(f"blk.{i}.{short}.bias", st.get_tensor(hp + f"self_attn.{proj}_proj.bias").float().numpy())
    return _finish(writer, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
