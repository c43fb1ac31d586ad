"""The numerics report on tiny random Llamas: what it measures (per-layer error, greedy
agreement, the overflow of the native norm), that its agreement is free-running greedy
agreement, and the command: table, --json, --plot, --keep, user errors."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from circleops.tools.precision import check, greedy
from circleops.cli import main
from circleops.errors import CircleOpsError
from circleops.runtime.reference import Interpreter

POLICIES = ["fused", "fp32-island", "scaled", "native"]


def test_report_shape(loud_report, loud_llama):
    r = loud_report
    assert r.new_tokens == 6  # NEW_TOKENS of tests/check/conftest.py
    assert [p.name for p in r.policies] == POLICIES
    assert r.num_layers == loud_llama.config.num_hidden_layers
    assert len(r.reference_tokens) == r.new_tokens and r.prompt is None and len(r.prompt_ids) == 5
    assert r.reference_tokens == greedy(loud_llama, r.prompt_ids, r.new_tokens)
    for p in r.policies:
        assert len(p.layer_max_abs) == len(p.layer_rel) == len(p.layer_nonfinite) == r.num_layers
        assert len(p.predicted) == r.new_tokens
        assert p.generated[:p.agreement] == r.reference_tokens[:p.agreement]
        if p.first_divergence is None:
            assert p.agreement == r.new_tokens and p.generated == r.reference_tokens
        else:
            assert p.generated[-1] != r.reference_tokens[p.first_divergence]
        assert set(p.seconds) == {"lower", "write", "run"}


def test_native_norm_overflows_where_the_others_do_not(loud_report):
    """Norm inputs with RMS ~500 (fp16 x² overflows past 256): the upcast and scaled norms
    keep fp32's greedy tokens and small logits error; the native norm does neither."""
    r = loud_report
    assert max(r.layer_rms) > 256
    for name in ("fused", "fp32-island", "scaled"):
        p = r.result(name)
        assert p.agreement == r.new_tokens, name
        assert p.nonfinite == 0
        assert p.logits_max_abs < 5e-3, name  # the tiny model's logits are below 1
        # fp16 rounding of a residual stream of max |x| ~1500: a few ulps (ulp = 1 there)
        assert all(e <= 4 * 2.0 ** math.floor(math.log2(m)) * 2 ** -10 for e, m in zip(p.layer_max_abs, r.layer_max))
    fused, native = r.result("fused"), r.result("native")
    assert fused.layer_max_abs == r.result("fp32-island").layer_max_abs  # same computation, two writings
    assert native.agreement < r.new_tokens and native.first_divergence == native.agreement
    assert native.logits_max_abs > 50 * fused.logits_max_abs


def test_agreement_is_free_running_agreement(loud_report, tiny_llama, tmp_path):
    """The teacher-forced premise: a written file's outputs at a position do not depend on
    later tokens, so one run over fp32's text gives the free-running greedy tokens."""
    for p in loud_report.policies:
        interp = Interpreter.load(p.path)
        seq = torch.tensor([loud_report.prompt_ids + loud_report.reference_tokens[:-1]])
        cut = len(loud_report.prompt_ids) + 1
        other = seq.clone()
        other[0, cut:] = (other[0, cut:] + 7) % 256
        a, b = interp.run_torch([seq]), interp.run_torch([other])
        for x, y in zip(a, b):
            assert torch.equal(x[:, :cut], y[:, :cut]), p.name
        assert not torch.equal(a[-1][:, cut:], b[-1][:, cut:])  # the later tokens did change the run


def test_small_model_every_policy_agrees(tiny_llama):
    """Norm inputs with RMS < 1: nothing overflows, every policy keeps fp32's tokens (a prompt
    whose 4 greedy tokens lead by >= 0.36 in the logits: bf16 moves them by less)."""
    r = check(tiny_llama, None, prompt_ids=[100, 50, 25], new_tokens=4, dtype="bf16", policies=["fused", "native"])
    assert r.dtype == "bf16" and r.prompt_ids == [100, 50, 25]
    assert [p.agreement for p in r.policies] == [4, 4]
    assert all(p.nonfinite == 0 for p in r.policies)


def test_table_lists_layers_policies_and_divergence(loud_report):
    text = loud_report.table()
    for name in POLICIES:
        assert name in text
    n = loud_report.new_tokens
    assert f"{n}/{n} (all agree)" in text
    assert "diverges at token" in text
    assert "RMS_NORM" in text  # the fused file's norm op
    rows = [ln for ln in text.splitlines() if ln.strip().split(" ")[0].isdigit()]
    assert len(rows) == loud_report.num_layers


# --------------------------------------------------------------------------- command

@pytest.fixture(scope="module")
def config_json(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    tiny_llama.config.to_json_file(str(path))
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_command_writes_table_json_plot_and_files(config_json, tmp_path, capsys):
    js, png, keep = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "files"
    code, out, err = run(capsys, "--config", str(config_json), "--dtype", "fp16", "-n", "4", "--threads", "1",
                         "--json", str(js), "--plot", str(png), "--keep", str(keep))
    assert code == 0, err
    assert "max |error| of each decoder layer" in out and "greedy generation, 4 tokens" in out
    assert "circleops check: fused: convert, run" in err  # progress on stderr
    data = json.loads(js.read_text())
    assert data["dtype"] == "fp16" and data["new_tokens"] == 4 and data["source"].startswith(str(config_json))
    assert [p["name"] for p in data["policies"]] == POLICIES
    assert list(data["timings"])[:3] == ["load", "reference", "export"]
    for p in data["policies"]:
        assert len(p["layer_max_abs"]) == 2 and all(isinstance(e, float) for e in p["layer_max_abs"])
        assert 0 <= p["agreement"] <= 4
        assert (keep / f"{p['name']}.circle").stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > 400 and height > 200


def test_command_quiet_and_policy_subset(config_json, tmp_path, capsys):
    js = tmp_path / "r.json"
    code, out, err = run(capsys, "--config", str(config_json), "-n", "2", "--policies", "native,fused", "-q",
                         "--prompt-ids", "3,4,5", "--json", str(js))
    assert code == 0, err
    assert out == "" and err == ""
    data = json.loads(js.read_text())
    assert [p["name"] for p in data["policies"]] == ["native", "fused"] and data["prompt_ids"] == [3, 4, 5]


@pytest.mark.parametrize("args, message", [
    ([], "no model given"),
    (["--policies", "fused,fp8"], "unknown norm policy 'fp8'"),
    (["-n", "0"], "--new-tokens must be at least 1"),
    (["-n", "500"], "positions, but the model takes at most 128"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    (["--prompt-ids", "1,999"], "out of range for the model's vocabulary of 256"),
    (["--json", "/nonexistent/dir/r.json"], "cannot write --json"),
    (["--threads", "0"], "--threads=0: give a thread count from 1"),
])
def test_user_errors(config_json, capsys, args, message):
    model = [] if args == [] else ["--config", str(config_json)]
    code, out, err = run(capsys, *model, *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_plot_without_matplotlib_is_a_clear_error(config_json, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = run(capsys, "--config", str(config_json), "--plot", str(tmp_path / "p.png"))
    assert code == 2
    assert "--plot needs matplotlib" in err and "pip install" in err
    assert not (tmp_path / "p.png").exists()


def test_dtype_must_be_reduced_precision(tiny_llama):
    with pytest.raises(CircleOpsError, match="use --dtype fp16 or --dtype bf16"):
        check(tiny_llama, None, dtype="fp32")


@pytest.mark.parametrize("suffix", [".circle", ".tflite"])
def test_converted_file_is_refused_with_what_check_takes(tmp_path, capsys, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"\0" * 64)
    code, out, err = run(capsys, str(path))
    assert code == 2 and "Traceback" not in err
    assert f"is a converted {suffix[1:]} file" in err and "an HF directory" in err
    assert f"circleops inspect {path}" in err
