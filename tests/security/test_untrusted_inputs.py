"""Files from outside are untrusted: loading one must never run code from it.

Each evil file here carries a pickle whose unpickling creates a marker file. The first test
shows the payload really runs when torch.export.load is called on the archive directly,
so the later assertions (marker never created, clear ModelLoadError) can fail.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from circleops.sources import models
from circleops.errors import ModelLoadError
from circleops.inputs.safe_load import check_pt2_archive

REPO = Path(__file__).resolve().parents[2]


class _Payload:
    """Unpickling this creates ``marker`` (exec of a one-liner: no shell)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _plain_pt2(path: Path) -> Path:
    ep = torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.randn(2, 4),))
    torch.export.save(ep, str(path))
    return path


def _rewrite(src: Path, dst: Path, change) -> Path:
    """Copy the zip ``src`` to ``dst``, passing each (relative name, bytes) through ``change``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            root, rel = info.filename.split("/", 1)
            for name, data in change(rel, zin.read(info)):
                zout.writestr(f"{root}/{name}", data)
    return dst


def _evil_weight(tmp: Path, marker: Path) -> Path:
    def change(rel, data):
        if rel == "data/weights/model_weights_config.json":
            cfg = json.loads(data)
            cfg["config"]["0.weight"]["use_pickle"] = True
            data = json.dumps(cfg).encode()
        elif rel == "data/weights/weight_0":
            data = pickle.dumps(_Payload(marker))
        yield rel, data
    return _rewrite(_plain_pt2(tmp / "plain.pt2"), tmp / "evil.pt2", change)


def _evil_sample_inputs(tmp: Path, marker: Path) -> Path:
    # torch's loader tries weights_only=True on the example inputs, then falls back to
    # weights_only=False: the fallback runs this payload.
    def change(rel, data):
        if rel.startswith("data/sample_inputs/"):
            data = pickle.dumps(_Payload(marker))
        yield rel, data
    return _rewrite(_plain_pt2(tmp / "plain.pt2"), tmp / "evil.pt2", change)


def _evil_opaque_constant(tmp: Path, marker: Path) -> Path:
    def change(rel, data):
        if rel == "data/constants/model_constants_config.json":
            data = json.dumps({"config": {"c": {"path_name": "opaque_obj_0", "is_param": False,
                                                "use_pickle": False, "tensor_meta": None}}}).encode()
            yield "data/constants/opaque_obj_0", pickle.dumps(_Payload(marker))
        yield rel, data
    return _rewrite(_plain_pt2(tmp / "plain.pt2"), tmp / "evil.pt2", change)


def _legacy_weights(tmp: Path, marker: Path) -> Path:
    def change(rel, data):
        if rel == "data/weights/model_weights_config.json":
            yield "data/weights/model.pt", pickle.dumps(_Payload(marker))
            return
        yield rel, data
    return _rewrite(_plain_pt2(tmp / "plain.pt2"), tmp / "evil.pt2", change)


EVIL = {"use_pickle weight": _evil_weight, "sample inputs": _evil_sample_inputs,
        "opaque constant": _evil_opaque_constant, "legacy weights": _legacy_weights}


def test_the_evil_pt2_really_runs_code_in_plain_torch_export_load(tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_weight(tmp_path, marker)
    with pytest.raises(Exception):
        torch.export.load(str(evil))
    assert marker.exists(), "the payload did not run: the tests below would prove nothing"


@pytest.mark.parametrize("kind", EVIL)
def test_evil_pt2_is_refused_before_any_unpickling(kind, tmp_path):
    marker = tmp_path / "pwned"
    evil = EVIL[kind](tmp_path, marker)
    with pytest.raises(ModelLoadError, match="refusing to load") as err:
        models.load(str(evil))
    assert "pickle" in str(err.value) and str(evil) in str(err.value)
    assert not marker.exists()


def test_plain_pt2_still_loads(tmp_path):
    path = _plain_pt2(tmp_path / "plain.pt2")
    check_pt2_archive(path)
    loaded = models.load(str(path))
    assert loaded.kind == "exported"
    x = torch.randn(2, 4)
    assert loaded.exported.module()(x).shape == (2, 4)


def test_even_without_the_check_every_torch_load_is_weights_only(tmp_path, monkeypatch):
    # Defence in depth: with the archive check disabled, the load still unpickles nothing
    # but tensors (torch's weights_only=False fallback is forced to weights_only=True).
    import circleops.inputs.safe_load as safe_load

    monkeypatch.setattr(safe_load, "check_pt2_archive", lambda path: None)
    marker = tmp_path / "pwned"
    evil = _evil_sample_inputs(tmp_path, marker)
    with pytest.raises(ModelLoadError):
        models.load(str(evil))
    assert not marker.exists()


def test_not_a_zip_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"\x80\x04not a zip at all")
    with pytest.raises(ModelLoadError, match="not a .pt2 archive"):
        models.load(str(bad))


def test_cli_convert_of_an_evil_pt2_exits_2_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    evil = _evil_weight(tmp_path, marker)
    proc = subprocess.run([sys.executable, "-m", "circleops.cli", "convert", str(evil), "-o", str(tmp_path / "o.circle")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr
    assert "refusing to load" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "o.circle").exists()


# ---- the code base itself: no unsafe loaders, no remote code, no shell ----------------

def _sources() -> list[Path]:
    return sorted((REPO / "circleops").rglob("*.py"))


def test_no_pickle_load_without_weights_only():
    bad = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bpickle\.loads?\(|\bdill\.|\bcloudpickle\.|_pickle_load_obj", code):
                bad.append(f"{path}:{n}: {line.strip()}")
            if re.search(r"\btorch\.load\(", code) and "weights_only=True" not in code and path.name != "safe_load.py":
                bad.append(f"{path}:{n}: {line.strip()}")
            if re.search(r"allow_pickle\s*=\s*True", code):
                bad.append(f"{path}:{n}: {line.strip()}")
    assert not bad, "unsafe deserialization:\n" + "\n".join(bad)


def test_no_shell_true_and_no_eval_of_file_contents():
    bad = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"shell\s*=\s*True|os\.system\(|os\.popen\(|(?<![.\w])eval\(|(?<![.\w])exec\(", code):
                bad.append(f"{path}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_trust_remote_code_only_from_a_user_flag():
    bad = []
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"trust_remote_code\s*=\s*True", code):
                bad.append(f"{path}:{n}: {line.strip()}")
    assert not bad, "trust_remote_code=True hard-coded:\n" + "\n".join(bad)


def test_hf_dir_with_remote_code_is_not_executed(tmp_path):
    from families import BY_NAME

    model = BY_NAME["llama"].build()
    model.save_pretrained(tmp_path)
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig as EvilConfig\n"
    (tmp_path / "evil_config.py").write_text(code)
    (tmp_path / "evil_model.py").write_text(code + "from transformers import LlamaForCausalLM as EvilModel\n")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil_config.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilModel"}
    cfg["architectures"] = ["EvilModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    try:
        models.load(str(tmp_path))
    except ModelLoadError:
        pass  # refusing the unknown architecture is fine; running its code is not
    assert not marker.exists()
