"""Target profiles (circleops.targets): lowerings read the profile, never the target's name,
so a new target (or a new onert version) is one new TargetProfile."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from circle_schema import circle

import circleops.lowering
from circleops.errors import TargetError
from circleops.lowering import lower_program
from circleops.ops.rope import MODES as ROPE_MODES
from circleops.targets import BUILTIN, COMPOSITE, ONERT, PROFILES, TARGETS, TargetProfile, profile
from lowering_util import opcodes

LOWERING_DIR = Path(circleops.lowering.__file__).parent
# `target == ...`, `ctx.target != ...`, `target in (...)`, or a comparison with a target's name
NAME_CHECK = re.compile(r"\btarget\s*(==|!=|\bin\s*[(\[{])|(==|!=)\s*[\"'](circle|onert|tflite)[\"']")
BUILTINS = {n for n in vars(circle.BuiltinOperator.BuiltinOperator) if not n.startswith("_")}
DTYPES = {n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}


@pytest.mark.parametrize("path", sorted(LOWERING_DIR.glob("*.py")), ids=lambda p: p.name)
def test_lowerings_ask_the_profile_not_the_target_name(path):
    hits = [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if NAME_CHECK.search(line.split("#")[0])]
    assert not hits, "compare profile fields (ctx.profile.*, ctx.supports) instead:\n" + "\n".join(hits)


def test_every_field_is_stated_by_every_profile():
    missing = [f.name for f in dataclasses.fields(TargetProfile)
               if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert not missing, f"fields with defaults let a new profile omit a fact: {missing}"
    assert TARGETS == tuple(PROFILES) == ("circle", "onert", "tflite")


@pytest.mark.parametrize("name", TARGETS)
def test_profile_is_well_formed(name):
    p = PROFILES[name]
    assert p.name == name and profile(name) is p and profile(p) is p
    assert p.format in ("circle", "tflite") and p.runtime in ("onert", "litert", "reference")
    assert p.fused_ops in (BUILTIN, COMPOSITE)
    assert "float32" in p.float_dtypes and p.float_dtypes <= DTYPES
    opcodes_named = set(p.missing_builtins) | set(p.builtin_dtypes) | set(p.builtin_ranks) | set(p.quantized_float_only)
    assert opcodes_named <= BUILTINS, opcodes_named - BUILTINS
    assert all(dtypes and dtypes <= DTYPES for dtypes in p.builtin_dtypes.values())
    assert all(ranks and all(isinstance(r, int) and r >= 0 for r in ranks) for ranks in p.builtin_ranks.values())
    assert p.rope_modes and p.rope_modes <= set(ROPE_MODES)
    assert p.quantized_dtypes <= {"UINT8", "INT8", "INT16", "INT4"} and (bool(p.quantized_dtypes) == p.integer_graphs)
    assert p.rope_max_positions is None or p.rope_max_positions >= 1
    assert p.quantized_same_params <= BUILTINS
    # a file holding no fused op must quantize the unfused model; uint8 stored as int8 needs INT8
    assert p.integer_fused_ops or p.fused_ops == COMPOSITE or not p.integer_graphs
    assert not p.quantized_uint8_as_int8 or "INT8" in p.quantized_dtypes
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "x"  # type: ignore[misc]


def test_unknown_target_is_a_target_error():
    with pytest.raises(TargetError, match="unknown target 'onnx'.*circle, onert, tflite"):
        profile("onnx")


def test_a_new_profile_is_all_a_new_target_needs():
    """An onert whose FULLY_CONNECTED honours keepNumDims and that has no CONV_2D preference:
    a profile derived from ONERT, passed straight to lower_program."""
    newer = dataclasses.replace(ONERT, name="onert-next", linear_as_conv=None, fc_keep_num_dims=True)
    lin = torch.nn.Linear(8, 16)
    ep = torch.export.export(lin, (torch.randn(1, 5, 8),), strict=False)
    assert opcodes(lower_program(ep, ONERT))["CONV_2D"] == 1
    ops = opcodes(lower_program(ep, newer))
    assert ops == {"FULLY_CONNECTED": 1}, ops
