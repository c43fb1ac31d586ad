"""A recipe is one module (CONTRIBUTING.md, "Adding a recipe"): this test declares one that
exists only here, two graphs of a tiny two-stage model with its own manifest, and the package
step writes it for every target as it writes the LLM: the files per target, the comparison
with torch (--verify, one tolerance rule), --quantize, the report, the manifest written last
and the atomic publish."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from circleops.errors import TargetError, VerifyError
from circleops.options import ConvertOptions
from circleops.package import step
from circleops.package.manifest import MANIFEST, manifest_json
from circleops.recipes.base import Graph, Recipe


class TwoStage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)


@dataclass
class EchoManifest:
    """The throwaway recipe's manifest: where its two graphs are."""

    directory: Path
    target: str
    dtype: str
    files: dict[str, str]
    signatures: dict[str, str | None]
    quantize: str | None = None

    def to_json(self) -> dict[str, Any]:
        return manifest_json("text", {"target": self.target, "dtype": self.dtype, "files": self.files,
                                      "signatures": self.signatures, "quantize": self.quantize}, {"echo": {}})

    def write(self) -> Path:
        (self.directory / MANIFEST).write_text(json.dumps(self.to_json()))
        return self.directory / MANIFEST


class EchoRecipe(Recipe):
    kind = "text"
    graph_names = ("first", "second")
    compared = ""
    skew = 0.0  # added to torch's reference: a wrong reference must fail the comparison

    def check(self, opts):
        self.x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))

    def references(self):
        with torch.no_grad():
            h = self.model.first(self.x)
            return {"first": h + self.skew, "second": self.model.second(h)}

    def graphs(self, opts, parts):
        return [Graph("first", self.model.first, (self.x,), ["x"], ["h"]),
                Graph("second", self.model.second, (self.x,), ["h"], ["y"], quantize=False)]

    def manifest(self, directory, opts, plan, infos):
        return EchoManifest(directory, opts.target, "fp32", {g: plan.file(g) for g in self.graph_names},
                            {g: infos[g].signature for g in self.graph_names}, opts.quantize)

    def compare(self, manifest, runtime, references):
        from circleops.runtime import open_session

        out = {}
        for g in self.graph_names:
            session = open_session(runtime, manifest.directory / manifest.files[g], manifest.signatures[g])
            want = references[g].numpy()
            x = self.x.numpy() if g == "first" else references["first"].numpy() - self.skew
            out[g] = (float(np.abs(session.run([x])[0] - want).max()), float(np.abs(want).max()))
        return out

    def describe(self, manifest):
        return {"manifest_line": f"two graphs of {manifest.target}"}


@pytest.mark.parametrize("target, files", [("onert", {"first.circle", "second.circle"}), ("circle", {"model.circle"}),
                                           ("tflite", {"model.tflite"})])
def test_a_recipe_declared_in_a_test_is_written_compared_and_published(tmp_path, target, files):
    out = tmp_path / "out"
    recipe = EchoRecipe(TwoStage(), ConvertOptions(target=target, verify=True), source="two-stage")
    report = step.run(recipe, out)
    assert {p.name for p in out.iterdir()} == files | {MANIFEST}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging directory is published, then gone
    data = json.loads((out / MANIFEST).read_text())
    assert (data["version"], data["kind"], data["target"]) == (4, "text", target)
    assert set(report.graphs) == {"first", "second"} and all(g.max_abs_error < 1e-5 for g in report.graphs.values())
    assert report.graphs["first"].inputs == [("x", [4, 64], "FLOAT32")]
    summary = report.summary()
    assert "two graphs of " + target in summary and f"verify ({report.verify_runtime}" in summary
    assert "next:" not in summary  # describe() gave no generate command


def test_the_comparison_rule_and_quantize_apply_to_any_recipe(tmp_path):
    out = tmp_path / "out"
    step.run(EchoRecipe(TwoStage(), ConvertOptions(target="circle")), out)
    before = (out / "model.circle").read_bytes()
    skewed = EchoRecipe(TwoStage(), ConvertOptions(target="circle", verify=True))
    skewed.skew = 0.5
    with pytest.raises(VerifyError, match=r"the written first graph does not match the model: reference gives max "
                                          r"abs error 0\.5"):
        step.run(skewed, out)
    assert (out / "model.circle").read_bytes() == before  # the earlier output is unchanged
    report = step.run(EchoRecipe(TwoStage(), ConvertOptions(target="circle", quantize="q8_0")), out)
    assert [w.dtype for w in report.quantization.weights] == ["GGML_Q8_0"]  # "second" says quantize=False
    with pytest.raises(TargetError, match="makes an integer graph"):
        step.run(EchoRecipe(TwoStage(), ConvertOptions(target="circle", quantize="uint8")), out)
