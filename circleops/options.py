"""The choices of ``convert``'s options, defined once for the library and the CLI.

Standard library only: ``circleops convert --help`` reads them without loading torch.
Targets are circleops.targets.TARGETS, runtimes circleops.runtime.RUNTIMES, quantization
formats circleops.quantize.WEIGHT_FORMATS.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
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

__all__ = ["ConvertOptions", "Flag", "OPTION_GROUPS", "flag", "DEFAULT_PREFILL_LENS", "DEFAULT_MAX_CACHE_LEN", "TASK_METADATA_KEY", "FUSE_MODES", "CONVERT_DTYPES", "CACHE_UPDATES", "SLOT_MAJOR", "HEAD_MAJOR", "CACHE_LAYOUTS", "HEADS_ROWS"]


@dataclass(frozen=True)
class Flag:
    """How a :class:`ConvertOptions` field is a flag of ``circleops convert``
    (circleops.cli.options builds the parser from these and the options from its values)."""

    name: str  # "--target"
    group: str  # a key of OPTION_GROUPS: the --help section, and what another command may share
    help: str
    choices: str | tuple[str, ...] | None = None  # a tuple, or "module:NAME": the registry that defines them
    metavar: str | None = None
    kind: str = "str"  # "str", "int", "float", "bool" (a switch), "switch" (--x / --no-x, else None), "list"
    cli_default: Any = None  # the flag's default when not the field's (--dtype: fp32); None: the field's
    parse: str | None = None  # "module:function" turning the flag's text into the field's value


def flag(name: str, group: str, help: str, **kw: Any) -> dict[str, Flag]:
    """A field's metadata making it a convert flag (see :class:`Flag`)."""
    return {"flag": Flag(name, group, help, **kw)}


# the --help sections of circleops convert, in order (circleops check takes "integer" too)
OPTION_GROUPS = {"target": "what is written", "quantize": "quantization", "integer": "the integer (PT2E) recipe",
                 "verify": "the comparison with torch", "graphs": "generation graphs (--graphs)",
                 "task": "models that are not causal LMs (docs/tasks.md)", "load": "where the model comes from"}
_W = "with --quantize uint8/int16: "


@dataclass(frozen=True)
class ConvertOptions:
    """One conversion's options, as ``circleops convert`` takes them (each field with a
    :func:`flag` is one, built from here by circleops.cli.options) and the Python API
    (``circleops.convert``, ``save``, ``convert_graphs``, ...) accepts them: ``options=`` or the
    same names as keyword arguments. A field a path does not use keeps its default. A new
    option is its field here and its use (``Options.given`` in circleops.pipeline.stages).

    Checked where they are used (circleops.pipeline.validate and the recipes), not here: this
    module is read by ``circleops convert --help``, which must not load torch.
    """

    # what is written
    target: str = field(default="circle", metadata=flag(
        "--target", "target", "circle: fused Circle builtins (NPU compilers); onert: what onert's CPU runtime runs "
        "(fp32 only); tflite: composites with decompositions (default: circle)", choices="circleops.targets:TARGETS"))
    dtype: Any = field(default=None, metadata=flag(
        "--dtype", "target", "weights and activations (default: fp32; fp16 for circle/tflite only)",
        choices=CONVERT_DTYPES, cli_default="fp32"))  # API: a name or a torch dtype; None: the model's own
    fuse: str = field(default="auto", metadata=flag(
        "--fuse", "target", "auto: adapters for the families that have them, then pattern fusion; adapters / patterns "
        "only; none (default: auto)", choices=FUSE_MODES))
    threads: int | None = field(default=None, metadata=flag(
        "--threads", "target", "the NUM_THREADS the file runs with (target onert, 1: linears stay FULLY_CONNECTED); "
        "--graphs records it for generate, which opens each graph's onert or LiteRT session with it (default 1 with "
        "--quantize for onert, else the runtime's 2)", kind="int", metavar="N"))
    # quantization (circleops.quantize.WEIGHT_FORMATS) and the integer (PT2E) recipe
    quantize: str | None = field(default=None, metadata=flag(
        "--quantize", "quantize", "weight quantization: {choices}. Linears whose K is not a multiple of 32 stay fp32 "
        "(the summary says which)", choices="circleops.quantize:WEIGHT_FORMATS", metavar="FORMAT"))
    calibrate: int = field(default=8, metadata=flag(
        "--calibrate", "integer", _W + "calibrate on N samples (LLMs: windows of the text shipped in "
        "circleops/quantize/calibration.txt; other models: the example input with seeded noise, or "
        "--calibration-data) (default 8)", kind="int", metavar="N"))
    # the integer options left out (None) take their defaults, the recipe measured usable for an
    # LLM (circleops.quantize.recipe.resolve_recipe, once the model is known)
    int16: tuple[str, ...] | None = field(default=None, metadata=flag(
        "--int16", "integer", "with --quantize uint8: int16 activations for these comma-separated parts (mixed "
        "precision): auto: the ops whose activations measure worst in uint8 (the default for an LLM with --target "
        "circle); none: uint8 throughout; {INT16_PARTS}; presets {INT16_PRESETS}; or module names / globs "
        "(*.mlp.down_proj)", metavar="PARTS", parse="circleops.options:int16_parts"))
    calibration_data: str | None = field(default=None, metadata=flag(
        "--calibration-data", "integer", _W + "a .pt file of input tensors to calibrate on (loaded with "
        "weights_only=True)", metavar="PT"))
    weight_bits: int | None = field(default=None, metadata=flag(
        "--weight-bits", "integer", _W + "int8 per-channel or int4 (Circle INT4, target circle) weights; an LLM's "
        "lm_head stays int8. Default 8. For an LLM, --quantize int16 --weight-bits 4 is the 16a4w NPU recipe: "
        "groups of 16, GPTQ with act order, clipping search and 2 refinement passes, the most sensitive linears "
        "int8 (9 %% of the weights); SmolLM2-135M: 17.1 dB, 28/32 top-1 on a hold-out text, 0.28x fp32's bytes "
        "(8-bit weights: 27.7 dB; docs/integer-llm.md). Each flag below overrides its part", kind="int",
        choices="circleops.quantize.recipe:WEIGHT_BITS"))
    weight_group_size: int | None = field(default=None, metadata=flag(
        "--weight-group-size", "integer", "with --weight-bits 4: N input columns share a scale (per-group, written as "
        "Circle BlockwiseQuantization); 0: one scale per output channel (default: 16 for an LLM, measured on "
        "SmolLM2, docs/integer-llm.md; 32 for other models)", kind="int", metavar="N"))
    int8_weights: str | None = field(default=None, metadata=flag(
        "--int8-weights", "integer", "with --weight-bits 4: auto: the linears whose int4 rounding measures the most "
        "error in the logits stay int8 per channel (at most a tenth of the weights; the default for an LLM's "
        "grouped 4-bit weights); none: every linear int4", choices=("auto", "none")))
    gptq: bool | None = field(default=None, metadata=flag(
        "--gptq", "integer", _W + "GPTQ rounding of the weights on the calibration samples (default: on for an "
        "LLM's 4-bit weights; --no-gptq: round to nearest)", kind="switch"))
    act_order: bool | None = field(default=None, metadata=flag(
        "--act-order", "integer", "with --gptq and grouped 4-bit weights: the group scales fixed first, the columns "
        "rounded in order of decreasing Hessian diagonal (default: on for an LLM; --no-act-order: column order)",
        kind="switch"))
    clip_search: bool | None = field(default=None, metadata=flag(
        "--clip-search", "integer", "with --gptq and grouped 4-bit weights: each group's scale by a clipping search "
        "weighted by the Hessian's diagonal (default: on for an LLM; --no-clip-search: min-max)", kind="switch"))
    gptq_refine: int | None = field(default=None, metadata=flag(
        "--gptq-refine", "integer", "with --gptq and grouped 4-bit weights: N passes of coordinate descent after "
        "GPTQ, each column's integers moved to their best level for the layer's output error (default: 2 for an "
        "LLM, 0 otherwise; 0: off)", kind="int", metavar="N"))
    rotate: str = field(default="auto", metadata=flag(
        "--rotate", "integer", _W + "fold a Hadamard rotation of an LLM's residual stream into its weights (auto: "
        "Llama-shaped LLMs)", choices="circleops.quantize.recipe:ROTATE_MODES"))
    integer_io: bool = False  # an integer graph keeps integer inputs and outputs (no QUANTIZE/DEQUANTIZE)
    # the numeric comparison of the written file(s) with torch
    verify: bool | str = field(default=False, metadata=flag(
        "--verify", "verify", "compare the written file(s) with torch: run them on the same inputs and report the "
        "max error (an error above --tolerance)", kind="bool"))
    runtime: str | None = field(default=None, metadata=flag(
        "--runtime", "verify", "runtime for --verify (default: onert for onert, litert for tflite, reference for "
        "circle and for fp16 tflite); implies --verify", choices="circleops.runtime:RUNTIMES"))
    tolerance: float | None = field(default=None, metadata=flag(
        "--tolerance", "verify", "verify fails above REL x max(1, max|logit|) (default: 1e-3 fp32, else 16 rounding "
        "steps of the format)", kind="float", metavar="REL"))
    # the one file of circleops.convert
    output_names: tuple[str, ...] | None = None  # the file's outputs, in the order the model returns them
    metadata: Mapping[str, bytes] | None = None  # entries written into the file's metadata
    # sets of graphs (circleops.recipes): which, their lengths, their cache, their files
    graphs: tuple[str, ...] | str | None = field(default=None, metadata=flag(
        "--graphs", "graphs", "write generation graphs instead of one forward: prefill,decode (with a static KV "
        "cache; vision,prefill,decode for a vision-language model, docs/vlm.md) into the directory -o, with "
        "manifest.json and the tokenizer, for `circleops generate`. --seq-len: one prefill graph per length (default "
        "{prefill_lens}). A Whisper directory: encoder,prefill,decode (generate --audio; docs/speech.md); a T5, BART, "
        "mBART or Marian directory too (generate --prompt; docs/text2text.md)",
        metavar="LIST"))
    seq_len: Any = field(default=None, metadata=flag(
        "--seq-len", "graphs", "sequence length of the exported graph (default: 64, or a .pt2's saved inputs); with "
        "--graphs the prefill lengths (default {prefill_lens})", metavar="N"))  # "64,8", (64, 8) or 64
    max_cache_len: int = field(default=DEFAULT_MAX_CACHE_LEN, metadata=flag(
        "--max-cache-len", "graphs", "with --graphs: KV-cache slots, the longest prompt + generation (default "
        "{max_cache_len})", kind="int", metavar="C"))
    cache_update: str | None = None  # CACHE_UPDATES; None: the target's
    cache_windows: tuple[int, ...] | None = field(default=None, metadata=flag(
        "--cache-windows", "graphs", "with --graphs: the longest prefill also reading only the first W cache slots, "
        "per W ('none': no such graphs; default: target tflite C/2, C/4, ... down to twice the prefill length; "
        "docs/llm.md)", metavar="W,...", parse="circleops.options:cache_windows"))
    onert_signatures: bool | None = field(default=None, metadata=flag(
        "--onert-signatures", "graphs", "with --graphs --target onert: one file whose graphs share the weights, run "
        "through onert 0.2.0.dev's C API (on), or a file per graph (off, what onert 0.1.0 runs); auto: as the "
        "installed onert can (docs/llm.md)", choices=("auto", "on", "off"), cli_default="auto",
        parse="circleops.options:on_off_auto"))
    max_file_bytes: int | None = field(default=None, metadata=flag(
        "--max-file-bytes", "graphs", "with --graphs: the most one file may hold; past it the model is written as "
        "consecutive files of a layer range each (default: 2 GiB for target onert, no limit otherwise)", kind="int",
        metavar="N"))
    # a task model (circleops.recipes.tasks)
    task: str | None = field(default=None, metadata=flag(
        "--task", "task", "what the model does, for HF models that are not causal LMs (default: from config.json's "
        "architectures; docs/tasks.md)", choices="circleops.recipes.tasks:TASKS"))
    input_shape: Mapping[str, tuple[int, ...]] | None = field(default=None, metadata=flag(
        "--input-shape", "task", "with a task model: the shape of this input (default: from the config and "
        "processor); with a text-to-text model's --graphs, input_ids=1xT: the longest source (default 128)", kind="list", metavar="NAME=1x3x224x224", parse="circleops.recipes.tasks:parse_input_shapes"))
    # where the model comes from
    config: str | None = field(default=None, metadata=flag(
        "--config", "load", "build the model from this HF config.json with random weights (seed 0)",
        metavar="CONFIG_JSON"))
    seed: int = field(default=0, metadata=flag(
        "--seed", "load", "seed of the random weights for --config (default 0)", kind="int"))
    allow_random_init: bool = field(default=False, metadata=flag(
        "--allow-random-init", "load", "convert an HF directory even if its safetensors lack weights of the model "
        "(they are randomly initialized) or hold tensors it does not use; without it that is an error", kind="bool"))

    @property
    def verify_runtime(self) -> bool | str:
        """What to compare on: False, True (the target's runtime) or a runtime's name
        (``runtime`` implies the comparison)."""
        return self.runtime or self.verify

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


def comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ("a", "b")."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def int16_parts(text: str | None) -> tuple[str, ...] | None:
    """``--int16``: None or "" (left out: the default for the model), "none" -> (), "a,b" -> ("a", "b")."""
    parts = comma_list(text or "")
    if not parts:
        return None
    return () if parts == ("none",) else parts


def on_off_auto(text: str) -> bool | None:
    """``on`` / ``off`` / ``auto`` -> True / False / None."""
    return {"on": True, "off": False}.get(text)


def cache_windows(text: str | None) -> tuple[int, ...] | None:
    """``--cache-windows``: None (the target's default), "none" -> (), "256,128" -> (256, 128)."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        from circleops.errors import TargetError

        raise TargetError(f"--cache-windows takes cache slot counts separated by commas (e.g. 256,128) or 'none'; "
                          f"got {text!r}.") from None


def _field_names(fields: Mapping[str, Any], caller: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(ConvertOptions)}
    out: dict[str, Any] = {}
    for name, value in fields.items():
        key = ALIASES.get(name, name)
        if key not in known:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
        out[key] = value
    return out
