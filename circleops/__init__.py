"""circleops: PyTorch / Hugging Face models to Circle and TFLite, with RMSNorm, RoPE,
attention and instance norm kept as single fused ops, and numerics that survive fp16.

Importing circleops is cheap; the heavy pieces load on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from circleops._version import __version__

# public name -> module that defines it (imported lazily, PEP 562)
_LAZY = {
    "convert": "circleops.pipeline.convert",
    "save": "circleops.pipeline.convert",
    "Report": "circleops.pipeline.report",
    "fuse": "circleops.adapters",
    "unfuse": "circleops.adapters",
    "ops": "circleops.ops",
    "op": "circleops.ops",
    "OpSpec": "circleops.ops",
    "lookup": "circleops.ops",
    "register_op": "circleops.ops",
    "load_plugins": "circleops.ops",
    "patch_module": "circleops.adapters",
    "patch_modules": "circleops.adapters",
    "patch_function": "circleops.adapters",
    "UnusedPatchWarning": "circleops.adapters",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if name == "ops" else getattr(module, name)
    raise AttributeError(f"module 'circleops' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
