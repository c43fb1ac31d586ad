import os
import sys

# tests/families.py and the shared test helpers are importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))

# Compiled modules are cached in the checkout's __pycache__ even where the environment says
# PYTHONDONTWRITEBYTECODE (this machine's image sets it): the suite starts hundreds of Python
# processes (CLI runs, fork servers, pytest children), and without the cache each compiled
# circleops and the tests it imports from source again, and each pytest re-rewrote every test
# module's asserts (measured: collecting the suite 17.6 s -> 13.2 s of CPU per process once
# cached). Set before the test modules import; the children inherit the environment.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The mutation check (tests/mutation): CIRCLEOPS_MUTANT=<name> runs the tests against one
# mutant of circleops, applied before any test module imports it.
if os.environ.get("CIRCLEOPS_MUTANT"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "mutation"))
    import mutants

    mutants.apply(os.environ["CIRCLEOPS_MUTANT"])

# Under pytest-xdist every worker is its own process; with torch's default of one thread
# per core the workers oversubscribe the 2 cores and small ops crawl (measured: a tiny
# decode step 146 ms instead of 4 ms). One intra-op thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


# Every file the tests run in onert or LiteRT is also run by the reference interpreter, and
# the two must agree within 1e-5 x max(1, max|output|) (fp32 outputs; fp16 ones within
# FP16_CROSS_CHECK_STEPS fp16 steps, integer ones exactly): the real runtimes check the interpreter on
# every file the tests produce. Tests that pin a runtime's own deviations (onert's ROPE
# reading one row, ignored flags; LiteRT's fp16 kernel list) opt out.
# test_quantize_smollm2.py: 30 real layers amplify Q8_0 input-rounding flips (see GGML_CROSS_CHECK_ATOL)
# past 1e-2 of the logits; its verify still compares onert with torch on the same weights.
_CROSS_CHECK_OPT_OUT = ("test_onert_runtime.py", "test_quantize_smollm2.py",
                        "test_coverage_opinfo.py",  # compares every runtime with torch itself
                        "test_fuzz_native.py")  # mutated files: onert and the interpreter may rightly differ
CROSS_CHECK_ATOL = 1e-5
# A file whose kernels round their inputs at run time: GGML weights (onert rounds each
# linear's input to Q8_0) and w8's hybrid int8 FULLY_CONNECTED (each input row rounded to
# int8). A 1-ulp difference upstream (an RMS_NORM's or a matmul's summation order, which
# differs by CPU kernel) can move one input across a rounding boundary and the output by one
# input quantum (2^-7 of the row's scale); on the sharp tiny models such a flip goes on
# through attention that picks positions (a near-tie of two scores can go either way). So
# these files agree within the format's verify bound: 16 int8 rounding steps of the output's
# scale (circleops.pipeline.stages.format_tolerance("q8_0") = 16 x 2^-7). Fed the same input, the
# interpreter's GGML and hybrid kernels equal onert's within 1e-5
# (tests/quantize/test_ggml_reference.py, test_w8.py's test_interpreter_hybrid_fc_equals_onert).
INPUT_ROUNDING_CROSS_CHECK_ATOL = 16 * 2.0 ** -7
# A full-integer .tflite (--target tflite --quantize uint8|int16): each op's fixed-point
# result may be its kernel's deviation off (int8 kernels 1 step, LiteRT's int16 table lookups
# LOGISTIC/SOFTMAX/TANH/RSQRT 3 steps: tests/tflite/test_tflite_integer.py's one-op files) in
# that op's own output scale, passed on at unit gain: rounding.integer_output_bounds sums
# that along the file's deepest path, per output (measured on the tiny Llama: ~25 int16 steps
# of the logits, 4e-4 at max 0.6, and ~5 uint8 steps, 2.4e-2).
# fp16 outputs agree within this many fp16 steps (2^-10) at the output's scale
FP16_CROSS_CHECK_STEPS = 16


def _has_ggml_weights(model) -> bool:
    from circleops import ir

    return any(t.dtype in ir.GGML_BLOCKS for sg in model.subgraphs for t in sg.tensors)


def _has_hybrid_int8_weights(model) -> bool:
    """A FULLY_CONNECTED with float input and int8 weights (w8): onert's hybrid kernel."""
    return any(op.opcode == "FULLY_CONNECTED" and len(op.inputs) > 1 and sg.tensors[op.inputs[0]].dtype == "FLOAT32"
               and sg.tensors[op.inputs[1]].dtype == "INT8"
               for sg in model.subgraphs for op in sg.operators)


def _is_integer_tflite(path, model) -> bool:
    return ".tflite" in os.path.basename(str(path)) and any(
        t.quant is not None and t.dtype in ("INT8", "INT16") and t.data is None for t in model.subgraphs[0].tensors)


def _integer_bounds(model, signature) -> list[float]:
    """Per output of an integer file: how far LiteRT and the interpreter may end apart
    (rounding.integer_output_bounds); a signature's outputs all get its subgraph's largest."""
    from rounding import integer_output_bounds

    if signature is None:
        return integer_output_bounds(model, 0)
    index = next((s.subgraph_index for s in model.signatures if s.key == signature), 0)
    return [max(integer_output_bounds(model, index), default=0.0)]


def _cross_checked(session_class, runtime_name, atol=CROSS_CHECK_ATOL):
    """``session_class`` whose ``run`` also runs the reference interpreter on the same file,
    inputs and signature and compares (one interpreter per session: generation loops stay cheap)."""
    import numpy as np

    class CrossChecked(session_class):
        def run(self, inputs, *args, **kwargs):
            got = super().run(inputs, *args, **kwargs)
            from circleops.runtime import reference

            if getattr(self, "_reference", None) is None:
                from circleops.serialize import read_model

                model = read_model(str(self.path))  # once: the interpreter's and the bounds' (a decode per read)
                self._reference = reference.Session(model, self.signature)
                self._reference.path = self._reference.interpreter.source = str(self.path)  # for its messages
                rounds_inputs = _has_ggml_weights(model) or _has_hybrid_int8_weights(model)
                self._atol = max(atol, INPUT_ROUNDING_CROSS_CHECK_ATOL) if rounds_inputs else atol
                self._integer_bounds = _integer_bounds(model, self.signature) \
                    if _is_integer_tflite(self.path, model) else None
            if isinstance(inputs, dict):
                inputs = {k: np.asarray(v) for k, v in inputs.items()}
            else:
                inputs = [np.asarray(i) for i in inputs]
            ref = self._reference.run(inputs)
            path = self.path
            assert len(ref) == len(got), f"{path}: {runtime_name} gave {len(got)} outputs, the reference interpreter {len(ref)}"
            for i, (a, b) in enumerate(zip(got, ref)):
                assert a.shape == b.shape and a.dtype == b.dtype, f"{path} output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
                where = f"{path} output {i}: reference interpreter vs {runtime_name}"
                if a.dtype == np.float32 or a.dtype == np.float16:
                    # fp32: 1e-5 at the output's scale (fp32 sums of ~1e2 values differ by
                    # order); fp16: FP16_CROSS_CHECK_STEPS fp16 steps at the output's scale
                    # (LiteRT's fp16 kernels accumulate in fp32, the interpreter rounds as torch)
                    scale = max(1.0, float(np.abs(a.astype(np.float32)).max(initial=0.0)))
                    tol = self._atol if a.dtype == np.float32 else FP16_CROSS_CHECK_STEPS * 2.0 ** -10
                    bound = tol * scale if self._integer_bounds is None else \
                        self._integer_bounds[min(i, len(self._integer_bounds) - 1)] + CROSS_CHECK_ATOL * scale
                    np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), atol=bound, rtol=0,
                                               err_msg=where)
                else:
                    # integers and booleans (integer graphs' outputs, token ids, positions): exactly
                    np.testing.assert_array_equal(b, a, err_msg=where)
            return got

    CrossChecked.__name__ = CrossChecked.__qualname__ = session_class.__name__
    return CrossChecked


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
            # every run goes through the module's Session (its module-level run too)
            # a test module may set its own CROSS_CHECK_ATOL (the real 30-layer SmolLM2: fp32
            # sums over 30 layers and hundreds of cache slots differ by order at ~1e-5 relative)
            atol = getattr(request.module, "CROSS_CHECK_ATOL", CROSS_CHECK_ATOL)
            monkeypatch.setattr(runtime, "Session", _cross_checked(runtime.Session, name, atol))
    yield


# GGML on a CPU without AVX-512 (issue 25): onert's GGML kernels cannot run here, so tests of
# GGML files run them on the reference interpreter instead (tests/onert_host.py). Every test
# in which circleops made that choice (circleops.runtime.host.missing_for_onert_ggml answered
# with missing flags) is marked in its report (user_properties travel to the xdist
# controller), and the run ends with one line naming how many and which files.
_GGML_MARK = "ggml_on_interpreter"  # user property: the CPU flags onert's GGML kernels missed
_ggml_on_interpreter: dict[str, str] = {}
_host_missing: list[list[str]] = []  # this machine's answer, taken before any test stubs the CPU flags


@pytest.fixture(autouse=True)
def _ggml_host_fallback_recorded(request, monkeypatch):
    from circleops.runtime import host

    original = host.missing_flags  # every host check of a format's CPU flags goes through it
    if not _host_missing:
        _host_missing.append(host.missing_for_onert_ggml())

    def recorded(needed) -> list[str]:
        missing = original(needed)
        # tests that stub the CPU flags (tests/runtime/test_host_cpu.py) on a machine that
        # runs GGML on onert still ran onert elsewhere: only this machine's lack counts
        if missing and _host_missing[0] and not any(k == _GGML_MARK for k, _ in request.node.user_properties):
            request.node.user_properties.append((_GGML_MARK, ", ".join(missing)))
        return missing

    monkeypatch.setattr(host, "missing_flags", recorded)
    yield


def pytest_runtest_logreport(report):
    if report.when == "call":
        for key, value in report.user_properties:
            if key == _GGML_MARK:
                _ggml_on_interpreter[report.nodeid] = value


def pytest_terminal_summary(terminalreporter):
    if not _ggml_on_interpreter:
        return
    files = sorted({n.split("::")[0].rsplit("/", 1)[-1] for n in _ggml_on_interpreter})
    flags = sorted(set(_ggml_on_interpreter.values()))
    terminalreporter.write_line(
        f"GGML on the reference interpreter, not onert: {len(_ggml_on_interpreter)} tests ran their GGML files "
        f"there (this CPU lacks {'; '.join(flags)}): {', '.join(files)}")


# session fixtures that several modules share and that cost seconds per worker: the modules
# using one form one group, so one worker builds it (the tflite families' conversions, the
# tiny VLMs converted with the CLI, the real SmolLM2's fp16 check report)
_SHARED_FIXTURES = {"converted": "tests/tflite/conftest.py", "tiny_vlm_onert": "tests/generate/vlm_fixtures.py",
                    "smollm2_fp16_check": "tests/conftest.py"}


def _shared_fixture_group(item) -> str | None:
    import inspect

    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        where = _SHARED_FIXTURES.get(name)
        if where and defs and inspect.getsourcefile(defs[-1].func).replace(os.sep, "/").endswith(where):
            return f"{where}::{name}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under --dist loadgroup (pyproject) a test without an xdist_group is a work unit of its
    own, so both workers ran most modules and each built the module's and session's fixtures
    (the real SmolLM2 converted twice, the tiny VLMs, check()'s four policies): each test
    module is one group (the modules sharing a costly session fixture one group together),
    unless a test names its own group (mutation, the doc commands). Runs before xdist's
    hook, which turns the marks into the groups."""
    modules: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        shared = _shared_fixture_group(item)
        if shared or module not in modules:
            modules[module] = shared or modules.get(module) or module
    for item in items:
        if next(item.iter_markers("xdist_group"), None) is None:
            item.add_marker(pytest.mark.xdist_group(modules[item.nodeid.split("::", 1)[0]]))
    # xdist hands the groups out in collection order: the longest first (as measured, idle AVX2
    # EPYC, 2026-12-07: 40-120 s each), so that the small ones fill the end and both workers
    # finish together (last in the list before: one worker idle for the last ~40 s). A stable
    # sort: a group's tests keep their order (the docs' commands run in page order).
    def rank(item) -> int:
        group = next(item.iter_markers("xdist_group")).args[0]
        return _LONG_GROUPS.index(group) if group in _LONG_GROUPS else len(_LONG_GROUPS)

    items.sort(key=rank)


_LONG_GROUPS = ["readme_smollm2", "tests/generate/vlm_fixtures.py::tiny_vlm_onert", "readme_commands",
                "tests/conftest.py::smollm2_fp16_check", "tests/generate/test_cached_families.py", "mutation",
                "tests/ops/test_ops_generic.py", "tests/generate/test_cache_windows.py",
                "tests/adapters/test_adapters_families.py", "tests/cli/test_cli_convert.py",
                "tests/generate/test_docs_vlm.py"]


@pytest.fixture(scope="session")
def readme_llm_out(tmp_path_factory):
    """The README's out/ (tests/readme_llm.py), converted once per test process."""
    import readme_llm  # imported here: pytester sessions run a copy of this file without it

    return readme_llm.convert(tmp_path_factory.mktemp("readme_smollm2"))


@pytest.fixture(scope="session")
def smollm2_fp16_check(tmp_path_factory):
    """The real SmolLM2's fp16 check() report, computed on first use, once per test process
    (tests/smollm2_shared.py): tests/check/test_check_smollm2.py's subject and docs/tools.md's
    Python API block's call (tests/docs/test_readme.py)."""
    from smollm2_shared import SharedCheck

    return SharedCheck(lambda: tmp_path_factory.mktemp("smollm2_check"))
