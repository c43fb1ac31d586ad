"""`circleops run`: inputs from .npy, outputs to a directory, runtimes and --compare."""
from __future__ import annotations

import numpy as np
import pytest

from circleops.cli import main
from circleops.serialize import write_model
from refbuild import Const, Feed, one_op


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    x = np.random.default_rng(0).standard_normal((1, 2, 8)).astype(np.float32) * 5
    gamma = np.linspace(0.5, 1.5, 8).astype(np.float32)
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * gamma
    model, _ = one_op("RMS_NORM", [Feed(x), Const(gamma)], [want], {"epsilon": 1e-5})
    write_model(model, d / "norm.circle", "circle")
    fc, _ = one_op("FULLY_CONNECTED", [Feed(x[0]), Const(np.eye(8, dtype=np.float32))], [x[0]])
    write_model(fc, d / "fc.tflite", "tflite")
    np.save(d / "x.npy", x)
    np.save(d / "x0.npy", x[0])
    return d, x, want


def test_run_writes_outputs_and_compares_with_onert(files, capsys):
    d, x, want = files
    rc = main(["run", str(d / "norm.circle"), "--input", str(d / "x.npy"), "--output-dir", str(d / "out"),
               "--compare", "onert"])
    assert rc == 0
    got = np.load(d / "out" / "output_0.npy")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    text = capsys.readouterr().out
    assert "1 outputs from reference" in text and "float32 [1, 2, 8]" in text
    diff = float(text.split("max abs diff vs onert: ")[1].split()[0])
    assert diff < 1e-5


def test_run_tflite_on_litert(files, capsys):
    d, x, _ = files
    assert main(["run", str(d / "fc.tflite"), "-i", str(d / "x0.npy"), "--runtime", "litert",
                 "--compare", "reference"]) == 0
    text = capsys.readouterr().out
    assert "outputs from litert" in text and float(text.split("max abs diff vs reference: ")[1].split()[0]) < 1e-5


@pytest.mark.parametrize("argv,match", [
    (["--input", "missing.npy"], "input file 'missing.npy' does not exist"),
    ([], r"takes 1 input\(s\) \(in0 float32\[1, 2, 8\]\), 0 given"),
])
def test_run_errors_exit_2_with_one_message(files, capsys, argv, match, monkeypatch):
    d, _, _ = files
    monkeypatch.chdir(d)
    assert main(["run", "norm.circle", *argv]) == 2
    import re
    assert re.search(match, capsys.readouterr().err)
