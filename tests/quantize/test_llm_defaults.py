"""The integer recipes' defaults for an LLM (circleops.quantize.recipe.resolve_recipe): the
obvious command writes the recipe measured usable, and says what the file scores
(circleops.quantize.llm.score_line), with what to add when it is not usable (issue 31)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import circleops
from circleops.quantize.recipe import METADATA_KEY, RecipeOptions, resolve_recipe
from circleops.serialize import read_model
from families import BY_NAME

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "convert"))
from convert_fixtures import llama_config, llama_model  # noqa: E402,F401


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


@pytest.mark.parametrize("scheme,target,want", [
    ("int16", "circle", dict(weight_bits=8, gptq=False, int8_weights="", group_size=0, int16=())),
    ("int16", "tflite", dict(weight_bits=8, gptq=False, int8_weights="", group_size=0, int16=())),
    ("uint8", "circle", dict(weight_bits=8, gptq=False, int8_weights="", int16=("auto",))),
    ("uint8", "tflite", dict(weight_bits=8, gptq=False, int16=())),  # integer TFLite stays int8 throughout
    ("uint8", "onert", dict(weight_bits=8, gptq=False, int16=())),  # onert 0.1.0 loads no int16 tensor
])
def test_an_llm_left_to_the_defaults_gets_the_measured_recipe(llama, scheme, target, want):
    recipe = resolve_recipe(scheme, target, llama, RecipeOptions())
    assert {k: getattr(recipe, k) for k in want} == want
    if recipe.weight_bits == 4 or recipe.int16:
        assert recipe.defaults.startswith("the measured recipe for an LLM (default)"), recipe.defaults
        assert recipe.defaults in recipe.summary_lines()
    else:
        assert recipe.defaults == ""


@pytest.mark.parametrize("options,want", [
    (RecipeOptions(weight_bits=8), dict(weight_bits=8, gptq=False, int8_weights="")),
    # the 16a4w NPU recipe (bench/results/43-npu-16a4w-default.yaml), and each flag overriding its part
    (RecipeOptions(weight_bits=4), dict(weight_bits=4, gptq=True, int8_weights="auto", group_size=16,
                                        act_order=True, clip_search=True, refine=2)),
    (RecipeOptions(weight_bits=4, act_order=False), dict(gptq=True, act_order=False, clip_search=True, refine=2)),
    (RecipeOptions(weight_bits=4, clip_search=False), dict(gptq=True, act_order=True, clip_search=False)),
    (RecipeOptions(weight_bits=4, refine=0), dict(gptq=True, group_size=16, act_order=True, refine=0)),
    (RecipeOptions(weight_bits=4, refine=3), dict(gptq=True, refine=3)),
    (RecipeOptions(weight_bits=4, group_size=32), dict(group_size=32, gptq=True, int8_weights="auto", refine=2)),
    (RecipeOptions(weight_bits=4, gptq=False), dict(weight_bits=4, gptq=False, int8_weights="auto", group_size=16,
                                                    act_order=False, clip_search=False, refine=0)),
    (RecipeOptions(weight_bits=4, int8_weights="none"), dict(weight_bits=4, gptq=True, int8_weights="")),
    (RecipeOptions(weight_bits=4, group_size=0), dict(weight_bits=4, gptq=True, int8_weights="", group_size=0,
                                                      refine=0)),
])
def test_what_is_given_is_taken_as_given(llama, options, want):
    recipe = resolve_recipe("int16", "circle", llama, options)
    assert {k: getattr(recipe, k) for k in want} == want


@pytest.mark.parametrize("options", [RecipeOptions(act_order=True), RecipeOptions(weight_bits=4, gptq=False,
                                                                                     clip_search=True),
                                     RecipeOptions(weight_bits=4, group_size=0, act_order=True),
                                     RecipeOptions(refine=2), RecipeOptions(weight_bits=4, gptq=False, refine=1)])
def test_act_order_clip_search_and_refine_need_grouped_gptq(llama, options):
    from circleops.errors import TargetError

    with pytest.raises(TargetError, match="GPTQ on grouped 4-bit weights"):
        resolve_recipe("int16", "circle", llama, options)


def test_recipe_options_of_convert_options_carries_every_integer_flag():
    """RecipeOptions.of: the one place convert's, the graphs' and check's options become the
    recipe's; a flag it dropped would silently take the default."""
    import dataclasses

    from circleops.options import ConvertOptions

    given = ConvertOptions(weight_bits=4, gptq=True, rotate="off", weight_group_size=64, int16=(" norms", ""),
                           calibrate=3, int8_weights="none", act_order=False, clip_search=False, gptq_refine=1)
    assert RecipeOptions.of(given) == RecipeOptions(4, True, "off", 64, ("norms",), 3, "none", False, False, 1)
    assert RecipeOptions.of(ConvertOptions()) == RecipeOptions()
    assert len(dataclasses.fields(RecipeOptions)) == 10  # a new recipe option: add it to RecipeOptions.of


def test_other_models_keep_int8_weights_and_uint8_throughout():
    model = torch.nn.Sequential(torch.nn.Linear(32, 8))
    for scheme in ("int16", "uint8"):
        recipe = resolve_recipe(scheme, "circle", model, RecipeOptions())
        assert (recipe.weight_bits, recipe.gptq, recipe.int16, recipe.int8_weights, recipe.defaults) == \
            (8, False, (), "", "")
    assert resolve_recipe("q4_0", "onert", model, RecipeOptions()) is None


def _cli(args, capsys):
    from circleops.cli import main

    code = main(args)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_cli_weight_bits_4_of_an_llm_writes_the_npu_recipe(capsys, tmp_path, llama_config):
    out = tmp_path / "m.circle"
    text = _cli(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8", "--quantize", "int16",
                 "--weight-bits", "4", "--calibrate", "2"], capsys)
    model = read_model(str(out))
    recipe = json.loads(model.metadata[METADATA_KEY])
    assert (recipe["weight_bits"], recipe["gptq"], recipe["int8_weights"], recipe["group_size"]) == (4, True, "auto", 16)
    assert (recipe["act_order"], recipe["clip_search"], recipe["gptq_refine"]) == (True, True, 2)
    assert ("the measured recipe for an LLM (default): groups of 16, GPTQ, --int8-weights auto, act order, clipping "
            "search, 2 refinement passes") in text
    assert "--no-gptq" in text and "--no-act-order" in text and "--no-clip-search" in text and "--gptq-refine 0" in text
    assert "2 passes of coordinate descent" in text  # GPTQ's own summary: the refinement ran
    sg = model.subgraphs[0]
    weights = {t.dtype for t in sg.tensors if t.quant is not None and t.data is not None and len(t.shape) == 2}
    assert "INT4" in weights
    # and what the file scores, measured on a hold-out text
    assert "measured on 8 tokens of a hold-out text" in text
    out8 = tmp_path / "m8.circle"
    _cli(["convert", "--config", str(llama_config), "-o", str(out8), "--seq-len", "8", "--quantize", "int16",
          "--calibrate", "2"], capsys)  # int16 left to its defaults: 8-bit weights
    recipe8 = json.loads(read_model(str(out8)).metadata[METADATA_KEY])
    assert (recipe8["weight_bits"], recipe8["gptq"], recipe8["defaults"]) == (8, False, "")


def test_cli_quantize_uint8_of_an_llm_is_mixed_by_default(capsys, tmp_path, llama_config):
    measured = {}
    for extra in ([], ["--int16", "none"]):
        out = tmp_path / f"m{len(extra)}.circle"
        _cli(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8", "--quantize", "uint8",
              "--calibrate", "2", *extra], capsys)
        recipe = json.loads(read_model(str(out)).metadata[METADATA_KEY])
        assert recipe["int16"] == (["auto"] if not extra else [])
        # the measured mixed precision ran (the tiny model's uint8 tensors may all score well)
        measured[len(extra)] = [s for s in recipe["steps"] if s.startswith("mixed precision by measured sensitivity")]
    assert len(measured[0]) == 1 and measured[2] == []


def test_score_line_says_what_to_add():
    from circleops.quantize.llm import score_line
    from circleops.quantize.recipe import IntegerRecipe

    line, warning = score_line(IntegerRecipe("uint8"), "circle", 16.0, 29, 32)
    assert "logits SQNR 16.0 dB, top-1 agreement 29/32" in line and warning is None
    _, warning = score_line(IntegerRecipe("uint8"), "circle", -0.6, 2, 32)
    assert "scores -0.6 dB and 2/32" in warning and "add --int16 auto" in warning
    _, warning = score_line(IntegerRecipe("uint8"), "onert", -0.6, 2, 32)
    assert "onert loads no int16" in warning and "--target circle" in warning
    _, warning = score_line(IntegerRecipe("int16", weight_bits=4, group_size=32), "circle", 5.5, 17, 32)
    assert "add --gptq --int8-weights auto, or --weight-bits 8" in warning
    _, warning = score_line(IntegerRecipe("int16", weight_bits=4, group_size=32), "circle", 20.0, 27, 32)
    assert warning is not None  # 27 of 32 is below the usable agreement, whatever the SQNR


def test_the_score_is_of_the_file_recipe(llama, tmp_path):
    """The summary's score is the converted module's against fp32 on the hold-out text: equal
    weights score higher than the same file with its weights broken."""
    from circleops.quantize import llm

    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    probe = llm.probe(llama, (ids,))
    assert probe.ids.shape == (1, 8) and probe.ids.tolist()[0] == [b % 256 for b in llm.HOLDOUT_TEXT.read_bytes()[:8]]
    db, agree, n = llm.score(probe, lambda x: llama(x).logits)
    assert db == float("inf") and agree == n == 8
    db, agree, _ = llm.score(probe, lambda x: llama(x).logits + torch.randn(1, 8, 256))
    assert db < 30
    report = circleops.convert(llama, (ids,), tmp_path / "m.circle", quantize="int16", weight_bits=8, calibrate=2)
    line = next(s for s in report.quantization.summary_lines() if s.startswith("measured on 8 tokens"))
    assert "logits SQNR" in line


def test_cli_flags_override_the_llm_default(llama):
    """convert's flags reach the recipe (parsed only: no model): each overrides its part of the
    16a4w default and leaves the others to it."""
    import argparse

    from circleops.cli.options import add_options, options_of

    parser = argparse.ArgumentParser()
    add_options(parser)
    args = parser.parse_args(["--quantize", "int16", "--weight-bits", "4", "--gptq-refine", "0",
                              "--weight-group-size", "32", "--no-act-order"])
    options = RecipeOptions.of(options_of(args))
    assert (options.refine, options.group_size, options.act_order, options.clip_search) == (0, 32, False, None)
    recipe = resolve_recipe("int16", "circle", llama, options)
    assert (recipe.refine, recipe.group_size, recipe.act_order, recipe.clip_search, recipe.int8_weights) == \
        (0, 32, False, True, "auto")
