"""``circleops inspect FILE``: what a Circle or TFLite file holds (circleops.inspect)."""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a .circle or .tflite file")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def main(args: argparse.Namespace) -> int:
    from circleops.inspect import format_text, json_default, summarize

    summary = summarize(args.file)
    if args.json:
        print(json.dumps(summary, indent=2, default=json_default))
    else:
        print(format_text(summary))
    return 0
