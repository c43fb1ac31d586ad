"""``circleops`` command line: convert / inspect / run / check / ops / generate / chat.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; modules are imported only when their command runs, so that
``circleops --version`` and ``circleops ops`` stay fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from circleops._version import __version__
from circleops.cli.process import (Terminated, exit_without_teardown, install_sigterm, one_line, restore_sigterm,
                                   silence_stdout)
from circleops.cli.quiet import dependency_output

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("circleops.cli.convert", "convert a model to a .circle or .tflite file"),
    "inspect": ("circleops.cli.inspect", "show the ops, tensors and signatures of a Circle or TFLite file"),
    "run": ("circleops.cli.run", "run a Circle or TFLite file on inputs (.npy)"),
    "check": ("circleops.cli.check", "fp16/bf16 numerics report: error per layer and generation agreement per norm policy"),
    "ops": ("circleops.cli.ops", "list the fused ops: schema, Circle builtin, TFLite composite, targets"),
    "generate": ("circleops.cli.generate", "generate text with written prefill/decode graphs (greedy or --sample)"),
    "chat": ("circleops.cli.chat", "a multi-turn chat with written prefill/decode graphs (the KV cache kept between turns)"),
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
        subparsers[name].add_argument(
            "--verbose", action="store_true",
            help="also show what the libraries underneath (torch, torchao, transformers, ...) log and warn; "
                 "hidden by default")
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``circleops`` console script."""
    code = _main(sys.argv[1:] if argv is None else argv)
    try:  # output to a pipe is buffered: a reader that left (`| head`) shows up here
        sys.stdout.flush()
    except BrokenPipeError:
        silence_stdout()
        code = 141
    except (OSError, ValueError):
        pass
    if argv is None and _FAST_EXIT:
        exit_without_teardown(code)
    return code


# Set by a command module with ``EXIT_WITHOUT_TEARDOWN = True`` (see process.exit_without_teardown).
_FAST_EXIT = False


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

    previous = install_sigterm()
    try:
        with dependency_output(args.verbose):
            return int(args._module.main(args) or 0)
    except CircleOpsError as err:
        print(f"circleops {args.command}: error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        # Raised in the main thread by the SIGTERM handler: every `finally` / cleanup on the
        # way out has run (the writer removed its temporary file).
        print("circleops: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("circleops: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `circleops inspect x | head`: the reader left. Nothing more can be printed;
        # point stdout at /dev/null so the interpreter's final flush does not complain.
        silence_stdout()
        return 141
    except Exception as err:  # noqa: BLE001 - the CLI never prints a traceback
        print(f"circleops: internal error in {args.command}: {type(err).__name__}: {one_line(err)}; please report "
              "this (the command line, and the model or file if you can share it) at the circleops issue tracker. "
              "Set CIRCLEOPS_DEBUG=1 to see the traceback.", file=sys.stderr)
        if os.environ.get("CIRCLEOPS_DEBUG"):
            import traceback

            traceback.print_exc()
        return 1
    finally:
        restore_sigterm(previous)
