"""The choices of ``convert``'s options, defined once for the library and the CLI.

Standard library only: ``circleops convert --help`` reads them without loading torch.
Targets are circleops.targets.TARGETS, runtimes circleops.runtime.RUNTIMES, quantization
formats circleops.quantize.WEIGHT_FORMATS.
"""
from __future__ import annotations

# how the model's RMSNorm / RoPE / attention reach the fused circle ops
FUSE_MODES = ("auto", "adapters", "patterns", "none")
# the dtypes convert writes (names of circleops.dtypes.FLOAT_NAMES)
CONVERT_DTYPES = ("fp32", "fp16")
# how generation graphs hand back the KV cache (circle::attention's cache_update attribute,
# manifest.json's "cache_update"): "full" updated caches, or only the "rows" of the new tokens
CACHE_UPDATES = ("full", "rows")
# the arrays generation graphs take as caches (manifest.json's "cache_layout"), k then v:
# slot-major (ONE's ATTENTION layout), or head-major with v transposed: the operands that
# onert's and LiteRT's BATCH_MATMUL read in place (q·Kᵀ and P·V with the adjoint flag), so
# a decode step copies no cache into another layout (only with "rows": the caller owns them)
SLOT_MAJOR = "[1, C, Hkv, D]"
HEAD_MAJOR = "k [1, Hkv, C, D], v [1, Hkv, D, C]"
CACHE_LAYOUTS = (SLOT_MAJOR, HEAD_MAJOR)

# the metadata entry where a task conversion (circleops.recipes.tasks) records its task, source model,
# input shapes and labels; circleops inspect and run read it
TASK_METADATA_KEY = "circleops.task"

__all__ = ["TASK_METADATA_KEY", "FUSE_MODES", "CONVERT_DTYPES", "CACHE_UPDATES", "SLOT_MAJOR", "HEAD_MAJOR", "CACHE_LAYOUTS"]
