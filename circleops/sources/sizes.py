"""What a conversion will weigh, from the model's sizes alone (issue 32): the parameter count
read from the safetensors headers (or, for ``--config``, the model built on the meta device),
times the bytes per weight of the chosen format. Every refusal that sizes decide runs on
these figures before the weights are read, exported or lowered:

    est = estimate("path/to/model", quantize="q4_0", target="onert")
    check(est, target="onert", verify=True)   # a TargetError in milliseconds, not after minutes

The figures are lower bounds where a file may hold more than one copy of a weight (a tied
lm_head stored apart from the embedding table), so a refusal from them is always right; the
exact check on the lowered graph (circleops.pipeline.stages.check_size) still runs before writing.
This module reads JSON and the headers only: no torch unless a config must be built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from circleops.errors import CircleOpsError, ModelLoadError, TargetError
from circleops.sources.config_json import read_config_dict
from circleops.system.memory import machine_memory
from circleops.inputs.user_files import read_json, read_safetensors_header


# Bytes per weight of each stored form: GGML blocks (32 weights: 2 bytes of scale + 16 of
# 4-bit values, or + 32 int8), int8 per channel (the scales are a row's 4 bytes: ~0), fp16.
FLOAT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}
FORMAT_BYTES = {"q4_0": 18 / 32, "q4_0-pure": 18 / 32, "q8_0": 34 / 32, "w8": 1.0, "uint8": 1.0, "int16": 1.0}

# A conversion's peak resident memory, as a multiple of the model's float weights, measured
# on the Llama-3.2-1B shape (bench/convert_scale.py): the memory-mapped weights once, plus
# the torch reference's and the lowering's working set. The machine needs at least this much.
CONVERT_PEAK = 1.3
# The 16-bit-activation integer recipe's generation graphs (--quantize int16 --graphs) hold more:
# the rotated weights and the untied head beside PT2E's calibrated graphs and their integer tables.
# Measured on the Llama-3.2-1B shape (bench/results/74: the C heap trimmed through the rotation
# and the rounding, verify's torch runs dequantizing each integer weight where it is used):
# 1.54x without --verify, in the calibration (1.69x before, in the rotation, results 69; 2.17x,
# results 65), 1.58x with it, in the write (1.87x before, in verify's torch runs; 2.25x; 2.88x /
# 3.9-4.0x before that, results 61 / 64). A model this puts past the machine's memory is
# refused before any work, not killed out of memory an hour into it (the Llama-3.2-3B shape:
# 19.8 / 20.3 GB, which a 24 GiB machine passes; 27.9 / 28.9 GB at results 65, refused).
INTEGER_GRAPHS_PEAK = {False: 1.54, True: 1.58}  # by --verify
# The 8-bit NPU recipe's graphs (--quantize uint8 --graphs; for an LLM --int16 auto and the rotation),
# at the Llama-3.2-1B shape (bench/results/74, with the heap trimmed through the rotation and
# verify's weights dequantized at their use): without --verify 1.72x the fp32 weights' bytes
# (ru_maxrss 8292012 kB, in calibration; 2.10x before, results 72), with --verify 1.78x (8608052 kB,
# in calibration; 3.57x before results 72's blocked sensitivity scoring). The Llama-3.2-3B shape:
# 22.1 / 22.9 GB, which a 24 GiB machine passes (45.9 GB with --verify before, refused).
UINT8_GRAPHS_PEAK = {False: 1.72, True: 1.78}  # by --verify


@dataclass(frozen=True)
class SizeEstimate:
    """A model's sizes and what a conversion of it will need."""

    source: str
    parameters: int  # distinct parameters (a tied head counted once)
    float_bytes: int  # the weights in the model's float dtype (what loading maps)
    weight_bytes: int  # the weights in the chosen format (one copy in a file)
    quantize: str | None = None
    max_positions: int | None = None  # the config's max_position_embeddings
    tied_embeddings: bool = False
    vocab_size: int | None = None
    hidden_size: int | None = None

    @property
    def file_bytes(self) -> int:
        """The least one file holding every weight weighs."""
        return self.weight_bytes

    @property
    def convert_memory(self) -> int:
        """The least resident memory the conversion needs (:data:`CONVERT_PEAK` x the float weights)."""
        return int(CONVERT_PEAK * self.float_bytes)


def convert_peak(quantize: str | None, *, graphs: bool = False, verify: bool = False) -> float:
    """A conversion's peak resident memory as a multiple of the float weights, as measured:
    :data:`INTEGER_GRAPHS_PEAK` for the int16 recipe's generation graphs, :data:`UINT8_GRAPHS_PEAK`
    for uint8's, else :data:`CONVERT_PEAK`."""
    if graphs and quantize == "int16":
        return INTEGER_GRAPHS_PEAK[bool(verify)]
    if graphs and quantize == "uint8":
        return UINT8_GRAPHS_PEAK[bool(verify)]
    return CONVERT_PEAK


def bytes_per_weight(quantize: str | None, dtype: str = "float32") -> float:
    """The bytes one weight takes in a file of format ``quantize`` (None: float ``dtype``)."""
    if quantize is not None:
        return FORMAT_BYTES.get(quantize, 1.0)
    return FLOAT_BYTES.get(_dtype_name(dtype), 4.0)


def weight_bytes(parameters: int, quantize: str | None, dtype: Any = "float32") -> int:
    """``parameters`` x the bytes per weight of the format: the size the split and the
    refusals share."""
    return int(parameters * bytes_per_weight(quantize, _dtype_name(dtype)))


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def safetensors_parameters(files: list[Path]) -> tuple[int, dict[str, int]]:
    """(elements over every tensor, bytes per dtype) from the safetensors files' headers only
    (the 8-byte length and the JSON that follows it; no weight is read)."""
    total, by_dtype = 0, {}
    for path in files:
        for info in read_safetensors_header(path, error=ModelLoadError).values():
            count = 1
            for d in info["shape"]:
                count *= d
            total += count
            start, end = info["data_offsets"]
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + end - start
    return total, by_dtype


def safetensors_files(path: Path) -> list[Path]:
    """The safetensors files of HF directory ``path`` (its index's, else every one in it)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted({str(n) for n in read_json(index, error=ModelLoadError)["weight_map"].values()})
        except (ModelLoadError, KeyError, TypeError, AttributeError):
            return sorted(path.glob("*.safetensors"))  # the loader names what is wrong with the index
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


# Dense decoder families whose parameters follow from the config's sizes (checked against the
# meta-device build in tests/convert/test_sizes.py): per layer q, k, v, o (+ biases), the
# gated MLP, its norms (and q/k norms) -> (bias on q/k/v, norms per layer, q/k norm width,
# transformers' default of tie_word_embeddings)
_DENSE = {"llama": (False, 2, None, False), "mistral": (False, 2, None, False), "qwen2": (True, 2, None, False),
          "qwen3": (False, 2, "head", False), "olmo2": (False, 2, "proj", False), "gemma": (False, 2, None, True),
          "gemma2": (False, 4, None, True), "gemma3_text": (False, 4, "head", True)}


def tied_default(cfg: dict[str, Any]) -> bool:
    """Whether transformers ties the lm_head of ``cfg``'s family to the embedding table when
    the config does not say (a dense family's default; True where unknown, the smaller model)."""
    family = _DENSE.get(cfg.get("model_type"))
    return True if family is None else family[3]


def dense_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The parameters' shapes of a dense decoder config of a family in :data:`_DENSE`, named as
    transformers names them under ``model.`` (``model.embed_tokens.weight``,
    ``model.layers.N.*``, ``model.norm.weight``, ``lm_head.weight`` unless tied), from its sizes
    alone (no torch: milliseconds); None for any other config."""
    family = _DENSE.get(cfg.get("model_type"))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if family is None or any(not isinstance(cfg.get(k), int) for k in keys) or \
            any(cfg.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    bias, norms, qk, tied_default = family
    v, h, inter, layers, heads = (int(cfg[k]) for k in keys)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    q, kv = heads * hd, kv_heads * hd
    bias = bias or bool(cfg.get("attention_bias"))
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter)}
    if bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    norm_names = (("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm") if cfg["model_type"] != "olmo2" else
                  ("post_attention_layernorm", "post_feedforward_layernorm"))
    layer.update({f"{name}.weight": (h,) for name in norm_names[:norms]})
    if qk is not None:
        layer.update({"self_attn.q_norm.weight": (hd if qk == "head" else q,),
                      "self_attn.k_norm.weight": (hd if qk == "head" else kv,)})
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    shapes.update({f"model.layers.{i}.{name}": shape for i in range(layers) for name, shape in layer.items()})
    if not cfg.get("tie_word_embeddings", tied_default):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def dense_parameters(cfg: dict[str, Any]) -> int | None:
    """The parameter count of a dense decoder config of a family in :data:`_DENSE`
    (:func:`dense_shapes`); None for any other config."""
    shapes = dense_shapes(cfg)
    if shapes is None:
        return None
    total = 0
    for shape in shapes.values():
        count = 1
        for d in shape:
            count *= d
        total += count
    return total


def config_parameters(cfg: dict[str, Any], source: str) -> int:
    """The parameter count of the causal LM ``cfg`` describes: :func:`dense_parameters`, else
    the model built on the meta device (no memory; the seconds of importing transformers)."""
    dense = dense_parameters(cfg)
    if dense is not None:
        return dense
    import torch

    from circleops.sources import models

    try:
        config = models.build_config(cfg, source)
        cls = models.model_class(config, cfg, source)
        with torch.device("meta"):
            module = cls(config)
    except CircleOpsError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers' own refusal of the config
        raise ModelLoadError(f"{source}: transformers cannot build the model of this config: "
                             f"{type(err).__name__}: {str(err).splitlines()[0][:200]}. Fix config.json.") from None
    seen, total = set(), 0
    for p in module.parameters():  # tied parameters are one object: counted once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def estimate(model: str | os.PathLike | None, *, config: str | os.PathLike | None = None,
             quantize: str | None = None, dtype: Any = "float32") -> SizeEstimate | None:
    """The sizes of an HF model directory ``model`` (its safetensors headers) or of a
    ``config`` (built on meta); None for what is neither (a .gguf, smollm2, a .pt2)."""
    cfg_path = Path(config) if config is not None else (Path(model) / "config.json" if model is not None else None)
    if cfg_path is None or not cfg_path.is_file():
        return None
    cfg = read_config_dict(cfg_path)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    files = safetensors_files(Path(model)) if config is None and model is not None else []
    if files:
        params, _ = safetensors_parameters(files)
    elif config is not None:
        params = config_parameters(cfg, str(cfg_path))
    else:
        return None  # .bin checkpoints: the loader says what it finds
    positions = text.get("max_position_embeddings")
    return SizeEstimate(source=str(model or config), parameters=int(params),
                        float_bytes=weight_bytes(params, None, dtype), weight_bytes=weight_bytes(params, quantize, dtype),
                        quantize=quantize, max_positions=positions if isinstance(positions, int) else None,
                        tied_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                        vocab_size=text.get("vocab_size"), hidden_size=text.get("hidden_size"))


def option_dtype(value: Any) -> str | None:
    """The float dtype name ("float32", "float16", ...) a --dtype value names (None: float32;
    a torch dtype too), read without torch; None for a value that names none."""
    from circleops.dtypes import FLOAT_NAMES

    return "float32" if value is None else FLOAT_NAMES.get(str(value).lower().removeprefix("torch."))


def check_request(model: str | os.PathLike | None, config: str | os.PathLike | None, target: str, *,
                  dtype: Any = None, quantize: str | None = None, max_cache_len: int | None = None,
                  build: bool = True, graphs_verified: bool | None = None) -> None:
    """:func:`check` of the model at ``model`` (or ``config``) converted as asked (--dtype,
    --quantize as given), with the standard library only: a command's refusals that sizes
    decide come before torch's import (seconds: most of such a refusal's time). A dtype or
    format it does not know is left to the command's own checks (nothing refused here), and
    so is a ``config`` not of a dense family unless ``build`` (its causal LM built on meta:
    torch, and only for a config that is a causal LM's). ``graphs_verified``: None for one
    file (the target's file-size limit applies); True or False for a set of generation graphs
    with or without --verify (split past the limit instead; the memory of :func:`convert_peak`)."""
    name = option_dtype(dtype)
    if name is None or (quantize is not None and quantize not in FORMAT_BYTES):
        return
    if not build and config is not None and not (Path(config).is_file() and _causal_dense(read_config_dict(config))):
        return
    graphs = graphs_verified is not None
    check(estimate(model, config=config, quantize=quantize, dtype=name), target, max_cache_len=max_cache_len,
          file_limit=not graphs, peak=convert_peak(quantize, graphs=graphs, verify=bool(graphs_verified)))


def _causal_dense(cfg: dict[str, Any]) -> bool:
    """Whether ``cfg`` is a dense family's causal LM (its architectures, if it names any, all
    ...ForCausalLM: the model --config builds), whose parameters dense_shapes counts exactly."""
    archs = cfg.get("architectures") or []
    return dense_parameters(cfg) is not None and all(str(a).endswith("ForCausalLM") for a in archs)


def too_large_message(needed: int, target: str, estimated: bool = False) -> str:
    """The refusal of a file past 2 GiB (``needed`` bytes) for a target that reads no weights
    after the flatbuffer (circleops.pipeline.stages.too_large_message says the same of a lowered graph)."""
    from circleops.targets import profile

    p = profile(target)
    how = "at least " if estimated else ""
    return (f"the model needs {how}{needed} bytes (> 2 GiB) for target {p.name}; {p.runtime} 0.1.0 cannot read "
            f"weights stored after the flatbuffer (it crashes), and a flatbuffer holds at most 2 GiB. Use --target "
            f"circle for NPU compilers, or --target tflite for LiteRT, which reads that layout; or convert a "
            f"smaller model, or use --dtype fp16 with a target that allows it (circle, tflite).")


def exceeds_file_limit(est: SizeEstimate, target: str) -> bool:
    """Whether one file of every weight cannot be read by ``target`` (onert: past 2 GiB)."""
    from circleops.targets import FLATBUFFER_LIMIT
    from circleops.targets import profile

    return not profile(target).weights_after_flatbuffer and est.file_bytes > FLATBUFFER_LIMIT


def check(est: SizeEstimate | None, target: str, *, max_cache_len: int | None = None,
          file_limit: bool = True, peak: float = CONVERT_PEAK) -> None:
    """Every refusal sizes decide, before any work: the target's file-size limit (``file_limit``
    False where the caller splits instead), the cache length against the model's positions,
    and the memory the machine has against what the conversion needs (``peak`` x the float
    weights: :func:`convert_peak`)."""
    if est is None:
        return
    if max_cache_len is not None and est.max_positions is not None and max_cache_len > est.max_positions:
        raise TargetError(f"--max-cache-len {max_cache_len} is more than {est.source} supports "
                          f"(max_position_embeddings {est.max_positions}). Choose --max-cache-len <= "
                          f"{est.max_positions}.")
    if file_limit and exceeds_file_limit(est, target):
        raise TargetError(too_large_message(est.file_bytes, target, estimated=True))
    total, _ = machine_memory()
    needed = max(est.convert_memory, int(peak * est.float_bytes))
    if total is not None and needed > total:
        how = "" if peak <= CONVERT_PEAK else (
            f" ({peak:g}x the weights: what --quantize {est.quantize} --graphs measured at 1B)")
        raise TargetError(f"converting {est.source} ({est.parameters / 1e9:.2f} B parameters, "
                          f"{est.float_bytes / 1e9:.1f} GB of weights) needs about {needed / 1e9:.1f} GB "
                          f"of memory{how}, and this machine has {total / 1e9:.1f} GB. Convert on a machine with more "
                          f"memory, or a smaller model.")


__all__ = ["CONVERT_PEAK", "INTEGER_GRAPHS_PEAK", "UINT8_GRAPHS_PEAK", "SizeEstimate", "bytes_per_weight", "check", "check_request", "convert_peak", "dense_parameters", "dense_shapes", "estimate",
           "exceeds_file_limit", "machine_memory", "option_dtype", "safetensors_files", "safetensors_parameters", "tied_default", "too_large_message",
           "weight_bytes"]
