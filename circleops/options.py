"""The choices of ``convert``'s options, defined once for the library and the CLI.

Standard library only: ``circleops convert --help`` reads them without loading torch.
Targets are circleops.targets.TARGETS, runtimes circleops.runtime.RUNTIMES, quantization
formats circleops.quantize.WEIGHT_FORMATS.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

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
# an encoder-decoder's self-attention caches (Whisper's and the text-to-text models' graphs:
# circleops.adapters.seq2seq), always with "rows": k and v alike [1, H, C, D]
HEADS_ROWS = "k, v [1, H, C, D]; rows [1, H, S, D]"

# The prefill graphs' lengths, longest first: a prompt runs through them in chunks (the
# Generator's plan): long prompts in runs of the longest, short ones (and the remainder) in
# the short one. Measured by bench/ttft.py (bench/README.md). And the KV cache's slots.
DEFAULT_PREFILL_LENS = (64, 8)
DEFAULT_MAX_CACHE_LEN = 512

# the metadata entry where a task conversion (circleops.recipes.tasks) records its task, source model,
# input shapes and labels; circleops inspect and run read it
TASK_METADATA_KEY = "circleops.task"

__all__ = ["ConvertOptions", "DEFAULT_PREFILL_LENS", "DEFAULT_MAX_CACHE_LEN", "TASK_METADATA_KEY", "FUSE_MODES", "CONVERT_DTYPES", "CACHE_UPDATES", "SLOT_MAJOR", "HEAD_MAJOR", "CACHE_LAYOUTS", "HEADS_ROWS"]


@dataclass(frozen=True)
class ConvertOptions:
    """One conversion's options, as ``circleops convert`` takes them and the Python API
    (``circleops.convert``, ``save``, ``convert_graphs``, ...) accepts them: ``options=`` or
    the same names as keyword arguments. A field a path does not use keeps its default.

    Checked where they are used (circleops.pipeline.validate and the recipes), not here: this
    module is read by ``circleops convert --help``, which must not load torch.
    """

    # what is written
    target: str = "circle"  # circleops.targets.TARGETS
    dtype: Any = None  # "fp32" / "fp16" or a torch dtype; None: the model's own
    fuse: str = "auto"  # FUSE_MODES
    # the numeric comparison of the written file(s) with torch (--verify / --runtime)
    verify: bool | str = False  # True: the target's runtime; or a runtime's name
    tolerance: float | None = None  # relative to max(1, max|torch output|); None: by dtype and format
    # quantization (circleops.quantize.WEIGHT_FORMATS) and the integer (PT2E) recipe
    quantize: str | None = None
    threads: int | None = None  # the NUM_THREADS the files will run with
    calibrate: int = 8
    calibration_data: str | None = None
    int16: tuple[str, ...] = ()
    integer_io: bool = False
    weight_bits: int = 8
    weight_group_size: int | None = None
    int8_weights: str = ""
    gptq: bool = False
    rotate: str = "auto"
    # the one file of circleops.convert
    output_names: tuple[str, ...] | None = None
    metadata: Mapping[str, bytes] | None = None
    # sets of graphs (circleops.recipes): which, their lengths, their cache, their files
    graphs: tuple[str, ...] | str | None = None
    seq_len: Any = None  # one length; with graphs the prefill lengths ("64,8", (64, 8), 64); None: the default
    max_cache_len: int = DEFAULT_MAX_CACHE_LEN
    cache_update: str | None = None  # CACHE_UPDATES; None: the target's
    cache_windows: tuple[int, ...] | None = None  # None: the target's default; (): none
    max_file_bytes: int | None = None  # None: 2 GiB where the target's runtime needs it
    onert_signatures: bool | None = None  # None: as the installed onert can
    # a task model (circleops.recipes.tasks)
    task: str | None = None
    input_shape: Mapping[str, tuple[int, ...]] | None = None
    # where the model comes from
    config: str | None = None
    seed: int = 0
    allow_random_init: bool = False

    def replace(self, **fields: Any) -> "ConvertOptions":
        """A copy with ``fields`` changed; TypeError for a name that is no field."""
        return dataclasses.replace(self, **_field_names(fields, "options"))

    @classmethod
    def of(cls, options: "ConvertOptions | None", fields: Mapping[str, Any], caller: str = "convert",
           **defaults: Any) -> "ConvertOptions":
        """The options of one API call: ``options`` with ``fields`` (the call's keyword
        arguments) over it; without ``options``, ``defaults`` (the call's own defaults, e.g.
        convert_graphs' target "onert") under ``fields``."""
        fields = _field_names(fields, caller)
        if options is None:
            return cls(**{**defaults, **fields})
        if not isinstance(options, cls):
            raise TypeError(f"{caller}() takes options=ConvertOptions(...), not {type(options).__name__}")
        return dataclasses.replace(options, **fields) if fields else options


# former keyword names of the API, still taken: convert_graphs(prefill_len=...) is seq_len
ALIASES = {"prefill_len": "seq_len"}


def _field_names(fields: Mapping[str, Any], caller: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(ConvertOptions)}
    out: dict[str, Any] = {}
    for name, value in fields.items():
        key = ALIASES.get(name, name)
        if key not in known:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        out[key] = value
    return out
