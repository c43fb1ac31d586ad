"""The integer (PT2E) recipe of one conversion: what is done to an LLM before, during and
after calibration, checked before any work and recorded in the file's metadata.

* ``weight_bits`` 8 or 4: int8 or int4 (Circle INT4) symmetric weights for every linear;
  with 4, an LLM's output head (lm_head) stays int8 per channel (its error reaches every logit).
* ``group_size``: with 4-bit weights, the columns that share a scale (per-group / blockwise,
  circleops.quantize.grouped; Circle BlockwiseQuantization); 0: one scale per output channel.
* ``rotate``: a Hadamard rotation of the residual stream folded into the weights
  (circleops.quantize.rotate); "auto" rotates Llama-shaped LLMs.
* ``gptq``: GPTQ rounding of the linear weights (circleops.quantize.gptq) on the
  calibration samples; on grouped 4-bit weights with act order, a clipping search and
  ``refine`` passes of coordinate descent after (gptq.refine_grouped).
* ``int16``: parts with int16 activations in a uint8 graph; ``"auto"`` chooses the ops
  from each activation's measured uint8 rounding SQNR (circleops.quantize.sensitivity).

Left out (None), the options take their defaults, which for an LLM are the recipes measured
usable (:func:`resolve_recipe`, docs/integer-llm.md): ``uint8`` on target circle gets
``int16="auto"``; 4-bit weights (asked for) get the 16a4w NPU recipe: groups of 16, GPTQ with
act order, a clipping search and 2 refinement passes, and the linears measured most
sensitive int8. Any option given is taken as given.

The metadata entry ``circleops.quantization`` (JSON) holds the recipe and what each
step reported, so a reader of the file knows what was done.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from circleops.errors import TargetError

WEIGHT_BITS = (8, 4)
ROTATE_MODES = ("auto", "on", "off")
METADATA_KEY = "circleops.quantization"
# mixed precision "auto": uint8 tensors whose own rounding SQNR is below this go int16, up to
# AUTO_BUDGET of the ops (measured on SmolLM2: bench/README.md, "Integer LLMs")
AUTO_MIN_DB = 25.0
AUTO_BUDGET = 0.5


@dataclass
class IntegerRecipe:
    scheme: str  # activations: "uint8" / "int16"
    weight_bits: int = 8
    rotate: str = "auto"
    gptq: bool = False
    int16: tuple[str, ...] = ()
    calibrate: int = 8
    group_size: int = 0
    lines: list[str] = field(default_factory=list)  # what each step reported
    rotation: Any = None  # the residual stream's Q while the rotation is folded in (h_rotated = h · Q)
    rotated: Any = None  # its circleops.quantize.rotate.RotateReport while folded in (release_unread)
    int8_weights: str = ""  # "auto": the 4-bit linears measured most sensitive stay int8 per channel
    act_order: bool = False  # GPTQ on groups: static group scales, columns by decreasing Hessian diagonal
    clip_search: bool = False  # GPTQ on groups: each group's scale by a Hessian-weighted clipping search
    refine: int = 0  # GPTQ on groups: passes of coordinate descent after (gptq.refine_grouped)
    defaults: str = ""  # what the defaults for an LLM chose (resolve_recipe), for the summary

    @property
    def weight(self) -> str:
        return "int4" if self.weight_bits == 4 else "int8"

    @property
    def weight_label(self) -> str:
        return f"{self.weight} weights in groups of {self.group_size}" if self.group_size else \
            f"{self.weight} per-channel weights"

    @property
    def auto_mixed(self) -> bool:
        return "auto" in self.int16

    def summary_lines(self) -> list[str]:
        head = (f"{self.scheme} activations, {self.weight_label}, int32 bias (PT2E, {self.calibrate} "
                "calibration samples)")
        return [head, *([self.defaults] if self.defaults else []), *self.lines]

    def to_dict(self) -> dict[str, Any]:
        return {"activations": self.scheme, "weights": self.weight, "weight_bits": self.weight_bits,
                "group_size": self.group_size, "int8_weights": self.int8_weights, "rotate": self.rotate,
                "gptq": self.gptq, "act_order": self.act_order, "clip_search": self.clip_search,
                "gptq_refine": self.refine,
                "int16": list(self.int16), "calibrate": self.calibrate,
                "defaults": self.defaults, "steps": list(self.lines)}

    def metadata(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()


def group_size_for(weight_bits: int, group_size: int | None, llm: bool = False) -> int:
    """The columns per scale: ``None`` is the default (4-bit: an LLM's LLM_GROUP, the 16a4w
    NPU recipe measured on SmolLM2, bench/results/43-npu-16a4w-default.yaml; other models'
    DEFAULT_GROUP, bench/results/12-integer-llm.yaml; 8-bit: per channel), 0 per channel."""
    from circleops.quantize.grouped import DEFAULT_GROUP, LLM_GROUP

    if group_size is None:
        return (LLM_GROUP if llm else DEFAULT_GROUP) if weight_bits == 4 else 0
    return int(group_size)


def check_recipe(scheme: str | None, target: str, weight_bits: int | None = 8, gptq: bool | None = False,
                 rotate: str = "auto", group_size: int | None = None, *, int8_weights: str | None = "") -> None:
    """Errors for options that do not apply, before any work; None is an option left to its
    default (resolve_recipe), checked once the model is known."""
    from circleops.quantize import INTEGER_FORMATS

    if int8_weights not in (None, "", "auto", "none"):
        raise TargetError(f"int8 weights {int8_weights!r}: 'auto' (the linears measured most sensitive stay int8) "
                          "or 'none'")
    if int8_weights == "auto" and (weight_bits == 8 or group_size == 0):
        raise TargetError("int8 weights 'auto' keeps some linears of a per-group 4-bit recipe at 8 bits: add "
                          "--weight-bits 4 (with a group size)")

    if weight_bits is not None and weight_bits not in WEIGHT_BITS:
        raise TargetError(f"weight_bits={weight_bits!r}: integer weights are 8 or 4 bits")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0 or \
                (group_size and (group_size < 8 or group_size & (group_size - 1))):
            raise TargetError(f"weight group size {group_size!r}: give a power of two from 8 (e.g. 32, 64, 128), "
                              "or 0 for one scale per output channel")
        if group_size and weight_bits == 8:
            raise TargetError(f"weight group size {group_size}: per-group scales are for 4-bit weights; add "
                              "--weight-bits 4 (weight_bits=4), or leave the group size out for int8 per channel")
    if rotate not in ROTATE_MODES:
        raise TargetError(f"rotate={rotate!r}: choose one of {', '.join(ROTATE_MODES)}")
    if scheme not in INTEGER_FORMATS:
        if weight_bits not in (None, 8) or gptq or rotate == "on" or group_size or int8_weights == "auto":
            raise TargetError("weight_bits / gptq / rotate / int8 weights apply to integer graphs: add "
                              f"quantize='uint8' or quantize='int16' (got quantize={scheme!r})")
        return
    if weight_bits == 4 and target != "circle":
        why = ("onert 0.1.0 loads no INT4 tensor ('Unsupported tensor type', measured)" if target == "onert" else
               "circleops' integer TFLite files carry 8-bit weights (LiteRT's int8 and 16x8 kernels; 4-bit "
               "weights are not written for LiteRT)" if target == "tflite" else
               "4-bit weights are written for target circle only")
        raise TargetError(f"target {target}: {why}; write 4-bit weights with --target circle (NPU compilers) and "
                          "run the file in the reference interpreter (--runtime reference)")


@dataclass(frozen=True)
class RecipeOptions:
    """The integer options as given (convert's keywords, the CLI's flags); None: the default,
    which :func:`resolve_recipe` chooses once the model and the target are known."""

    weight_bits: int | None = None
    gptq: bool | None = None
    rotate: str = "auto"
    group_size: int | None = None
    int16: tuple[str, ...] | None = None
    calibrate: int = 8
    int8_weights: str | None = None
    act_order: bool | None = None
    clip_search: bool | None = None
    refine: int | None = None

    @classmethod
    def of(cls, options: Any) -> "RecipeOptions":
        """The integer options of a circleops.options.ConvertOptions (or anything with its
        field names: the CLI's parsed flags), ``int16`` as given (None: left out)."""
        int16 = getattr(options, "int16", None)
        int16 = None if int16 is None else tuple(p.strip() for p in int16 if p.strip())
        return cls(options.weight_bits, options.gptq, options.rotate, options.weight_group_size, int16,
                   options.calibrate, options.int8_weights, options.act_order, options.clip_search,
                   options.gptq_refine)


# GPTQ's refinement passes on an LLM's grouped 4-bit weights, the default (measured on SmolLM2,
# groups of 16: 27/32 -> 28/32 top-1 on the hold-out window, bench/results/41-npu-16a4w-ideas.yaml)
LLM_REFINE = 2


def is_causal_lm(model: Any) -> bool:
    """A Hugging Face causal LM (a vocabulary and an output head): what the LLM defaults are for."""
    config = getattr(model, "config", None)
    head = getattr(model, "get_output_embeddings", None)
    return getattr(config, "vocab_size", None) is not None and callable(head) and head() is not None


def resolve_recipe(scheme: str | None, target: str, model: Any, options: RecipeOptions) -> IntegerRecipe | None:
    """The recipe of ``options`` for ``model`` on ``target``, checked; None for a format that
    is not an integer graph. For an LLM the options left out (None) take the recipes measured
    usable (docs/integer-llm.md, bench/results/35-npu-defaults.yaml):

    * 4-bit weights (asked for: 8 bits stay ``int16``'s default, 27.7 dB against 17 dB):
      the 16a4w NPU recipe, measured usable on SmolLM2 (bench/results/43-npu-16a4w-default.yaml):
      groups of grouped.LLM_GROUP (16) columns, GPTQ with act order, the Hessian-weighted
      clipping search and LLM_REFINE passes of coordinate descent, and ``int8_weights="auto"``
      (the linears measured most sensitive int8, within grouped.INT8_SHARE of the weights);
    * ``uint8`` activations on target circle: ``int16="auto"`` (measured mixed precision);
      on onert (no int16) and tflite (integer TFLite files stay int8 throughout, what its
      delegates expect) uint8 throughout, and the file's measured score says what it costs
      and what to add (circleops.quantize.llm.score_line).

    Any other model, and every option given, as given (int8 weights, no GPTQ, no int16 parts)."""
    from circleops.quantize import INTEGER_FORMATS

    o = options
    check_recipe(scheme, target, o.weight_bits, o.gptq, o.rotate, o.group_size, int8_weights=o.int8_weights)
    if scheme not in INTEGER_FORMATS:
        _gptq_choices(o, False, False, [])  # refuses act order / clipping search / refinement asked for
        return None
    llm = is_causal_lm(model)
    chosen = []
    # 8-bit weights unless asked: the 16a4w recipe is usable (17 dB, 28/32 on SmolLM2's hold-out
    # text) but 8-bit weights score 27.7 dB there; 4 bits are the NPU's choice of size over quality
    bits = 8 if o.weight_bits is None else o.weight_bits
    group = group_size_for(bits, o.group_size, llm)
    if o.group_size is None and group and llm:
        chosen.append(f"groups of {group}")
    gptq = o.gptq
    if gptq is None:
        gptq = bits == 4 and llm
        if gptq:
            chosen.append("GPTQ")
    int8 = "" if o.int8_weights == "none" else o.int8_weights
    if int8 is None:
        int8 = "auto" if bits == 4 and group and llm else ""
        if int8:
            chosen.append("--int8-weights auto")
    act_order, clip_search, refine = _gptq_choices(o, bool(gptq and bits == 4 and group), llm, chosen)
    int16 = tuple(p.strip() for p in o.int16 if p.strip() and p.strip() != "none") if o.int16 is not None else None
    if int16 is None:
        int16 = ("auto",) if scheme == "uint8" and llm and target == "circle" else ()
        if int16:
            chosen.append("--int16 auto")
    check_recipe(scheme, target, bits, gptq, o.rotate, group, int8_weights=int8)
    recipe = IntegerRecipe(scheme, bits, o.rotate, gptq, int16, o.calibrate, group, int8_weights=int8,
                           act_order=act_order, clip_search=clip_search, refine=refine)
    if chosen:
        undo = {"GPTQ": "--no-gptq", "--int8-weights auto": "--int8-weights none",
                "--int16 auto": "--int16 none", "act order": "--no-act-order", "clipping search": "--no-clip-search",
                f"groups of {group}": "--weight-group-size N",
                f"{LLM_REFINE} refinement passes": "--gptq-refine 0"}
        recipe.defaults = (f"the measured recipe for an LLM (default): {', '.join(chosen)} (to leave out: "
                           f"{', '.join(undo[c] for c in chosen)}; docs/integer-llm.md)")
    return recipe


def _gptq_choices(o: RecipeOptions, grouped_gptq: bool, llm: bool, chosen: list[str]) -> tuple[bool, bool, int]:
    """(act order, clipping search, refinement passes) of GPTQ on grouped 4-bit weights: as
    given, else on (LLM_REFINE passes) for an LLM (measured: bench/results/36-npu-16a4w.yaml,
    41-npu-16a4w-ideas.yaml), each default named in ``chosen``."""
    if o.refine is not None and (isinstance(o.refine, bool) or not isinstance(o.refine, int) or o.refine < 0):
        raise TargetError(f"--gptq-refine {o.refine!r}: a number of passes, 0 or more")
    out: list = []
    for name, value, label in (("--act-order", o.act_order, "act order"),
                               ("--clip-search", o.clip_search, "clipping search")):
        if value and not grouped_gptq:
            raise TargetError(f"{name} is a choice of GPTQ on grouped 4-bit weights: add --weight-bits 4 (with a "
                              "group size) and --gptq, or leave it out")
        if value is None:
            value = grouped_gptq and llm
            if value:
                chosen.append(label)
        out.append(bool(value))
    refine = o.refine
    if refine and not grouped_gptq:
        raise TargetError("--gptq-refine is a choice of GPTQ on grouped 4-bit weights: add --weight-bits 4 (with a "
                          "group size) and --gptq, or leave it out")
    if refine is None:
        refine = LLM_REFINE if grouped_gptq and llm else 0
        if refine:
            chosen.append(f"{refine} refinement passes")
    return out[0], out[1], refine


def recipe_options(scheme: str | None, options: RecipeOptions, *, tico: bool = False,
                   calibration_data: Any = None) -> RecipeOptions | None:
    """The recipe options as the CLI gives them (check --quantize), checked before any work
    (resolve_recipe completes them once the model is loaded); None for a format that is not
    an integer graph (where only defaults are allowed)."""
    from circleops.quantize import INTEGER_FORMATS

    o = options
    check_recipe(scheme, "circle", o.weight_bits, o.gptq, o.rotate, o.group_size, int8_weights=o.int8_weights)
    if scheme not in INTEGER_FORMATS:
        if tico or o.int16 or calibration_data or o.calibrate != 8:
            raise TargetError(f"--tico / --int16 / --calibrate / --calibration-data apply to --quantize uint8 or "
                              f"int16, not {scheme}")
        return None
    if o.calibrate < 1:
        raise TargetError(f"--calibrate must be at least 1, got {o.calibrate}")
    return o


def recipe_from_args(args: Any) -> RecipeOptions | None:
    """:func:`recipe_options` of the CLI's parsed options (circleops.cli.integer.add_integer_arguments)."""
    from circleops.options import int16_parts

    import dataclasses

    options = dataclasses.replace(RecipeOptions.of(args), int16=int16_parts(args.int16))  # --int16's text parsed
    return recipe_options(args.quantize, options, tico=args.tico, calibration_data=args.calibration_data)
