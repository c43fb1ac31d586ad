"""The op registry: the fused ``circle::*`` torch ops and their contracts.

schema/ops.yaml is the single source of truth: each op is registered from its schema
string there (``_common.define``; its defaults are written nowhere else). Each entry names
a module of this package (one file per op) that provides, each taking every schema argument
positionally:

* ``reference``: the kernel, written in aten ops so it doubles as the decomposition; its
  gradient is the op's gradient, and (unless ``kernel`` is given) it is the eager kernel;
* ``fake``: the output's shape and dtype, for torch.export;
* ``kernel`` (optional): a faster eager kernel with the reference kernel's exact roundings;
* ``sample_inputs(dtype)``: ``(args, kwargs)`` pairs for the generic tests in tests/ops.

Adding an op = one file here + one entry in schema/ops.yaml.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import yaml

from circleops.ops._common import at_least_fp32, bind, define, with_defaults

def _schema_path() -> Path:
    # schema/ops.yaml lives at the top of the repository (an editable install reads it in
    # place); a wheel installs it as data under <prefix>/share/circleops/.
    in_repo = Path(__file__).resolve().parents[2] / "schema" / "ops.yaml"
    if in_repo.exists():
        return in_repo
    installed = Path(sys.prefix) / "share" / "circleops" / "ops.yaml"
    if installed.exists():
        return installed
    raise FileNotFoundError(
        f"circleops: the op contracts (schema/ops.yaml) are missing: looked at {in_repo} and "
        f"{installed}; reinstall circleops (pip install -e . from the repository)")


SCHEMA_PATH = _schema_path()


@dataclass(frozen=True)
class OpSpec:
    """One fused op: its contract from schema/ops.yaml and its implementation module."""

    name: str
    contract: dict[str, Any]
    module: ModuleType = field(repr=False)
    # The reference kernel callable with the schema's defaults (module.reference takes all)
    reference: Callable[..., Any] = field(repr=False)

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        """``torch.ops.circle.<name>``."""
        return getattr(torch.ops.circle, self.name)

    @property
    def overload(self) -> torch._ops.OpOverload:
        return self.op.default

    @property
    def schema(self) -> str:
        return self.contract["schema"]

    @property
    def circle(self) -> dict[str, Any]:
        return self.contract["circle"]

    @property
    def tflite(self) -> dict[str, Any]:
        return self.contract["tflite"]

    @property
    def targets(self) -> dict[str, str]:
        """target -> how its profile writes the op: builtin, decomposed or composite
        (circleops.targets: a target that lacks the builtin decomposes the op)."""
        from circleops.targets import PROFILES

        return {name: p.fused_form(self.circle["builtin"]) for name, p in PROFILES.items()}

    @property
    def autocast(self) -> str:
        """What the op does under torch.autocast: "fp32", "lower_precision" or "none"."""
        return self.contract["autocast"]

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A call's arguments by schema name, the schema's defaults filled in."""
        schema = self.overload._schema
        return dict(zip((a.name for a in schema.arguments), bind(schema, args, kwargs)))

    def sample_inputs(self, dtype: torch.dtype) -> list[tuple[tuple, dict]]:
        """``(args, kwargs)`` pairs exercising every attribute, for generic tests."""
        return self.module.sample_inputs(dtype)


def _load() -> dict[str, OpSpec]:
    with open(SCHEMA_PATH) as f:
        contracts = yaml.safe_load(f)["ops"]
    specs = {}
    for name, contract in contracts.items():
        module = importlib.import_module(f"circleops.ops.{name}")
        op = define(contract, module)
        specs[name] = OpSpec(name, contract, module, with_defaults(module.reference, op._opoverload._schema))
    return specs


REGISTRY: dict[str, OpSpec] = _load()


def by_overload(target: Any) -> OpSpec | None:
    """The OpSpec for an FX node target (``torch.ops.circle.x.default``), else None."""
    for spec in REGISTRY.values():
        if target is spec.overload or target is spec.op:
            return spec
    return None


__all__ = ["OpSpec", "REGISTRY", "SCHEMA_PATH", "at_least_fp32", "by_overload"]
