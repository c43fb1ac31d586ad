"""circleops.convert / circleops.save: the written file runs and matches torch, the Report
says what was written, and every failure leaves no file behind."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import circleops
from circleops.errors import ExportError, OutputError, TargetError, UnsupportedOpError, VerifyError
from circleops.serialize import read_model
from families import BY_NAME, example_ids

SEQ = 8
LLAMA = BY_NAME["llama"]
N_NORMS = 2 * LLAMA.config().num_hidden_layers + 1  # two per layer + the final norm
SUFFIX = {"circle": "circle", "onert": "circle", "tflite": "tflite"}
RUNTIME = {"circle": "reference", "onert": "onert", "tflite": "litert"}


@pytest.fixture(scope="module")
def llama():
    return LLAMA.build()


@pytest.fixture(scope="module", params=["circle", "onert", "tflite"])
def converted(request, llama, tmp_path_factory):
    target = request.param
    path = tmp_path_factory.mktemp(target) / f"llama.{SUFFIX[target]}"
    report = circleops.convert(llama, (example_ids(SEQ),), path, target=target, verify=True)
    return target, path, report


def test_report_describes_the_written_file(converted):
    target, path, report = converted
    assert report.path == str(path) and report.target == target and report.dtype == "fp32"
    assert report.format == SUFFIX[target]
    assert report.file_size == path.stat().st_size > 0
    written = read_model(str(path))
    ops = [op.opcode for op in written.subgraphs[0].operators]
    assert sum(report.ops.values()) == len(ops)
    product = "CONV_2D" if target == "onert" else "FULLY_CONNECTED"  # onert's faster matrix product
    assert report.ops.get(product, 0) == ops.count(product) > 0
    assert report.inputs == [("input_ids", [1, SEQ], "INT64")]
    assert [(n, s, t) for n, s, t in report.outputs] == [("logits", [1, SEQ, LLAMA.config().vocab_size], "FLOAT32")]
    assert {"export", "lower", "write", "verify"} <= set(report.timings)
    assert all(t >= 0 for t in report.timings.values())


def test_written_file_matches_torch_on_the_targets_runtime(converted):
    target, _, report = converted
    v = report.verify
    assert v.runtime == RUNTIME[target] and v.passed
    assert v.max_abs_error < 1e-4 and v.reference_max_abs > 0.1


def test_norms_stay_fused(converted):
    target, _, report = converted
    assert report.fused.get("rms_norm") == N_NORMS
    if target in ("circle", "onert"):  # RMS_NORM is a builtin that onert runs
        assert report.ops.get("RMS_NORM") == N_NORMS
    else:
        assert report.ops.get("STABLEHLO_COMPOSITE(odml.rms_norm)") == N_NORMS


def test_report_json_round_trips(converted, tmp_path):
    _, _, report = converted
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data == json.loads((tmp_path / "r.json").read_text())
    assert data["verify"]["passed"] is True and data["ops"] == report.ops and data["fused"] == report.fused
    text = report.summary()
    assert "verify:" in text and report.verify.runtime in text and "rms_norm x" in text


@pytest.mark.parametrize("fuse", ["none", "adapters", "patterns", "auto"])
def test_fuse_modes(fuse, llama, tmp_path):
    report = circleops.convert(llama, (example_ids(SEQ),), tmp_path / "m.circle", fuse=fuse, verify=True)
    assert report.verify.passed and report.fuse == fuse
    if fuse == "none":
        assert report.fused == {} and "RMS_NORM" not in report.ops
    else:
        assert report.fused.get("rms_norm") == N_NORMS and report.ops.get("RMS_NORM") == N_NORMS
    if fuse in ("patterns", "auto"):
        assert report.fusion is not None


def test_fp16_circle_is_verified_in_fp16(tmp_path):
    model = LLAMA.build()
    report = circleops.convert(model, (example_ids(SEQ),), tmp_path / "m.circle", dtype="fp16", verify=True)
    assert report.dtype == "fp16" and report.verify.passed
    assert next(model.parameters()).dtype == torch.float16  # cast in place, as documented
    written = read_model(str(tmp_path / "m.circle"))
    weights = [t for t in written.subgraphs[0].tensors if t.is_const and t.dtype.startswith("FLOAT")]
    assert weights and {t.dtype for t in weights if len(t.shape) == 2} == {"FLOAT16"}


def test_fp16_for_onert_is_refused_before_any_work(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: pytest.fail("exported"))
    with pytest.raises(TargetError, match=r"target onert is fp32 only.*--target circle"):
        circleops.convert(llama, (example_ids(SEQ),), tmp_path / "m.circle", target="onert", dtype="fp16")
    assert not (tmp_path / "m.circle").exists()
    assert next(llama.parameters()).dtype == torch.float32


ONERT_TOO_LARGE = (r"the model needs (\d+) bytes \(> 2 GiB\) for target onert; onert 0\.1\.0 cannot read weights "
                   r"stored after the flatbuffer \(it crashes\), and a flatbuffer holds at most 2 GiB\. Use --target "
                   r"circle for NPU compilers, or --target tflite for LiteRT, which reads that layout; or .*--dtype fp16")


def test_onert_refuses_a_model_past_2_gib_before_writing(llama, tmp_path, monkeypatch):
    """Past 2 GiB the weights go after the flatbuffer, a layout onert 0.1.0 crashes on: target
    onert refuses, from the IR's constant bytes, before the writer runs; target circle writes
    that layout. A lowered limit stands for 2 GiB (writing 2 GiB would take minutes)."""
    import re

    from circleops import targets
    from circleops.serialize import writer

    fits = tmp_path / "fits.circle"
    circleops.convert(llama, (example_ids(SEQ),), fits, target="onert")
    limit = fits.stat().st_size // 2
    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", limit)
    real_write = writer.write_model
    monkeypatch.setattr(writer, "write_model", lambda *a, **k: pytest.fail("the writer ran"))
    out = tmp_path / "m.circle"
    with pytest.raises(TargetError, match=ONERT_TOO_LARGE) as err:
        circleops.convert(llama, (example_ids(SEQ),), out, target="onert")
    needed = int(re.match(ONERT_TOO_LARGE, str(err.value)).group(1))
    assert limit < needed <= fits.stat().st_size  # the weights' bytes, not a made-up figure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fits.circle"]  # no file, no temp file

    monkeypatch.setattr(writer, "write_model", real_write)
    big = tmp_path / "big.circle"
    report = circleops.convert(llama, (example_ids(SEQ),), big, target="circle", verify=True)
    assert report.verify.passed  # the reference interpreter reads the offset layout
    from circle_schema import circle

    raw = circle.Model.Model.GetRootAs(big.read_bytes(), 0)
    placed = [raw.Buffers(i) for i in range(raw.BuffersLength())]
    assert any(b.Offset() > 1 and b.Size() > 0 for b in placed)  # weights after the flatbuffer
    assert not any(b.DataLength() for b in placed)


def test_same_model_twice_gives_identical_bytes(llama, tmp_path):
    for name in ("a", "b"):
        circleops.convert(llama, (example_ids(SEQ),), tmp_path / f"{name}.circle", target="onert")
    assert (tmp_path / "a.circle").read_bytes() == (tmp_path / "b.circle").read_bytes()


def test_hf_settings_are_restored(tmp_path):
    model = LLAMA.build()
    model.config.use_cache = True
    model.config._attn_implementation = "sdpa"
    circleops.convert(model, (example_ids(SEQ),), tmp_path / "m.circle", fuse="none")
    assert model.config.use_cache is True and model.config._attn_implementation == "sdpa"


def test_save_an_exported_program(llama, tmp_path):
    from circleops.pipeline.convert import CausalLMLogits

    with torch.no_grad():
        ep = torch.export.export(CausalLMLogits(llama), (example_ids(SEQ),))
    report = circleops.save(ep, tmp_path / "m.circle", target="onert", verify=True)
    assert report.verify.passed and report.verify.runtime == "onert"
    assert report.fused.get("rms_norm") == N_NORMS  # found by the pattern pass
    with pytest.raises(TargetError, match="dtype is fixed"):
        circleops.save(ep, tmp_path / "h.circle", dtype="fp16")
    assert not (tmp_path / "h.circle").exists()


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a branch on a value: torch.export cannot trace it
            return x * 2
        return x


class Inverse(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.inv(x) + 1


def test_export_failure_is_a_short_export_error(tmp_path, capfd):
    with pytest.raises(ExportError) as info:
        circleops.convert(DataDependent(), (torch.randn(2, 3),), tmp_path / "m.circle")
    msg = str(info.value)
    assert msg.startswith("torch.export failed on DataDependent:") and "\n" not in msg and len(msg) < 900
    assert "data-dependent" in msg and "test_convert_api.py" in msg  # why, and where in the user's code
    assert "def forward" not in capfd.readouterr().err  # torch's partial-graph dump is held back
    assert not (tmp_path / "m.circle").exists()


def test_unsupported_op_names_op_node_and_source_line(tmp_path):
    with pytest.raises(UnsupportedOpError) as info:
        circleops.convert(Inverse(), (torch.randn(1, 3, 3),), tmp_path / "m.circle")
    msg = str(info.value)
    assert "linalg_inv" in msg and "test_convert_api.py" in msg and "torch.linalg.inv(x)" in msg
    assert not (tmp_path / "m.circle").exists()


@pytest.mark.parametrize("case", ["missing_dir", "is_dir", "wrong_suffix"])
def test_unwritable_output_is_refused_before_export(case, llama, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: pytest.fail("exported"))
    path = {"missing_dir": tmp_path / "no" / "m.circle", "is_dir": tmp_path,
            "wrong_suffix": tmp_path / "m.tflite"}[case]
    with pytest.raises(OutputError, match=str(path.name)):
        circleops.convert(llama, (example_ids(SEQ),), path, target="circle")


def test_verify_mismatch_removes_the_file(llama, tmp_path, monkeypatch):
    from circleops.runtime import reference

    class Off(reference.Session):  # what verify runs, 0.5 off
        def run(self, inputs):
            return [o + np.float32(0.5) for o in super().run(inputs)]

    monkeypatch.setattr(reference, "Session", Off)
    with pytest.raises(VerifyError, match=r"max abs error 0\.5.*nothing was written to"):
        circleops.convert(llama, (example_ids(SEQ),), tmp_path / "m.circle", verify=True)
    assert not (tmp_path / "m.circle").exists()


@pytest.mark.parametrize("kwargs, match", [
    ({"target": "npu"}, "unknown target"),
    ({"fuse": "all"}, "unknown fuse mode"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"verify": "onert", "target": "tflite"}, "onert runs Circle files"),
])
def test_bad_options(kwargs, match, llama, tmp_path):
    path = tmp_path / f"m.{SUFFIX.get(kwargs.get('target'), 'circle')}"
    with pytest.raises(TargetError, match=match):
        circleops.convert(llama, (example_ids(SEQ),), path, **kwargs)


def test_a_plain_module_converts_without_importing_transformers(tmp_path):
    """Lazy imports: transformers (seconds of import) only loads for an HF model."""
    import subprocess
    import sys

    code = (
        "import sys, torch, circleops\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x): return torch.nn.functional.silu(x) * 2\n"
        f"r = circleops.convert(M(), (torch.randn(2, 8),), {str(tmp_path / 'm.circle')!r}, verify=True)\n"
        "assert r.verify.passed\n"
        "print(sorted(m for m in ('transformers', 'scipy', 'onert', 'ai_edge_litert') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
