"""Issue 24: onert and LiteRT never see an unverified file. Damaged files given to
`circleops run --runtime onert|litert` and to generate's directories give a clear error
naming the file (exit 2), manifests cannot point outside their directory, and a crash of a
runtime on a file that passes verification is contained in the one-shot commands."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import flatbuffers
import numpy as np
import pytest
import torch

import manifest_json
from circleops.errors import CorruptFileError, ModelLoadError, RuntimeCrashError, RuntimeRunError
from circleops.serialize.schema import get_schema

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """A 1-layer random Llama's prefill/decode graphs for target onert and tflite."""
    sys.path.insert(0, str(REPO / "tests"))
    from families import BY_NAME

    from circleops.recipes.llm import convert_graphs

    torch.manual_seed(0)
    model = BY_NAME["llama"].build(num_hidden_layers=1)
    out = {}
    for target in ("onert", "tflite"):
        out[target] = tmp_path_factory.mktemp(f"graphs_{target}")
        convert_graphs(copy.deepcopy(model), out[target], target=target, prefill_len=4, max_cache_len=8,
                       source="test")
    return out


def _damaged(src: Path, dst: Path, edit, fmt: str = "circle") -> Path:
    schema = get_schema(fmt)
    m = schema.cls("Model").InitFromPackedBuf(bytearray(src.read_bytes()), 0)
    edit(m)
    b = flatbuffers.Builder(0)
    b.Finish(m.Pack(b), file_identifier=schema.identifier)
    dst.write_bytes(bytes(b.Output()))
    return dst


def _op_input_out_of_range(m):
    """Measured: onert 0.1.0 dies of SIGSEGV on this file without the verifier."""
    op = next(op for op in m.subgraphs[0].operators if len(op.inputs) >= 2)
    op.inputs[0] = 100000


def _inputs(path: Path, tmp_path: Path, signature=None) -> list[str]:
    from circleops.runtime import reference

    files = []
    for i, spec in enumerate(reference.Session(str(path), signature).inputs):
        files.append(str(tmp_path / f"in{i}.npy"))
        np.save(files[-1], np.zeros(spec.shape, spec.dtype))
    return files


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "circleops.cli", *argv], capture_output=True, text=True, env=ENV,
                          timeout=600)


def test_run_onert_on_a_damaged_file_is_the_verifiers_error(graphs, tmp_path):
    decode = graphs["onert"] / "decode.circle"
    npys = _inputs(decode, tmp_path)
    bad = _damaged(decode, tmp_path / "bad.circle", _op_input_out_of_range)
    r = _cli("run", str(bad), "--runtime", "onert", "-i", *npys)
    assert r.returncode == 2, r.stderr
    # the verifier's words, not a contained crash: without the verifier onert dies of SIGSEGV
    assert "is not a valid circle file" in r.stderr and str(bad) in r.stderr and "tensor 100000" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    good = _cli("run", str(decode), "--runtime", "onert", "-i", *npys)
    assert good.returncode == 0, good.stderr


def test_sessions_verify_before_the_runtime_reads(graphs, tmp_path):
    from circleops.runtime import litert, onert

    bad = _damaged(graphs["onert"] / "decode.circle", tmp_path / "bad.circle", _op_input_out_of_range)
    with pytest.raises(CorruptFileError, match="tensor 100000"):
        onert.Session(bad)  # in-process: without the verifier this kills the test process
    bad_tfl = _damaged(graphs["tflite"] / "model.tflite", tmp_path / "bad.tflite", _op_input_out_of_range, "tflite")
    with pytest.raises(CorruptFileError, match="tensor 100000"):
        litert.Session(bad_tfl, "decode")
    r = _cli("run", str(bad_tfl), "--runtime", "litert", "--signature", "decode", "-i",
             *_inputs(graphs["tflite"] / "model.tflite", tmp_path, "decode"))
    assert r.returncode == 2 and "is not a valid tflite file" in r.stderr and str(bad_tfl) in r.stderr, r.stderr


def test_onert_refuses_weights_after_the_flatbuffer(graphs, tmp_path):
    """onert 0.1.0 dies of SIGSEGV on Buffer.offset/size files, which are sound: refused by name."""
    from circleops.runtime import onert
    from circleops.serialize import read_model, write_model

    after = tmp_path / "after.circle"
    write_model(read_model(graphs["onert"] / "decode.circle"), after, "circle", weights_after=True)
    with pytest.raises(RuntimeRunError, match="Buffer.offset/size"):
        onert.Session(after)


class _Crashing:
    """A runtime Session that dies of SIGSEGV as it loads (what onert does on some files)."""

    def __init__(self, path, signature=None):
        import faulthandler

        faulthandler.disable()  # pytest's dump of the child's stack would only be noise
        os.kill(os.getpid(), signal.SIGSEGV)


def test_a_runtime_crash_in_a_one_shot_command_is_contained(graphs, tmp_path, monkeypatch):
    from circleops.cli import main
    from circleops.runtime import onert, open_session

    decode = graphs["onert"] / "decode.circle"
    npys = _inputs(decode, tmp_path)
    monkeypatch.setattr(onert, "Session", _Crashing)  # inherited by the forked child
    # as in a one-shot command's fresh process: no native runtime ran here yet
    monkeypatch.setattr("circleops.runtime.isolated._NATIVE_USED", set())
    with pytest.raises(RuntimeCrashError, match="SIGSEGV") as err:
        open_session("onert", decode, isolated=True)
    assert str(decode) in str(err.value) and "onert crashed while loading" in str(err.value)
    assert main(["run", str(decode), "--runtime", "onert", "-i", *npys]) == 2  # and this process lives on


def test_isolated_session_runs_like_the_in_process_one(graphs, tmp_path):
    """In a fresh process (as a one-shot command starts): the isolated session is a forked
    child, and it computes what the in-process session computes. (A pytest worker that ran
    onert before cannot fork a sound child: there sessions run in-process.)"""
    import subprocess
    import sys

    decode = graphs["onert"] / "decode.circle"
    code = f"""
import numpy as np
from circleops.runtime import isolated, open_session
child = open_session("onert", {str(decode)!r}, isolated=True)
assert isinstance(child, isolated.IsolatedSession)
inside = open_session("onert", {str(decode)!r})
assert child.inputs == inside.inputs and child.outputs == inside.outputs
rng = np.random.default_rng(0)
arrays = [rng.integers(0, 8, s.shape).astype(s.dtype) if "int" in s.dtype else
          rng.standard_normal(s.shape).astype(s.dtype) for s in inside.inputs]
for a, b in zip(child.run(arrays), inside.run(arrays)):
    np.testing.assert_array_equal(a, b)
child.close()
print("same")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stderr[-2000:]


# --------------------------------------------------------------------------- generate's directories

def _copy(graphs, tmp_path, target="onert") -> Path:
    d = tmp_path / "graphs"
    shutil.copytree(graphs[target], d)
    return d


def _set_manifest(d: Path, **changes) -> None:
    files = manifest_json.read(d)["files"]
    files.update({key[6:]: value for key, value in changes.items() if key.startswith("files.")})
    manifest_json.edit(d, {**{k: v for k, v in changes.items() if not k.startswith("files.")}, "files": files})


@pytest.mark.parametrize("name, words", [
    ("/etc/passwd", "is an absolute path"),
    ("../decode.circle", "leaves the directory"),
    ("sub/../../x.circle", "leaves the directory"),
    ("escape.circle", "symbolic link"),
    (".", "is not a file name"),
])
def test_manifest_files_stay_in_their_directory(graphs, tmp_path, name, words):
    from circleops.package.manifest import read_manifest

    d = _copy(graphs, tmp_path)
    (d / "escape.circle").symlink_to(graphs["onert"] / "decode.circle")  # a sound file, but outside
    _set_manifest(d, **{"files.decode": name})
    with pytest.raises(ModelLoadError, match=words) as err:
        read_manifest(d)
    assert "manifest.json" in str(err.value)
    r = _cli("generate", str(d), "--token-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_tokenizer_directory_stays_in_the_directory(graphs, tmp_path):
    from circleops.package.manifest import read_manifest

    d = _copy(graphs, tmp_path)
    _set_manifest(d, tokenizer="/etc")
    with pytest.raises(ModelLoadError, match="tokenizer directory '/etc' is an absolute path"):
        read_manifest(d)
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").symlink_to("/etc/passwd")
    _set_manifest(d, tokenizer="tok")
    with pytest.raises(ModelLoadError, match="tokenizer file 'tok/tokenizer.json' is a symbolic link to /etc/passwd"):
        read_manifest(d)


def test_generate_verifies_each_graph(graphs, tmp_path):
    d = _copy(graphs, tmp_path)
    _damaged(graphs["onert"] / "decode.circle", d / "decode.circle", _op_input_out_of_range)
    r = _cli("generate", str(d), "--token-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.returncode == 2 and "is not a valid circle file" in r.stderr and "decode.circle" in r.stderr, r.stderr
    d2 = tmp_path / "graphs2"
    shutil.copytree(graphs["onert"], d2)
    _set_manifest(d2, num_layers=10 ** 12)  # caches would be allocated from it (MemoryError)
    r = _cli("generate", str(d2), "--token-ids", "1,2,3", "--max-new-tokens", "2")
    assert r.returncode == 2 and "does not describe its decode graph" in r.stderr, r.stderr


class _KilledOutOfMemory:
    """A runtime Session that grows to ~200 MB and is then killed by SIGKILL, as the
    kernel's out-of-memory killer ends a process (issue 32: a 1B verify child)."""

    def __init__(self, path, signature=None):
        import numpy as np

        self.held = np.ones(50 * 2**20, np.float32)  # 200 MB, touched
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_runtime_killed_for_memory_is_reported_as_such(graphs, monkeypatch):
    """SIGKILL is never "a fault inside the runtime on this file": the error says out of
    memory, with the child's peak resident memory and the machine's."""
    from circleops.runtime import onert, open_session

    decode = graphs["onert"] / "decode.circle"
    monkeypatch.setattr(onert, "Session", _KilledOutOfMemory)
    monkeypatch.setattr("circleops.runtime.isolated._NATIVE_USED", set())
    with pytest.raises(RuntimeCrashError) as err:
        open_session("onert", decode, isolated=True)
    text = str(err.value)
    assert "killed by SIGKILL while loading" in text and "out of memory" in text and "not a fault in the file" in text
    assert "fault inside" not in text and "GB resident of this machine's" in text
    peak = float(text.split("peaked at ")[1].split(" GB")[0])
    assert peak >= 0.2  # the child's own 200 MB at least


def _mean_over(axes_constant: bool):
    """MEAN(x [1, 4, 8], axes [1]) with the axes a constant or a graph input."""
    from circleops import ir

    axes = ir.Tensor("axes", (1,), "INT32", data=np.array([1], np.int32) if axes_constant else None)
    tensors = [ir.Tensor("x", (1, 4, 8), "FLOAT32"), axes, ir.Tensor("y", (1, 1, 8), "FLOAT32")]
    op = ir.Operator("MEAN", [0, 1], [2], "ReducerOptions", {"keepDims": True})
    return ir.Model([ir.Subgraph("main", tensors, [op], [0] if axes_constant else [0, 1], [2])])


def test_a_reduction_over_computed_axes_is_refused_for_onert(tmp_path):
    """onert 0.1.0 reads a reduction's axes when it loads the file: axes that are a graph input
    (or another op's output) kill it (SIGSEGV; found by the CLI hold-out fuzz on a damaged
    Whisper prefill graph). The integrity check refuses them in a Circle file; constant axes run."""
    from circleops.serialize import write_model
    from circleops.serialize.integrity import check_file

    good, bad = tmp_path / "good.circle", tmp_path / "bad.circle"
    write_model(_mean_over(True), good, "circle")
    write_model(_mean_over(False), bad, "circle")
    check_file(good)
    with pytest.raises(CorruptFileError, match="input 1 \\(the axes\\) is not a constant"):
        check_file(bad)
    probe = ("import sys, numpy as np, onert; s = onert.infer.session(sys.argv[1], 'cpu'); "
             "s.infer([np.ones((1, 4, 8), np.float32)] + ([np.array([1], np.int32)] if 'bad' in sys.argv[1] else []))")
    crashed = subprocess.run([sys.executable, "-c", probe, str(bad)], capture_output=True, env=ENV, timeout=300)
    assert crashed.returncode == -signal.SIGSEGV  # the premise: without the integrity check, onert dies
    ran = subprocess.run([sys.executable, "-c", probe, str(good)], capture_output=True, env=ENV, timeout=300)
    assert ran.returncode == 0, ran.stderr
    r = _cli("run", str(bad), "--runtime", "onert", "-i", *_inputs(bad, tmp_path))
    assert r.returncode == 2 and "is not a constant" in r.stderr and "Traceback" not in r.stderr, r.stderr
