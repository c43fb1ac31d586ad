"""``circleops ops [OP ...]``: the op registry as a table (circleops.ops.table): the built-in
fused ops, then users' and installed plugins' ops (entry points ``circleops.ops``)."""
from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="OP", help="only these ops (default: all)")
    parser.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                        help="output format (default: table)")


def main(args: argparse.Namespace) -> int:
    from circleops.ops.table import format_markdown, format_table, rows

    table = rows(args.names)
    if args.format == "json":
        print(json.dumps(table, indent=2))
    elif args.format == "markdown":
        print(format_markdown(table))
    else:
        print(format_table(table))
    return 0
