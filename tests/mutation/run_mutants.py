"""Run every mutant's named test with the mutant applied; print one JSON line of results.

    python tests/mutation/run_mutants.py [NAME ...]

The imports every run needs (torch, transformers' Llama, circleops, pytest) are paid once
here; each mutant then runs in a forked child: CIRCLEOPS_MUTANT set, pytest.main on its
named test (tests/conftest.py applies the mutant before the tests import anything). The
result per mutant: pytest's exit code (1 = the test failed: the mutant is killed) and the
last lines of its output. Forked children keep the CI cost of a dozen mutants near that of
their tests alone (tests/mutation/test_mutants.py).
"""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _preload() -> None:
    import torch

    torch.set_num_threads(1)  # before any pool exists: children fork a single-threaded torch
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import circleops  # noqa: F401
    import circleops.pipeline.convert  # noqa: F401
    import circleops.runtime.reference  # noqa: F401

    # what the mutants' tests import besides, once here instead of in each child (measured on
    # the AVX2 EPYC: the children's CPU 43 s -> 35 s, every mutant still killed). Mutants
    # replace functions through mutants._replace, which also rebinds every loaded circleops
    # module's by-name import, so a module loaded here sees the mutant as one loaded later does.
    import importlib

    for name in ("torch.export._trace", "torch._functorch.aot_autograd", "torch._functorch.partitioners",
                 "transformers.models.auto.modeling_auto", "torchao", "onert", "gguf", "pdb", "xdist.plugin",
                 "xdist.looponfail", "circleops.cli", "circleops.cli.convert", "circleops.cli.generate",
                 "circleops.cli.check", "circleops.recipes.llm", "circleops.generation.generator",
                 "circleops.sources.models", "circleops.lowering.program", "circleops.passes.fusion",
                 "circleops.serialize.writer", "circleops.serialize.reader", "circleops.tools.precision",
                 "circleops.tools.quant_report", "circleops.quantize.recipe", "circleops.quantize.integer.lower",
                 "circleops.adapters"):
        importlib.import_module(name)


def _run_child(name: str, node: str, log: Path) -> None:
    """In the forked child: run ``node`` under mutant ``name``; exits with pytest's code."""
    os.environ["CIRCLEOPS_MUTANT"] = name
    os.environ.pop("PYTEST_XDIST_WORKER", None)
    os.environ.pop("PYTEST_ADDOPTS", None)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = sys.stdout
    code = 3
    try:
        import pytest

        code = int(pytest.main([node, "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-p", "no:benchmark",
                                "--no-header", "-W", "ignore"]))
    finally:
        sys.stdout.flush()
        os._exit(code)


def main(names: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mutants import MUTANTS

    os.chdir(ROOT)
    _preload()
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"circleops-mutants-{os.getpid()}"
    logs.mkdir(exist_ok=True)
    results = {}
    for name in names or list(MUTANTS):
        mutant = MUTANTS[name]
        log = logs / f"{name}.log"
        pid = os.fork()
        if pid == 0:
            _run_child(name, mutant.kills, log)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        text = log.read_text(errors="replace")
        results[name] = {"exit": code, "tail": "\n".join(text.splitlines()[-12:])}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
