"""One pipeline (circleops.pipeline.stages, issue 21): convert, save, --graphs and the quantization
report each build their files with ``pipeline.build`` and write them with ``pipeline.write``;
none lowers, quantizes or writes on its own."""
from __future__ import annotations

import pytest
import torch

import circleops
from circleops.pipeline import stages as pipeline
from families import BY_NAME, example_ids


@pytest.fixture
def calls(monkeypatch):
    seen: dict[str, list] = {"build": [], "write": []}
    real_build, real_write = pipeline.build, pipeline.write

    def build(programs, opts, *a, **k):
        seen["build"].append((sorted(programs), opts.target, opts.quantize))
        return real_build(programs, opts, *a, **k)

    def write(ir_model, path, opts, *a, **k):
        seen["write"].append(str(path).rsplit("/", 1)[-1])
        return real_write(ir_model, path, opts, *a, **k)

    monkeypatch.setattr(pipeline, "build", build)
    monkeypatch.setattr(pipeline, "write", write)
    return seen


def test_convert_and_save_run_the_pipeline(tmp_path, calls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()).eval()
    x = (torch.randn(2, 64),)
    circleops.convert(model, x, tmp_path / "a.circle", target="onert", quantize="q8_0")
    circleops.save(torch.export.export(model, x), tmp_path / "b.tflite", target="tflite")
    assert calls["build"] == [(["main"], "onert", "q8_0"), (["main"], "tflite", None)]
    assert calls["write"] == ["a.circle", "b.tflite"]


def test_graphs_run_the_pipeline_once_over_every_graph(tmp_path, calls):
    from circleops.recipes.llm import convert_graphs

    convert_graphs(BY_NAME["llama"].build().eval(), tmp_path / "g", target="onert", prefill_len=4, max_cache_len=8,
                   quantize="q8_0")
    assert calls["build"] == [(["decode", "prefill"], "onert", "q8_0")]  # one set of blocks for both
    assert sorted(calls["write"]) == ["decode.circle", "prefill.circle"]


def test_the_quantization_report_runs_the_pipeline(calls):
    from circleops.tools.quant_report import quant_check

    quant_check(BY_NAME["llama"].build(), None, quantize="q8_0", prompt_ids=example_ids(3)[0].tolist(), new_tokens=2,
                window=32, max_windows=1, runtime="reference")
    assert calls["build"] == [(["main"], "onert", "q8_0")] * 2  # the layers' file, the logits' file
    assert calls["write"] == ["layers_q8_0.circle", "logits_q8_0.circle"]
