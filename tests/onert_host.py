"""GGML weights on onert, on whichever CPU the tests run.

onert 0.1.0's GGML kernels need AVX-512 (circleops.runtime.host): on a CPU without it,
onert would die of SIGILL, so circleops refuses the file and the defaults (verify,
generate, check) run it on the reference interpreter. Tests that run GGML files on onert
go through these helpers: on an AVX-512 machine they run onert (and the conftest checks the
interpreter against it); elsewhere they assert the clear refusal, then use the interpreter,
so every test asserts something real on both kinds of machine.
"""
from __future__ import annotations

import pytest

from circleops.errors import HostCPUError
from circleops.runtime.host import missing_for_onert_ggml

ONERT_RUNS_GGML: bool = not missing_for_onert_ggml()
# the runtime that runs (and verifies) a target-onert GGML file by default here
GGML_RUNTIME: str = "onert" if ONERT_RUNS_GGML else "reference"


def assert_onert_refuses(path) -> None:
    """onert refuses a GGML file on this CPU with the reason and what to do instead."""
    from circleops.runtime import onert

    with pytest.raises(HostCPUError, match=r"AVX-512.*--runtime reference"):
        onert.Session(path)


def run_ggml(path, inputs) -> list:
    """onert's outputs for a GGML file where this CPU runs them; elsewhere the refusal is
    asserted and the reference interpreter's outputs are returned."""
    from circleops.runtime import onert, reference

    if ONERT_RUNS_GGML:
        return onert.run(path, inputs)
    assert_onert_refuses(path)
    return reference.run(path, inputs)
