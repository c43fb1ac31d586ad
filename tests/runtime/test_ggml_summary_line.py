"""On a CPU without AVX-512 the run says, in one summary line, which tests ran their GGML
files on the reference interpreter instead of onert (tests/conftest.py): checked by running
tests/conftest.py on a pytest session of its own, on a CPU that lacks the flags (stubbed
before the session's first test); a test that stubs the flags on a machine that has them
(tests/runtime/test_host_cpu.py) does not count."""
from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

from circleops.runtime.host import missing_for_onert_ggml

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

# on a machine that runs GGML on onert, a test that stubs the flags is no fallback of the run
STUBBED_IN_A_TEST = '''
from circleops.runtime import host

def test_stubbed(monkeypatch):
    monkeypatch.setattr(host, "cpu_flags", lambda: {"avx2"})
    assert host.onert_or_reference(True, "q4_0")[0] == "reference"
'''

INNER = '''
from circleops.runtime import host

host.cpu_flags = lambda: {"avx2"}  # this session's machine: no AVX-512 (set before any test runs)

def test_falls_back():
    runtime, note = host.onert_or_reference(True, "q4_0")
    assert runtime == "reference" and note

def test_fp32_only():
    assert host.onert_or_reference(True, None) == ("onert", None)
'''


def test_summary_names_the_tests_that_used_the_interpreter(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=2)
    lines = [ln for ln in result.outlines if ln.startswith("GGML on the reference interpreter")]
    assert len(lines) == 1, result.outlines[-10:]
    assert "1 tests ran" in lines[0] and "test_inner.py" in lines[0] and "avx512f" in lines[0]


def test_no_line_when_nothing_fell_back(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=STUBBED_IN_A_TEST if not missing_for_onert_ggml() else "def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=1)
    assert not [ln for ln in result.outlines if "GGML on the reference interpreter" in ln]
