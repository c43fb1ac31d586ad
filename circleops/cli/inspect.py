"""``circleops inspect FILE``: what a Circle or TFLite file holds (circleops.tools.inspect)."""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a .circle or .tflite file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--tensors", action="store_true",
                        help="list every constant tensor: storage type (FLOAT32, GGML_Q4_0, INT8...), shape, bytes, "
                             "quantization; and every quantized activation with its scale and zero point")


def main(args: argparse.Namespace) -> int:
    from circleops.tools.inspect import format_text, json_default, summarize

    summary = summarize(args.file)
    if args.json:
        print(json.dumps(summary, indent=2, default=json_default))
    else:
        print(format_text(summary, tensors=args.tensors))
    return 0
