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

Adding an op = one file here + one entry in schema/ops.yaml (:func:`define_builtin` defines it).

The built-ins are defined through the same public decorator as users' and plugins' ops
(:func:`circleops.op`, circleops.ops.registry): one registry, ``REGISTRY``, keyed by the
short name for ``circle::*`` and by the qualified name (``mylib::swiglu``) for the others.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping

import yaml

from circleops.ops.registry import (CONTESTED, PLUGIN_GROUP, PLUGINS, REGISTRY, OpDefinitionError, OpSpec,
                                    PluginWarning, UnknownCustomOpError, by_custom_code, by_overload, load_plugins,
                                    lookup, op, register_op, unknown_custom_code)
from circleops.ops._common import at_least_fp32

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


def define_builtin(contract: Mapping[str, Any], module: ModuleType) -> OpSpec:
    """Define one built-in op from its schema/ops.yaml entry and its module (circleops/ops/<name>.py:
    ``reference``, ``fake``, ``sample_inputs``, optionally ``kernel``) through :func:`op`, the
    public path. Nothing else is needed: the lowering, the reference interpreter, the CLI's
    ``ops`` listing and the op battery read the spec (tests/architecture/test_how_to_add.py
    defines one from two files written in a test)."""
    spec = op(contract["schema"], circle=contract["circle"], tflite=contract["tflite"],
              autocast=contract["autocast"], samples=module.sample_inputs,
              contract={**contract, "module": module, "provider": "circleops"})(module.reference)
    spec.register_fake(module.fake)
    if getattr(module, "kernel", None) is not None:
        spec.register_kernel(module.kernel)
    return spec


def _load_builtins() -> list[str]:
    """Define every op of schema/ops.yaml."""
    with open(SCHEMA_PATH) as f:
        contracts = yaml.safe_load(f)["ops"]
    for name, contract in contracts.items():
        define_builtin(contract, importlib.import_module(f"circleops.ops.{name}"))
    return list(contracts)


# The built-in ops' REGISTRY keys, in schema/ops.yaml order (REGISTRY also holds user ops).
BUILTINS: tuple[str, ...] = tuple(_load_builtins())


__all__ = ["BUILTINS", "OpDefinitionError", "define_builtin", "OpSpec", "PLUGINS", "PLUGIN_GROUP", "PluginWarning", "REGISTRY",
           "CONTESTED", "SCHEMA_PATH", "UnknownCustomOpError", "at_least_fp32", "by_custom_code", "by_overload", "load_plugins",
           "lookup", "op", "register_op", "unknown_custom_code"]
