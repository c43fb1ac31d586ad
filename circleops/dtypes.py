"""Dtype names, defined once: what users write ("fp16", "float16", "half", torch.float16)
-> the torch dtype, and a torch dtype -> the short name reports print ("fp16").

Standard library only at import time (the CLI reads it for --help); torch loads on use.
"""
from __future__ import annotations

from typing import Any

# accepted spelling -> torch dtype attribute
FLOAT_NAMES: dict[str, str] = {
    "fp32": "float32", "float32": "float32",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
}
# GGML block formats (Circle TensorType -2/-4): a tensor's shape counts elements, its data is
# the packed blocks row by row (np.uint8), exactly what gguf.quants.quantize writes.
# name -> (elements per block, bytes per block)
# (here, not in circleops.ir, so that sizes are estimated without torch)
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "GGML_Q4_0": (32, 18),
    "GGML_Q8_0": (32, 34),
}
# torch dtype attribute -> the short name of reports, manifests and --dtype
SHORT_NAMES: dict[str, str] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def float_dtype(value: Any) -> Any:
    """The torch float dtype ``value`` names (a name above, any case, or a torch dtype);
    None when it names none."""
    import torch

    if isinstance(value, torch.dtype):
        return value if value.is_floating_point else None
    attr = FLOAT_NAMES.get(str(value).lower())
    return getattr(torch, attr) if attr else None


def short_name(dtype: Any) -> str:
    """"fp16" for torch.float16 (or "float16"); any other dtype as its torch name."""
    name = str(dtype).removeprefix("torch.")
    return SHORT_NAMES.get(name, str(dtype))


__all__ = ["FLOAT_NAMES", "SHORT_NAMES", "float_dtype", "short_name"]
