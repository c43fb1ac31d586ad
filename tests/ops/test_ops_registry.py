"""schema/ops.yaml against what is registered: torch schemas, Circle schema, TFLite schema, CLI table.

Everything here is parametrized over circleops.ops.REGISTRY: a new op is checked by being
registered.
"""
from __future__ import annotations

import json
import shutil
import subprocess

import ai_edge_litert.schema_py_generated as tfl
import pytest
import torch
import yaml
from circle_schema import circle

from circleops.cli import main as cli_main
from circleops.ops import BUILTINS, REGISTRY, SCHEMA_PATH, by_overload
from circleops.ops._common import OpArgumentError
from circleops.targets import FUSED_FORMS, TARGETS

OPS = list(BUILTINS)
DTYPE_NAMES = {"float32", "float16", "bfloat16", "float64", "int64", "int32"}
ATTR_TYPES = {"float": torch.FloatType, "int": torch.IntType, "str": torch.StringType, "bool": torch.BoolType}


def _arguments(name):
    return REGISTRY[name].overload._schema.arguments


def test_every_contract_has_its_module():
    with open(SCHEMA_PATH) as f:
        contracts = yaml.safe_load(f)["ops"]
    assert list(contracts) == OPS
    for name in OPS:
        spec = REGISTRY[name]
        assert spec.module.NAME == name and spec.provider == "circleops" and spec.builtin
        assert callable(spec.module.reference) and callable(spec.module.sample_inputs)


@pytest.mark.parametrize("name", OPS)
def test_torch_schema_equals_yaml(name):
    spec = REGISTRY[name]
    assert torch._C.parse_schema(spec.schema) == spec.overload._schema, (
        f"schema/ops.yaml says\n  {spec.schema}\nbut circle::{name} is registered as\n  {spec.overload._schema}")


def test_schema_comparison_sees_a_changed_default():
    # The equality above must not be vacuous: a changed default or name is a mismatch.
    spec = REGISTRY["rms_norm"]
    assert torch._C.parse_schema(spec.schema.replace("eps=1e-06", "eps=1e-05")) != spec.overload._schema
    assert torch._C.parse_schema(spec.schema.replace("Tensor x", "Tensor input")) != spec.overload._schema


@pytest.mark.parametrize("name", OPS)
def test_yaml_inputs_and_attributes_follow_the_schema(name):
    contract = REGISTRY[name].contract
    args = _arguments(name)
    declared = contract["inputs"] + contract["attributes"]
    assert [a.name for a in args] == [d["name"] for d in declared], "inputs + attributes must list the schema's arguments in order"
    for arg, decl in zip(args, contract["inputs"]):
        optional = isinstance(arg.type, torch.OptionalType)
        base = arg.type.getElementType() if optional else arg.type
        assert isinstance(base, torch.TensorType), f"{name}.{arg.name}: inputs are tensors; scalars go under attributes"
        assert bool(decl.get("optional", False)) == optional, f"{name}.{arg.name}: optional flag disagrees with the schema"
        assert decl["shape"] and set(decl["dtypes"]) <= DTYPE_NAMES, f"{name}.{arg.name}: shape and dtypes must be given"
    for arg, decl in zip(args[len(contract["inputs"]):], contract["attributes"]):
        assert isinstance(arg.type, ATTR_TYPES[decl["type"]]), f"{name}.{arg.name}: type {arg.type} vs yaml {decl['type']}"
        assert arg.default_value == decl["default"], f"{name}.{arg.name}: default {arg.default_value!r} vs yaml {decl['default']!r}"
        assert decl["meaning"]
    assert len(contract["outputs"]) == len(REGISTRY[name].overload._schema.returns)
    assert contract["autocast"] in ("fp32", "lower_precision", "none")
    assert contract["compute_policy"]["default"]


@pytest.mark.parametrize("name", OPS)
def test_enumerated_attribute_values_are_exactly_the_accepted_ones(name):
    spec = REGISTRY[name]
    args, kwargs = spec.sample_inputs(torch.float32)[0]
    for decl in spec.contract["attributes"]:
        for value in decl.get("values", ()):
            spec.op(*args, **{**kwargs, decl["name"]: value})
        if decl.get("values"):
            with pytest.raises(OpArgumentError, match=decl["name"]):
                spec.op(*args, **{**kwargs, decl["name"]: "bogus"})


@pytest.mark.parametrize("name", OPS)
def test_circle_builtin_matches_circle_schema(name):
    c = REGISTRY[name].circle
    names = {a.name for a in _arguments(name)}
    assert getattr(circle.BuiltinOperator.BuiltinOperator, c["builtin"]) == c["code"]
    assert hasattr(circle.BuiltinOptions.BuiltinOptions, c["options"]), f"{c['options']} is not a Circle BuiltinOptions table"
    options = getattr(getattr(circle, c["options"]), c["options"] + "T")()
    for field, arg in c["option_fields"].items():
        assert hasattr(options, field), f"{c['options']} has no field {field}"
        assert arg in names
    for arg, enum_name in c.get("option_enums", {}).items():
        enum = getattr(getattr(circle, enum_name), enum_name)
        for value, code in c["option_values"][arg].items():
            assert getattr(enum, value.upper()) == code
    assert set(c["inputs"]) <= {d["name"] for d in REGISTRY[name].contract["inputs"]}


@pytest.mark.parametrize("name", OPS)
def test_tflite_composite_is_well_formed(name):
    t = REGISTRY[name].tflite
    names = {a.name for a in _arguments(name)}
    assert tfl.BuiltinOperator.STABLEHLO_COMPOSITE == 206
    assert all(hasattr(tfl.StableHLOCompositeOptionsT(), f) for f in ("name", "compositeAttributes", "decompositionSubgraphIndex"))
    namespace, _, short = t["composite"].partition(".")
    assert namespace and short, "composite names are <namespace>.<name>"
    assert set(t["attributes"].values()) <= names


@pytest.mark.parametrize("name", OPS)
def test_targets_are_known_profiles(name):
    targets = REGISTRY[name].targets
    assert set(targets) == set(TARGETS) and set(targets.values()) <= set(FUSED_FORMS)


@pytest.mark.parametrize("name", OPS)
def test_by_overload(name):
    spec = REGISTRY[name]
    assert by_overload(spec.overload) is spec and by_overload(spec.op) is spec
    assert by_overload(torch.ops.aten.add.Tensor) is None


def test_ops_table_lists_every_op(capsys):
    assert cli_main(["ops"]) == 0
    out = capsys.readouterr().out
    for name in OPS:
        spec = REGISTRY[name]
        row = next(line for line in out.splitlines() if line.startswith(f"circle::{name} "))
        for text in (spec.circle["builtin"], str(spec.circle["code"]), spec.tflite["composite"], spec.schema, spec.autocast):
            assert text in row, f"`circleops ops` row for {name} lacks {text!r}"
        for target, how in spec.targets.items():
            assert f"{target}: {how}" in row


def test_ops_table_unknown_op_is_an_error(capsys):
    assert cli_main(["ops", "no_such_op"]) == 2
    assert "no_such_op" in capsys.readouterr().err


def test_console_script():
    exe = shutil.which("circleops")
    assert exe, "pip install -e . must install the circleops console script"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.startswith("circleops ")
    table = subprocess.run([exe, "ops", "--format", "json"], capture_output=True, text=True, check=True)
    rows = [r for r in json.loads(table.stdout) if r["provider"] == "circleops"]
    assert [r["op"] for r in rows] == [f"circle::{n}" for n in OPS]
    assert [r["torch schema"] for r in rows] == [REGISTRY[n].schema for n in OPS]
