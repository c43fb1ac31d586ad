"""onert's GGML kernels and this machine's CPU: circleops refuses a GGML file where onert
would die of SIGILL (circleops.runtime.host), runs fp32 files everywhere, and its defaults
fall back to the reference interpreter with a note. The first test checks the flag list
against what onert really does on the CPU the tests run on."""
from __future__ import annotations

import signal
import subprocess
import sys

import numpy as np
import pytest

from circleops import ir
from circleops.errors import HostCPUError
from circleops.quantize import ggml
from circleops.runtime import host, onert
from circleops.serialize import write_model
from circleops.serialize.reader import tensor_types


def _fc_file(path, dtype: str = "GGML_Q8_0"):
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, 64), "FLOAT32"))
    data = ggml.quantize(w, dtype) if dtype in ir.GGML_BLOCKS else w
    wi = sg.add_tensor(ir.Tensor("w", (16, 64), dtype, data))
    y = sg.add_tensor(ir.Tensor("y", (1, 16), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, wi, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": "NONE"}))
    sg.inputs, sg.outputs = [x], [y]
    write_model(ir.Model([sg]), path, "circle")
    return path


def test_the_flag_list_predicts_what_onert_does_here(tmp_path):
    """onert itself, bypassing circleops' check, in a child process: it dies of SIGILL
    exactly when this CPU lacks one of ONERT_GGML_CPU_FLAGS."""
    path = _fc_file(tmp_path / "q8.circle")
    code = ("import numpy as np\n"
            "from onert.native.libnnfw_api_pybind import infer, prepare_config\n"
            f"s = infer.nnfw_session({str(path)!r}, 'cpu')\n"
            "s.set_prepare_config(prepare_config.ENABLE_INTERNAL_OUTPUT_ALLOC)\n"
            "s.prepare()\n"
            "x = np.ones((1, 64), np.float32)\n"
            "s.set_input(0, x)\n"
            "s.run()\n"
            "print('ran', float(s.get_output(0).sum()))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    missing = host.missing_for_onert_ggml()
    if missing:
        assert run.returncode == -signal.SIGILL, (missing, run.returncode, run.stderr[-500:])
    else:
        assert run.returncode == 0 and run.stdout.startswith("ran"), run.stderr[-500:]


def test_tensor_types_reads_every_tensor(tmp_path):
    assert tensor_types(_fc_file(tmp_path / "q4.circle", "GGML_Q4_0")) == {"FLOAT32", "GGML_Q4_0"}
    assert tensor_types(_fc_file(tmp_path / "f.circle", "FLOAT32")) == {"FLOAT32"}


@pytest.fixture
def avx2_only(monkeypatch):
    """A CPU like this project's AMD EPYC: AVX2, no AVX-512."""
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
    monkeypatch.setattr(host.platform, "machine", lambda: "x86_64")


def test_a_ggml_file_is_refused_with_the_reason_and_a_way_out(tmp_path, avx2_only):
    path = _fc_file(tmp_path / "q4.circle", "GGML_Q4_0")
    with pytest.raises(HostCPUError) as err:
        onert.Session(path)
    text = str(err.value)
    for words in ("GGML_Q4_0", "AVX-512", "avx512bw", "avx512_vnni", "Illegal instruction", "--runtime reference",
                  "--quantize w8", "without --quantize"):
        assert words in text, words


def test_fp32_files_still_run_on_onert(tmp_path, avx2_only):
    path = _fc_file(tmp_path / "f.circle", "FLOAT32")
    (y,) = onert.run(path, [np.ones((1, 64), np.float32)])
    assert y.shape == (1, 16) and np.isfinite(y).all()


def test_defaults_fall_back_and_named_onert_is_refused(avx2_only):
    runtime, note = host.onert_or_reference(True, "q4_0")
    assert runtime == "reference" and "reference interpreter, not onert" in note and "avx512f" in note
    assert host.onert_or_reference(None, "q8_0", "run")[1].startswith("running on")
    with pytest.raises(HostCPUError, match="--runtime reference"):
        host.onert_or_reference("onert", "q8_0")
    assert host.onert_or_reference(True, None) == ("onert", None)  # fp32
    assert host.onert_or_reference(True, "uint8") == ("onert", None)  # integer graphs: no GGML
    assert host.onert_or_reference("reference", "q4_0") == ("reference", None)


def test_a_cpu_with_the_flags_keeps_onert(monkeypatch):
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset(host.ONERT_GGML_CPU_FLAGS) | {"avx2"})
    monkeypatch.setattr(host.platform, "machine", lambda: "x86_64")
    assert host.missing_for_onert_ggml() == []
    assert host.onert_or_reference(True, "q4_0") == ("onert", None)
