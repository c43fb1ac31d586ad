"""A new target is one TargetProfile and a new runtime one registry entry plus its module
(circleops.targets.register_target, circleops.runtime.register_runtime): this test adds
both, existing only here, and converts a model, writes generation graphs and generates
with them without any other change (before, --graphs looked the target up in a table of
its own and failed with a KeyError, and verify chose runtimes in four places)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from families import BY_NAME

import circleops
from circleops.errors import TargetError
from circleops.runtime import RUNTIMES, Runtime, choose_runtime, reference, register_runtime, unregister_runtime
from circleops.targets import CIRCLE, PROFILES, register_target, unregister_target
from circleops.pipeline.validate import resolve_runtime

RUNTIME = "traced"
TARGET = "circle-files"
OPENED: list[str] = []  # every file this runtime opened


class Session:
    """The runtime of this test: the reference interpreter, noting each file it opens."""

    def __init__(self, path, signature=None):
        OPENED.append(str(path))
        self._session = reference.Session(path, signature)
        self.path, self.signature = str(path), signature

    @property
    def inputs(self):
        return self._session.inputs

    @property
    def outputs(self):
        return self._session.outputs

    def run(self, inputs):
        return self._session.run(inputs)


def run(path, inputs):
    return Session(path).run(inputs)


@pytest.fixture
def registered():
    OPENED.clear()
    register_runtime(Runtime(RUNTIME, ("circle",), __name__, "the traced interpreter", selects_signatures=False,
                             threads_env=None))
    # a Circle target verified by the new runtime, one file per generation graph (its runtime
    # selects no signature), and no weights after the flatbuffer
    register_target(dataclasses.replace(CIRCLE, name=TARGET, runtime=RUNTIME, one_file_per_graph=True,
                                        weights_after_flatbuffer=False))
    yield
    unregister_target(TARGET)
    unregister_runtime(RUNTIME)


def test_a_target_and_runtime_registered_in_a_test_convert_and_verify(tmp_path, registered):
    assert RUNTIME in RUNTIMES and TARGET in PROFILES
    assert choose_runtime(True, TARGET) == (RUNTIME, None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    path = tmp_path / "m.circle"
    report = circleops.convert(model, (torch.randn(2, 8),), path, target=TARGET, verify=True)
    assert report.target == TARGET and report.verify.runtime == RUNTIME and report.verify.passed
    assert len(OPENED) == 1 and OPENED[0] != str(path)  # the temporary file, verified before it replaced path


def test_a_registered_target_writes_graphs_one_file_each_and_generates(tmp_path, registered):
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs

    model = BY_NAME["llama"].build().eval()
    report = convert_graphs(model, tmp_path / "g", target=TARGET, prefill_len=4, max_cache_len=8, verify=True)
    assert {g: (i.file, i.signature) for g, i in report.graphs.items()} == {
        "prefill": ("prefill.circle", None), "decode": ("decode.circle", None)}
    assert report.verify_runtime == RUNTIME
    assert {p.rsplit("/", 1)[-1] for p in OPENED} == {"prefill.circle", "decode.circle"}
    gen = Generator(tmp_path / "g")
    assert gen.runtime == RUNTIME
    out = gen.generate([1, 2, 3], max_new_tokens=2, stop_at_eos=False)
    assert len(out.tokens) == 2


def test_a_registered_targets_size_rule_holds(tmp_path, registered, monkeypatch):
    from circleops import targets as target_facts

    monkeypatch.setattr(target_facts, "FLATBUFFER_LIMIT", 4096)  # the graph fits, its 16 KB of weights do not
    model = torch.nn.Linear(64, 64)
    with pytest.raises(TargetError, match=f"for target {TARGET}; {RUNTIME} 0.1.0 cannot read weights"):
        circleops.convert(model, (torch.randn(1, 64),), tmp_path / "m.circle", target=TARGET)
    assert not (tmp_path / "m.circle").exists()
    # the same model for target circle (weights after the flatbuffer allowed) is written
    circleops.convert(model, (torch.randn(1, 64),), tmp_path / "c.circle", target="circle")


def test_a_runtime_that_reads_no_circle_is_refused(registered):
    register_runtime(Runtime("tflite-only", ("tflite",), __name__, "a TFLite runtime", True, None))
    try:
        with pytest.raises(TargetError, match="a TFLite runtime runs TFLite files only; target circle-files writes"):
            resolve_runtime("tflite-only", TARGET)
    finally:
        unregister_runtime("tflite-only")
    assert "tflite-only" not in RUNTIMES
