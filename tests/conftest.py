import os
import sys

# tests/families.py and the shared test helpers are importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist every worker is its own process; with torch's default of one thread
# per core the workers oversubscribe the 2 cores and small ops crawl (measured: a tiny
# decode step 146 ms instead of 4 ms). One intra-op thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


# Every file the tests run in onert or LiteRT is also run by the reference interpreter, and
# the two must agree within 1e-5 x max(1, max|output|) (fp32 outputs): the real runtimes check the interpreter on
# every file the tests produce. Tests that pin a runtime's own deviations (onert's ROPE
# reading one row, ignored flags; LiteRT's fp16 kernel list) opt out.
_CROSS_CHECK_OPT_OUT = ("test_onert_runtime.py",
                        "test_coverage_opinfo.py")  # compares every runtime with torch itself
CROSS_CHECK_ATOL = 1e-5


def _cross_checked(run, runtime_name):
    import numpy as np

    def run_and_compare(path, inputs, *args, **kwargs):
        got = run(path, inputs, *args, **kwargs)
        from circleops.runtime import reference

        ref = reference.run(str(path), [np.asarray(i) for i in inputs])
        assert len(ref) == len(got), f"{path}: {runtime_name} gave {len(got)} outputs, the reference interpreter {len(ref)}"
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a.shape == b.shape and a.dtype == b.dtype, f"{path} output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            if a.dtype == np.float32:
                # 1e-5 at the output's scale (fp32 sums of ~1e2 values differ by order)
                scale = max(1.0, float(np.abs(a).max(initial=0.0)))
                np.testing.assert_allclose(b, a, atol=CROSS_CHECK_ATOL * scale, rtol=0,
                                           err_msg=f"{path} output {i}: reference interpreter vs {runtime_name}")
        return got

    return run_and_compare


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _reference_interpreter_checked_against_runtimes(request, monkeypatch):
    if request.node.path.name not in _CROSS_CHECK_OPT_OUT:
        import importlib

        for name in ("onert", "litert"):
            try:
                runtime = importlib.import_module(f"circleops.runtime.{name}")
            except ImportError:  # that extra is missing: nothing runs there
                continue
            monkeypatch.setattr(runtime, "run", _cross_checked(runtime.run, name))
    yield
