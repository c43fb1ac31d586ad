"""int4's measured choice of the MLP down projections kept int8 (circleops.quantize.int4_choice):
each down's 4-bit output noise measured on the SELECTION text (neither the calibration text nor
the scored perplexity text), the cheapest ones written INT4, the rest INT8 and named in the summary."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.quantize import int4, int4_choice, selection
from circleops.quantize.importance import CALIBRATION_TEXT
from circleops.tools.quant_report import PERPLEXITY_TEXT
from families import BY_NAME, example_ids


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


def test_selection_text_is_held_out():
    """The shipped selection text: its header (source, license) dropped, prose left, and no
    sentence of it in the calibration text or the scored text."""
    raw = selection.SELECTION_TEXT.read_text()
    assert "License:" in raw and "Source:" in raw
    text = selection.selection_text()
    assert not text.startswith("#") and "License" not in text and len(text.split()) > 2000
    others = CALIBRATION_TEXT.read_text() + PERPLEXITY_TEXT.read_text()
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if len(s.strip()) > 40]
    assert len(sentences) > 100 and not [s for s in sentences if s in others]


def _expected_costs(model: torch.nn.Module, ids: list[int]) -> dict[str, float]:
    """Each down's ‖x (Ŵ4 − W)ᵀ‖² / ‖layer output‖² over ``ids`` in windows, computed apart from
    the module's hooks: x recomputed from the MLP's input (act(gate) · up), the layer outputs
    from transformers' hidden states (the last one is normed there: left out)."""
    layers = model.model.layers
    noise = {i: 0.0 for i in range(len(layers))}
    energy = dict(noise)
    seen: dict[int, torch.Tensor] = {}
    span = min(int4_choice.WINDOW, model.config.max_position_embeddings)  # windows within the positions
    handles = [layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: seen.__setitem__(i, a[0]))
               for i, layer in enumerate(layers)]
    try:
        for k in range(0, len(ids) - 1, span):
            with torch.no_grad():
                hs = model(input_ids=torch.tensor([ids[k:k + span]]), output_hidden_states=True,
                           use_cache=False).hidden_states
                for i, layer in enumerate(layers):
                    mlp = layer.mlp
                    x = mlp.act_fn(mlp.gate_proj(seen[i])) * mlp.up_proj(seen[i])
                    wd = mlp.down_proj.weight
                    delta = int4.dequantize(int4.quantize(wd, 32, None)) - wd
                    noise[i] += float((x @ delta.T).double().pow(2).sum())
                    energy[i] += float(hs[i + 1].double().pow(2).sum())
    finally:
        for h in handles:
            h.remove()
    return {f"model.layers.{i}.mlp.down_proj.weight": noise[i] / energy[i] for i in range(len(layers) - 1)}


def test_costs_read_the_selection_text(monkeypatch, tmp_path, llama):
    """The costs are measured on the selection text (its first MAX_TOKENS, bytes modulo the
    vocabulary without a tokenizer): equal to a direct computation on those ids, and another
    text in its place gives other costs."""
    vocab = llama.config.vocab_size
    ids = selection.selection_ids(None, vocab)[:int4_choice.MAX_TOKENS]
    costs, tokens = int4_choice.costs(llama, None, None, 32, "int4")
    assert tokens == len(ids) == int4_choice.MAX_TOKENS and len(costs) == llama.config.num_hidden_layers
    expected = _expected_costs(llama, ids)
    for name, value in expected.items():  # float32 products summed in float64: a few ulps of the sum
        assert costs[name] == pytest.approx(value, rel=1e-4), name
    other = tmp_path / "other.txt"
    other.write_text("# header\n\n" + "Zebras graze quietly on the wide plain while the river floods. " * 40)
    monkeypatch.setattr(selection, "SELECTION_TEXT", other)
    moved, _ = int4_choice.costs(llama, None, None, 32, "int4")
    assert all(abs(moved[n] / costs[n] - 1) > 1e-3 for n in costs)
    same, _ = int4_choice.costs(llama, None, None, 32, "int4", ids=selection.selection_ids(None, vocab, other)[:int4_choice.MAX_TOKENS])
    assert same == moved


def test_choice_keeps_the_costliest(llama):
    """Cheapest first to 4 bits while their summed cost stays within the share; share 0 keeps
    every down int8, a share above 1 none."""
    costs, _ = int4_choice.costs(llama, None, None, 32, "int4")
    for share in (0.0, 0.5, 1.01):
        c = int4_choice.choose(llama, None, None, 32, "int4", share=share)
        assert c.costs == costs and set(c.four_bit) | set(c.eight_bit) == set(costs)
        assert sum(costs[n] for n in c.four_bit) <= share * sum(costs.values())
        if c.four_bit and c.eight_bit:
            assert max(costs[n] for n in c.four_bit) <= min(costs[n] for n in c.eight_bit)
        if share == 0.0:
            assert not c.four_bit
        if share > 1:
            assert not c.eight_bit
        # the cheapest one fits at half the summed cost (two downs): exactly one each way
        if share == 0.5:
            assert len(c.four_bit) == 1 == len(c.eight_bit)


def test_no_causal_lm_keeps_every_candidate(llama):
    """A model with no causal-LM head has no text to measure on: every down int8, said why."""
    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.down_proj = torch.nn.Linear(64, 32)

    c = int4_choice.choose(Body(), None, None, 32, "int4")
    assert c.eight_bit == {"mlp.down_proj.weight": c.note} and "not a causal LM" in c.summary_line()


def test_convert_writes_the_chosen_downs_int4(monkeypatch, tmp_path, llama):
    """The file holds the chosen down INT4 (blocks of 32) and the kept one INT8, and the summary
    names the kept one with its cost on the selection text; LiteRT runs it within verify."""
    from circleops.serialize import read_model

    monkeypatch.setattr(int4_choice, "SHARE", 0.5)  # two downs: the cheaper at 4 bits, the other int8
    path = tmp_path / "m.tflite"
    report = circleops.convert(llama, (example_ids(8),), path, target="tflite", quantize="int4", verify=True)
    assert report.verify.passed
    choice = report.quantization.choice
    (four,), (kept,) = choice.four_bit, list(choice.eight_bit)
    m = read_model(str(path))
    # the file names a parameter as the export did (a wrapper may prefix "model.")
    dtypes = {t.name: t.dtype for sg in m.subgraphs for t in sg.tensors if t.name.endswith("down_proj.weight")}
    assert len(dtypes) == 2, dtypes
    assert {d for n, d in dtypes.items() if n.endswith(four)} == {"INT4"}, dtypes
    assert {d for n, d in dtypes.items() if n.endswith(kept)} == {"INT8"}, dtypes
    blocks = {w.name: w.dtype for w in report.quantization.weights if "down_proj" in w.name}
    assert {d for n, d in blocks.items() if n.endswith(four)} == {"INT4"}
    assert choice.written == {n for n in blocks if n.endswith(kept)}
    line = next(s for s in report.quantization.summary_lines() if "MLP down projections" in s)
    short = kept.replace("model.layers.", "L").replace(".mlp.down_proj.weight", ".down")
    assert "1 of 2 MLP down projections at INT4, 1 kept INT8" in line and "selection text" in line
    assert f"{short} {choice.costs[kept]:.1e}" in line
    assert report.quantization.to_dict()["eight_bit_by_choice"] == {kept: choice.eight_bit[kept]}
