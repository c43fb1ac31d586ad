"""The integer (PT2E) recipe's options, shared by ``circleops convert`` and ``circleops check``.

Standard library only at import time (``circleops CMD --help`` must stay instant). An option
left out takes its default, which for an LLM is the recipe measured usable
(circleops.quantize.recipe.resolve_recipe).
"""
from __future__ import annotations

import argparse
from typing import Any


def add_integer_arguments(parser: Any) -> None:
    """The options of integer (PT2E) graphs, shared by convert and check."""
    from circleops.quantize import INT16_PARTS, INT16_PRESETS
    from circleops.quantize.recipe import ROTATE_MODES, WEIGHT_BITS

    parser.add_argument("--calibrate", type=int, default=8, metavar="N",
                        help="with --quantize uint8/int16: calibrate on N samples (LLMs: windows of the text "
                             "shipped in circleops/quantize/calibration.txt; other models: the example input with "
                             "seeded noise, or --calibration-data) (default 8)")
    parser.add_argument("--int16", metavar="PARTS", default="", help="with --quantize uint8: int16 activations for "
                        "these comma-separated parts (mixed precision): auto: the ops whose activations measure "
                        "worst in uint8 (the default for an LLM with --target circle); none: uint8 "
                        "throughout; " + "; ".join(f"{k}: {v}" for k, v in INT16_PARTS.items())
                        + f"; presets {INT16_PRESETS}; or module names / globs (*.mlp.down_proj)")
    parser.add_argument("--calibration-data", metavar="PT", default=None,
                        help="with --quantize uint8/int16: a .pt file of input tensors to calibrate on "
                             "(loaded with weights_only=True)")
    parser.add_argument("--weight-bits", type=int, choices=WEIGHT_BITS, default=None,
                        help="with --quantize uint8/int16: int8 per-channel or int4 (Circle INT4, target circle) "
                             "weights; an LLM's lm_head stays int8 (default 8: the 4-bit recipe measures below the usable "
                             "bar on SmolLM2, docs/integer-llm.md)")
    parser.add_argument("--weight-group-size", type=int, default=None, metavar="N",
                        help="with --weight-bits 4: N input columns share a scale (per-group, written as Circle "
                             "BlockwiseQuantization); 0: one scale per output channel (default 32, measured best "
                             "on SmolLM2: docs/integer-llm.md)")
    parser.add_argument("--int8-weights", choices=("auto", "none"), default=None,
                        help="with --weight-bits 4: auto: the linears whose int4 rounding measures worst in the "
                             "logits stay int8 per channel (at most a quarter of the weights; the default for an "
                             "LLM); none: every linear int4")
    parser.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                        help="with --quantize uint8/int16: GPTQ rounding of the weights on the calibration samples "
                             "(default: on for an LLM's 4-bit weights)")
    parser.add_argument("--rotate", choices=ROTATE_MODES, default="auto",
                        help="with --quantize uint8/int16: fold a Hadamard rotation of an LLM's residual stream "
                             "into its weights (auto: Llama-shaped LLMs)")


def integer_options(args: Any, quantize: str | None) -> dict[str, Any]:
    """The convert keyword arguments of the integer options, checked (before any work; what
    is left out is completed once the model is known, circleops.quantize.recipe.resolve_recipe)."""
    from circleops.quantize import INTEGER_FORMATS
    from circleops.quantize.recipe import check_recipe, int16_option

    check_recipe(quantize, getattr(args, "target", "circle"), args.weight_bits, args.gptq, args.rotate,
                 args.weight_group_size, int8_weights=args.int8_weights)
    if quantize not in INTEGER_FORMATS:
        return {}
    return dict(calibrate=args.calibrate, calibration_data=args.calibration_data, int16=int16_option(args.int16),
                weight_bits=args.weight_bits, gptq=args.gptq, rotate=args.rotate,
                weight_group_size=args.weight_group_size, int8_weights=args.int8_weights)
