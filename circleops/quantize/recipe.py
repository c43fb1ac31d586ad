"""The integer (PT2E) recipe of one conversion: what is done to an LLM before, during and
after calibration, checked before any work and recorded in the file's metadata.

* ``weight_bits`` 8 or 4: int8 or int4 (Circle INT4) symmetric weights for every linear;
  with 4, an LLM's output head (lm_head) stays int8 per channel (its error reaches every logit).
* ``group_size``: with 4-bit weights, the columns that share a scale (per-group / blockwise,
  circleops.quantize.grouped; Circle BlockwiseQuantization); 0: one scale per output channel.
* ``rotate``: a Hadamard rotation of the residual stream folded into the weights
  (circleops.quantize.rotate); "auto" rotates Llama-shaped LLMs.
* ``gptq``: GPTQ rounding of the linear weights (circleops.quantize.gptq) on the
  calibration samples.
* ``int16``: parts with int16 activations in a uint8 graph; ``"auto"`` chooses the ops
  from each activation's measured uint8 rounding SQNR (circleops.quantize.sensitivity).

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
    int8_weights: str = ""  # "auto": the 4-bit linears measured most sensitive stay int8 per channel

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
        return [head, *self.lines]

    def to_dict(self) -> dict[str, Any]:
        return {"activations": self.scheme, "weights": self.weight, "weight_bits": self.weight_bits,
                "group_size": self.group_size, "int8_weights": self.int8_weights, "rotate": self.rotate, "gptq": self.gptq, "int16": list(self.int16), "calibrate": self.calibrate,
                "steps": list(self.lines)}

    def metadata(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()


def group_size_for(weight_bits: int, group_size: int | None) -> int:
    """The columns per scale: ``None`` is the default (4-bit: DEFAULT_GROUP, measured on
    SmolLM2, bench/results/12-integer-llm.yaml; 8-bit: per channel), 0 per channel."""
    from circleops.quantize.grouped import DEFAULT_GROUP

    if group_size is None:
        return DEFAULT_GROUP if weight_bits == 4 else 0
    return int(group_size)


def check_recipe(scheme: str | None, target: str, weight_bits: int = 8, gptq: bool = False,
                 rotate: str = "auto", group_size: int | None = None, *, int8_weights: str = "") -> None:
    """Errors for options that do not apply, before any work."""
    from circleops.quantize import INTEGER_FORMATS

    if int8_weights not in ("", "auto"):
        raise TargetError(f"int8 weights {int8_weights!r}: 'auto' (the linears measured most sensitive stay int8) "
                          "is the one choice")
    if int8_weights and (weight_bits != 4 or group_size == 0):
        raise TargetError("int8 weights 'auto' keeps some linears of a per-group 4-bit recipe at 8 bits: add "
                          "--weight-bits 4 (with a group size)")

    if weight_bits not in WEIGHT_BITS:
        raise TargetError(f"weight_bits={weight_bits!r}: integer weights are 8 or 4 bits")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0 or \
                (group_size and (group_size < 8 or group_size & (group_size - 1))):
            raise TargetError(f"weight group size {group_size!r}: give a power of two from 8 (e.g. 32, 64, 128), "
                              "or 0 for one scale per output channel")
        if group_size and weight_bits != 4:
            raise TargetError(f"weight group size {group_size}: per-group scales are for 4-bit weights; add "
                              "--weight-bits 4 (weight_bits=4), or leave the group size out for int8 per channel")
    if rotate not in ROTATE_MODES:
        raise TargetError(f"rotate={rotate!r}: choose one of {', '.join(ROTATE_MODES)}")
    if scheme not in INTEGER_FORMATS:
        if weight_bits != 8 or gptq or rotate == "on" or group_size:
            raise TargetError("weight_bits / gptq / rotate apply to integer graphs: add quantize='uint8' or "
                              f"quantize='int16' (got quantize={scheme!r})")
        return
    if weight_bits == 4 and target != "circle":
        why = ("onert 0.1.0 loads no INT4 tensor ('Unsupported tensor type', measured)" if target == "onert" else
               "circleops' integer TFLite files carry 8-bit weights (LiteRT's int8 and 16x8 kernels; 4-bit "
               "weights are not written for LiteRT)" if target == "tflite" else
               "4-bit weights are written for target circle only")
        raise TargetError(f"target {target}: {why}; write 4-bit weights with --target circle (NPU compilers) and "
                          "run the file in the reference interpreter (--runtime reference)")


def recipe_for(scheme: str | None, *, weight_bits: int = 8, gptq: bool = False, rotate: str = "auto",
               group_size: int | None = None, int16: Any = (), calibrate: int = 8, int8_weights: str = "",
               tico: bool = False, calibration_data: Any = None) -> IntegerRecipe | None:
    """The recipe of options as the CLI gives them (check --quantize), checked before any
    work; None for a format that is not an integer graph (where only defaults are allowed)."""
    from circleops.quantize import INTEGER_FORMATS

    parts = tuple(p.strip() for p in int16 if p.strip())
    check_recipe(scheme, "circle", weight_bits, gptq, rotate, group_size, int8_weights=int8_weights)
    if scheme not in INTEGER_FORMATS:
        if tico or parts or calibration_data or calibrate != 8:
            raise TargetError(f"--tico / --int16 / --calibrate / --calibration-data apply to --quantize uint8 or "
                              f"int16, not {scheme}")
        return None
    if calibrate < 1:
        raise TargetError(f"--calibrate must be at least 1, got {calibrate}")
    return IntegerRecipe(scheme, weight_bits, rotate, gptq, parts, calibrate, group_size_for(weight_bits, group_size),
                         int8_weights=int8_weights)


def recipe_from_args(args: Any) -> IntegerRecipe | None:
    """:func:`recipe_for` of the CLI's parsed options (circleops.cli.integer.add_integer_arguments)."""
    return recipe_for(args.quantize, weight_bits=args.weight_bits, gptq=args.gptq, rotate=args.rotate,
                      group_size=args.weight_group_size, int16=args.int16.split(","), calibrate=args.calibrate,
                      int8_weights=args.int8_weights, tico=args.tico, calibration_data=args.calibration_data)
