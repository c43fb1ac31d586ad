"""GGUF pass-through: a GGUF file's Q4_0 / Q8_0 tensors reach the Circle file bit for bit.

transformers dequantizes a GGUF while loading it; ``read_blocks`` reads the raw blocks
of the same file (gguf.GGUFReader, memory-mapped) and maps them to the model's parameter
names, undoing the row permutation transformers applies to Llama's q/k projections (a
row permutation moves whole rows of blocks). ``attach`` stores them on the model, and
``pretrained_for`` gives convert what quantize_weights takes, keyed by each parameter's
memory, so the same weight however the lowering viewed it finds its blocks.
"""
from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

ATTRIBUTE = "_circleops_gguf_blocks"  # on the model: {parameter name: (dtype, blocks)}


def carried() -> dict[str, str]:
    """GGUF tensor type -> the TensorType its blocks are carried over as, for every format
    of the registry (circleops.quantize.formats) that names a ``gguf_type``."""
    from circleops.quantize import formats

    return {f.gguf_type: f.tensor_type for f in formats.FORMATS.values() if f.gguf_type}


# GGUF tensor name (llama.cpp's) -> HF parameter name, for the Llama-like families
_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name of a llama.cpp tensor name (None: not a weight we map)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    return None


def _unpermute_rows(blocks: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' reverse_permute_weights for q/k, applied to rows of blocks."""
    rows = blocks.shape[0]
    return blocks.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(blocks.shape)


def read_blocks(path: str | os.PathLike, config: Any) -> dict[str, tuple[str, np.ndarray | None]]:
    """{HF parameter name: (type, blocks)} of the file's 2-D weights: GGML_Q4_0/GGML_Q8_0
    with their blocks [rows, row bytes]; any other GGUF type by its name (e.g. "Q4_1")
    with None (those are requantized from the dequantized values)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    arch = ""
    field = reader.get_field("general.architecture")
    if field is not None:
        arch = bytes(field.parts[field.data[0]]).decode()
    out: dict[str, tuple[str, np.ndarray | None]] = {}
    types = carried()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None or len(t.shape) != 2:
            continue
        kind = t.tensor_type.name
        if kind in ("F32", "F16", "BF16", "F64"):
            continue  # plain floats: quantized like any float weight
        if kind not in types:
            out[name] = (kind, None)
            continue
        rows = int(t.shape[1])  # GGUF lists dimensions innermost first
        blocks = np.asarray(t.data).reshape(rows, -1)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            blocks = _unpermute_rows(blocks, int(heads))
        out[name] = (types[kind], blocks)
    return out


def attach(model: Any, path: str | os.PathLike, cache: str | os.PathLike | None = None) -> None:
    """Note ``path`` on ``model``: its raw weight blocks are read when a convert asks for them.

    Lazily, because gguf.GGUFReader parses every metadata field (SmolLM2's 49k-entry
    vocabulary) before it lists a tensor: 2.5 s, measured, which an fp32 convert never needs.
    With ``cache`` (a directory), the blocks read once are kept there as .npy files and later
    reads map those instead (a few ms): for the bundled model, whose own cache lives beside.
    """
    setattr(model, ATTRIBUTE, (str(path), None if cache is None else str(cache), model.config))


def _cached_blocks(path: str, cache: str, config: Any) -> dict[str, tuple[str, np.ndarray | None]]:
    import json

    index = os.path.join(cache, "index.json")
    try:
        with open(index, encoding="utf-8") as f:
            entries = json.load(f)
        if entries.get("source") == os.path.basename(path) and entries.get("size") == os.path.getsize(path):
            return {name: (kind, None if file is None else np.load(os.path.join(cache, file), mmap_mode="r",
                                                                   allow_pickle=False))
                    for name, kind, file in entries["tensors"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, stale or damaged: read the GGUF again and rewrite it
    blocks = read_blocks(path, config)
    try:
        os.makedirs(cache, exist_ok=True)
        tensors = []
        for i, (name, (kind, data)) in enumerate(sorted(blocks.items())):
            file = None
            if data is not None:
                file = f"{i}.npy"
                tmp = os.path.join(cache, f".{file}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    np.save(f, np.ascontiguousarray(data), allow_pickle=False)
                os.replace(tmp, os.path.join(cache, file))
            tensors.append([name, kind, file])
        tmp = index + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:  # written last: a complete set or none
            json.dump({"source": os.path.basename(path), "size": os.path.getsize(path), "tensors": tensors}, f)
        os.replace(tmp, index)
    except OSError:
        pass  # a read-only cache only costs the next convert the read
    return blocks


def _blocks_of(model: Any) -> dict[str, tuple[str, np.ndarray | None]] | None:
    info = getattr(model, ATTRIBUTE, None) if model is not None else None
    if isinstance(info, tuple):  # attach()'s note: read now, once
        path, cache, config = info
        try:
            info = _cached_blocks(path, cache, config) if cache else read_blocks(path, config)
        except Exception:  # noqa: BLE001 - a file transformers read but gguf-py cannot: requantize
            info = None
        setattr(model, ATTRIBUTE, info)
    return info


def pretrained_for(model: Any) -> dict[tuple, tuple[str, np.ndarray | None]] | None:
    """quantize_weights' ``pretrained`` for a model ``attach`` saw; None otherwise."""
    from circleops.quantize.weights import source_key

    info = _blocks_of(model)
    if not info:
        return None
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[tuple, tuple[str, np.ndarray | None]] = {}
    for name, (kind, blocks) in info.items():
        p = params.get(name)
        key = source_key(p.detach()) if p is not None else None
        if key is not None and key not in out:
            out[key] = (kind, None if blocks is None else np.ascontiguousarray(blocks).reshape(-1))
    return out
