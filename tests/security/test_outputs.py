"""Output files: mode, atomic replace, verify before rename, SIGTERM, stale temporaries,
concurrent writers, --graphs re-conversion, byte-identical output across processes."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import circleops
from circleops import ir
from circleops.errors import VerifyError
from circleops.pipeline.report import VerifyResult
from circleops.serialize import read_model, write_model
from circleops.serialize.writer import remove_stale_temporaries

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _tiny_ir(n: int = 4, fill: float = 1.0) -> ir.Model:
    w = np.full((n, n), fill, np.float32)
    sg = ir.Subgraph("main", [ir.Tensor("x", (1, n), "FLOAT32"), ir.Tensor("w", (n, n), "FLOAT32", w),
                              ir.Tensor("y", (1, n), "FLOAT32")],
                     [ir.Operator("FULLY_CONNECTED", [0, 1, -1], [2], "FullyConnectedOptions", {})], [0], [2])
    return ir.Model([sg])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize("fmt", ["circle", "tflite"])
def test_new_file_gets_the_mode_open_would_give(tmp_path, umask_022, fmt):
    path = tmp_path / f"m.{fmt}"
    write_model(_tiny_ir(), path, fmt)
    assert _mode(path) == 0o644  # not mkstemp's 0600: another user / service can read it
    os.umask(0o077)
    other = tmp_path / f"n.{fmt}"
    write_model(_tiny_ir(), other, fmt)
    assert _mode(other) == 0o600


def test_replacing_a_file_keeps_its_mode(tmp_path, umask_022):
    path = tmp_path / "m.circle"
    write_model(_tiny_ir(), path)
    os.chmod(path, 0o640)
    write_model(_tiny_ir(fill=2.0), path)
    assert _mode(path) == 0o640
    assert float(read_model(path).subgraphs[0].tensors[1].data[0, 0]) == 2.0


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path):
    path = tmp_path / "m.circle"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".m.circle.{dead_pid}-abc123.tmp"
    stale.write_bytes(b"x" * 100)
    stale_dir = tmp_path / f".m.circle.{dead_pid}-dir.tmp"
    stale_dir.mkdir()
    (stale_dir / "prefill.circle").write_bytes(b"x")
    live = tmp_path / f".m.circle.{os.getpid()}-live.tmp"
    live.write_bytes(b"y")
    other = tmp_path / f".other.circle.{dead_pid}-abc.tmp"  # another output's: not ours to remove
    other.write_bytes(b"z")
    write_model(_tiny_ir(), path)
    assert not stale.exists() and not stale_dir.exists()
    assert live.exists() and other.exists()
    assert remove_stale_temporaries(path) == []


def _convert_tiny(path: Path, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    return circleops.convert(model, (torch.randn(2, 4),), path, fuse="none", **kw)


def test_failed_verify_keeps_the_previous_good_file_and_verifies_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.circle"
    _convert_tiny(path, verify=True)
    good = path.read_bytes()
    conv_globals = circleops.convert.__globals__  # the conversion module, whatever its name

    seen = []

    def failing(p, runtime, *a, **k):
        seen.append(Path(p))
        assert Path(p).exists() and Path(p) != path
        return VerifyResult(runtime=runtime, max_abs_error=1.0, tolerance=1e-3, reference_max_abs=1.0, passed=False)

    monkeypatch.setitem(conv_globals, "compare_file", failing)
    with pytest.raises(VerifyError, match="nothing was written to"):
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval()
        circleops.convert(model, (torch.randn(2, 4),), path, fuse="none", verify=True)
    assert seen and seen[0].name.startswith(".m.circle.") and seen[0].name.endswith(".tmp")
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.circle"]


_SLOW_WRITE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import circleops.serialize.writer as writer
    real = writer._stream
    def slow(f, *a, **k):
        f.write(b"partial")
        f.flush()
        Path(sys.argv[2]).write_text("writing")
        time.sleep(60)
        return real(f, *a, **k)
    writer._stream = slow
    from circleops.cli import main
    sys.exit(main(["convert", sys.argv[1], "-o", sys.argv[3], "--quiet"]))
""")


def test_sigterm_during_a_write_removes_the_temporary_and_exits_143(tmp_path):
    from tests_helpers_pt2 import plain_pt2  # noqa: F401 - see conftest (sys.path)

    pt2 = plain_pt2(tmp_path / "plain.pt2")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_WRITE, str(pt2), str(ready), str(out_dir / "m.circle")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the conversion never reached the write"
        time.sleep(0.1)
    assert [p.name for p in out_dir.iterdir()][0].endswith(".tmp")  # mid-write: the temporary exists
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "circleops: terminated" in err and "Traceback" not in err
    assert list(out_dir.iterdir()) == []


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from circleops import ir
    from circleops.serialize import write_model
    n = 1024
    fill = float(sys.argv[2])
    w = np.full((n, n), fill, np.float32)
    sg = ir.Subgraph("main", [ir.Tensor("x", (1, n), "FLOAT32"), ir.Tensor("w", (n, n), "FLOAT32", w),
                              ir.Tensor("y", (1, n), "FLOAT32")],
                     [ir.Operator("FULLY_CONNECTED", [0, 1, -1], [2], "FullyConnectedOptions", {})], [0], [2])
    for _ in range(int(sys.argv[3])):
        write_model(ir.Model([sg]), sys.argv[1], "circle")
""")


def test_two_processes_writing_the_same_path_leave_one_complete_valid_file(tmp_path):
    path = tmp_path / "m.circle"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(fill), "6"], env=ENV,
                              stderr=subprocess.PIPE, text=True) for fill in (1.0, 2.0)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    model = read_model(path)
    w = np.asarray(model.subgraphs[0].tensors[1].data)
    assert w.shape == (1024, 1024) and float(w[0, 0]) in (1.0, 2.0) and (w == w[0, 0]).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.circle"]


_DETERMINISM = textwrap.dedent("""
    import hashlib, sys
    import torch
    import circleops
    from families import BY_NAME
    torch.manual_seed(0)
    model = BY_NAME["llama"].build().eval()
    ids = torch.arange(8).reshape(1, 8) % model.config.vocab_size
    out = []
    for target, suffix in (("circle", "circle"), ("onert", "circle"), ("tflite", "tflite")):
        path = f"{sys.argv[1]}/m_{target}.{suffix}"
        circleops.convert(model, (ids,), path, target=target)
        out.append(target + " " + hashlib.sha256(open(path, "rb").read()).hexdigest())
    print("\\n".join(out))
""")


def test_output_is_byte_identical_across_processes_and_hash_seeds(tmp_path):
    digests = []
    for seed in ("0", "12345"):
        d = tmp_path / seed
        d.mkdir()
        env = {**ENV, "PYTHONHASHSEED": seed, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
        proc = subprocess.run([sys.executable, "-c", _DETERMINISM, str(d)], capture_output=True, text=True,
                              env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr
        digests.append(proc.stdout.split())
    assert len(digests[0]) == 6 and digests[0] == digests[1]


def _graphs_model():
    from families import BY_NAME

    torch.manual_seed(0)
    return BY_NAME["llama"].build().eval()


def test_failed_graphs_reconversion_keeps_the_good_directory(tmp_path, monkeypatch):
    from circleops.recipes import llm as graphs

    out = tmp_path / "out"
    graphs.convert_graphs(_graphs_model(), out, target="circle", prefill_len=4, max_cache_len=8)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir() if p.is_file()}
    assert "manifest.json" in before

    def broken(*a, **k):
        raise RuntimeError("simulated failure in the middle of the re-conversion")

    monkeypatch.setattr("circleops.package.step.lower_graph", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        graphs.convert_graphs(_graphs_model(), out, target="circle", prefill_len=4, max_cache_len=8)
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir() if p.is_file()}
    assert after == before
    assert json.loads((out / "manifest.json").read_text())["text"]["prefill_len"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the staging directory is gone


def test_graphs_reconversion_replaces_the_directory_when_complete(tmp_path, umask_022):
    from circleops.recipes import llm as graphs

    out = tmp_path / "out"
    graphs.convert_graphs(_graphs_model(), out, target="circle", prefill_len=4, max_cache_len=8)
    (out / "notes.txt").write_text("the user's own file")
    graphs.convert_graphs(_graphs_model(), out, target="circle", prefill_len=6, max_cache_len=8)
    assert json.loads((out / "manifest.json").read_text())["text"]["prefill_len"] == 6
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    for p in out.iterdir():
        if p.suffix == ".circle":
            assert _mode(p) == 0o644
