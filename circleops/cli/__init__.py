"""``circleops`` command line: convert / inspect / run / check / ops / generate.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; modules are imported only when their command runs, so that
``circleops --version`` and ``circleops ops`` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from circleops._version import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("circleops.cli.convert", "convert a model to a .circle or .tflite file"),
    "inspect": ("circleops.cli.inspect", "show the ops, tensors and signatures of a Circle or TFLite file"),
    "run": ("circleops.cli.run", "run a Circle or TFLite file on inputs (.npy)"),
    "check": ("circleops.cli.check", "fp16/bf16 numerics report: error per layer and generation agreement per norm policy"),
    "ops": ("circleops.cli.ops", "list the fused ops: schema, Circle builtin, TFLite composite, targets"),
    "generate": ("circleops.cli.generate", "greedy generation with written prefill/decode graphs"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="circleops",
        description="Export PyTorch / Hugging Face models to Circle and TFLite with RMSNorm, RoPE, "
                    "attention and instance norm kept as fused ops.")
    parser.add_argument("--version", action="version", version=f"circleops {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, (_, help_text) in COMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``circleops`` console script."""
    code = _main(sys.argv[1:] if argv is None else argv)
    if argv is None and _FAST_EXIT:
        _exit_without_teardown(code)
    return code


# Set by a command module with ``EXIT_WITHOUT_TEARDOWN = True`` (see _exit_without_teardown).
_FAST_EXIT = False


def _exit_without_teardown(code: int) -> None:
    """End the console script without the interpreter's teardown: freeing the ~4000 modules
    torch and transformers load takes ~1 s, a fifth of a whole conversion. atexit handlers
    (tempfile and logging cleanup) still run; the command has closed its files."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(argv: list[str]) -> int:
    global _FAST_EXIT
    parser, subparsers = build_parser()
    # Only the chosen command's module is imported (and adds its arguments).
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in COMMANDS:
        module = importlib.import_module(COMMANDS[command][0])
        module.add_arguments(subparsers[command])
        subparsers[command].set_defaults(_module=module)
        _FAST_EXIT = bool(getattr(module, "EXIT_WITHOUT_TEARDOWN", False))
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 1
    from circleops.errors import CircleOpsError

    try:
        return int(args._module.main(args) or 0)
    except CircleOpsError as err:
        print(f"circleops {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("circleops: interrupted", file=sys.stderr)
        return 130
