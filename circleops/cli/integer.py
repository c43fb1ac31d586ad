"""The integer (PT2E) recipe's options, shared by ``circleops convert`` and ``circleops check``:
the ``integer`` group of circleops.options.ConvertOptions' flags (declared once there).

Standard library only at import time (``circleops CMD --help`` must stay instant).
"""
from __future__ import annotations

from typing import Any


def add_integer_arguments(parser: Any) -> None:
    """The options of integer (PT2E) graphs (--calibrate, --int16, --calibration-data,
    --weight-bits, --weight-group-size, --int8-weights, --gptq, --rotate), as convert takes them."""
    from circleops.cli.options import add_options

    add_options(parser, ["integer"])
