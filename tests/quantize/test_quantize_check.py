"""check --quantize: per-layer error, greedy agreement and perplexity of a GGML-quantized
file against fp32; inspect shows each tensor's storage type and bytes."""
from __future__ import annotations

import json

import pytest

import circleops
from circleops.tools.inspect import format_text, summarize
from circleops.tools.quant_report import PERPLEXITY_TEXT, quant_check, text_ids
from families import BY_NAME, example_ids
from onert_host import GGML_RUNTIME, ONERT_RUNS_GGML


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


def test_quant_check_q8_0_costs_little_and_q4_0_more(llama):
    q8 = quant_check(llama, None, quantize="q8_0", prompt_ids=[5, 17, 42], new_tokens=6, window=64, max_windows=2)
    q4 = quant_check(llama, None, quantize="q4_0", prompt_ids=[5, 17, 42], new_tokens=6, window=64, max_windows=2)
    for r in (q8, q4):
        assert len(r.layer_max_abs) == 2 and r.perplexity_tokens == 2 * 63
        assert r.perplexity_fp32 == q8.perplexity_fp32  # the same torch reference
        assert 0 <= r.agreement <= 6
        # onert, or where it cannot run GGML here the interpreter, and the table says why
        assert r.runtime == GGML_RUNTIME and (r.note is None) == ONERT_RUNS_GGML
    assert abs(q8.perplexity_ratio - 1) < 0.01
    assert max(q4.layer_rel) > 3 * max(q8.layer_rel)  # 4 bits cost more than 8
    table = q4.table()
    assert "greedy tokens equal to fp32's" in table and "q4_0" in table and "GGML_Q4_0" in table


def test_perplexity_text_is_long_enough():
    assert len(text_ids(None, 256)) > 2000 * 4  # ~2.4k SmolLM2 tokens (tests/quantize slow test)
    assert PERPLEXITY_TEXT.read_text().startswith("The Keeper of the North Light")


def test_cli_check_quantize(tmp_path, capsys):
    from circleops.cli import main  # in-process: a subprocess pays torch's imports again

    cfg = tmp_path / "config.json"
    c = BY_NAME["llama"].config().to_dict()
    c["architectures"] = ["LlamaForCausalLM"]
    cfg.write_text(json.dumps(c))
    out = tmp_path / "r.json"
    code = main(["check", "--config", str(cfg), "--quantize", "q4_0", "--prompt-ids", "5,17,42", "-n", "4",
                 "--window", "32", "--max-windows", "1", "--json", str(out), "-q"])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["format"] == "q4_0" and data["perplexity_tokens"] == 31 and len(data["layer_max_abs"]) == 2
    assert data["runtime"] == GGML_RUNTIME


def test_inspect_lists_storage_type_and_bytes(tmp_path, llama):
    path = tmp_path / "m.circle"
    circleops.convert(llama, (example_ids(8),), path, target="onert", quantize="q4_0")
    s = summarize(path)
    ggml = [t for t in s["constants"] if t["dtype"] == "GGML_Q4_0"]
    # 2 layers x (q/k/v fused, o, gate/up fused, down) + the embedding (passes.fuse_linears)
    assert len(ggml) == 9 and all(t["bytes"] == t["shape"][0] * t["shape"][1] // 32 * 18 for t in ggml)
    assert s["constants_by_dtype"]["GGML_Q4_0"]["bytes"] == sum(t["bytes"] for t in ggml)
    (head,) = [t for t in s["constants"] if t["dtype"] == "GGML_Q8_0"]  # q4_0 keeps the lm_head at Q8_0
    assert head["name"].endswith("lm_head.weight") and head["bytes"] == head["shape"][0] * head["shape"][1] // 32 * 34
    text = format_text(s, tensors=True)
    assert "model.model.layers.0.mlp.{gate,up}_proj.weight" in text and "4.5 bits/weight" in text
    assert "model.model.layers.0.mlp.down_proj.weight" in text


# ------------------------------------------------------------------ integer formats and their recipe
def test_quant_check_int16_rotated_compares_layers_in_fp32s_basis(llama):
    """The rotated model's residual stream is h · Q: the report compares h (else every layer
    would score about -3 dB) and scores the logits over the predicting positions."""
    from circleops.quantize.recipe import IntegerRecipe

    r = quant_check(llama, None, quantize="int16", prompt_ids=[5, 17, 42], new_tokens=6, window=32, max_windows=1,
                    recipe=IntegerRecipe("int16", calibrate=2))
    assert r.runtime == "reference" and r.recipe["rotate"] == "auto" and r.recipe["weights"] == "int8"
    assert any(line.startswith("Hadamard rotation folded") for line in r.quantization)
    assert min(r.layer_sqnr_db) > 15 and r.logits_sqnr_db > 15, (r.layer_sqnr_db, r.logits_sqnr_db)


def test_cli_check_int16_int4_grouped_gptq_against_fp32_and_tico(tmp_path, capsys):
    from circleops.cli import main

    cfg = tmp_path / "config.json"
    c = BY_NAME["llama"].config().to_dict()
    c["architectures"] = ["LlamaForCausalLM"]
    cfg.write_text(json.dumps(c))
    out = tmp_path / "r.json"
    code = main(["check", "--config", str(cfg), "--quantize", "int16", "--weight-bits", "4", "--gptq",
                 "--weight-group-size", "32", "--calibrate", "2", "--tico", "--prompt-ids", "5,17,42", "-n", "4",
                 "--window", "32", "--max-windows", "1", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    assert data["runtime"] == "reference"  # onert loads no int16 / int4 graph
    assert data["recipe"]["group_size"] == 32 and data["recipe"]["gptq"] and data["recipe"]["weight_bits"] == 4
    assert any("in groups of 32" in line for line in data["quantization"])
    assert isinstance(data["logits_sqnr_db"], float) and len(data["layer_sqnr_db"]) == 2
    tico = data["tico"]
    assert "error" not in tico, tico
    assert tico["calibrate"] == 2 and 0 <= tico["agreement"] <= 4 and tico["perplexity"] > 1
    assert "TICO 0.3.0 PTQ" in captured.out and "SQNR" in captured.out


def test_cli_check_refuses_recipe_options_outside_integer_formats(tmp_path, capsys):
    from circleops.cli import main

    code = main(["check", "--config", str(tmp_path / "none.json"), "--quantize", "q4_0", "--tico"])
    assert code != 0 and "apply to --quantize uint8 or int16" in capsys.readouterr().err
