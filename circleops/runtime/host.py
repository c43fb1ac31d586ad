"""Can this machine's CPU run what a file asks of onert?

onert 0.1.0's wheel links ggml into its CPU backend compiled for AVX-512: on a CPU without
it, the first FULLY_CONNECTED with GGML_Q4_0 / GGML_Q8_0 weights stops the whole process
with SIGILL ("Illegal instruction"), which no Python code can catch. Measured on an AMD
EPYC with AVX2 only (2026-12-01): ``ggml_graph_plan`` executes ``vmovdqu8 %ymm0`` (EVEX:
AVX512BW+VL) and the kernels use ``vextractf32x8`` (AVX512DQ), zmm registers (AVX512F) and
EVEX ``vpdpbusd`` (AVX512_VNNI); fp32 files run on that CPU. So a session checks before
loading: a file with GGML tensors on a CPU without these flags is refused with a clear
error instead (the file itself is fine for a CPU that has them).
"""
from __future__ import annotations

import functools
import os
import platform

from circleops.quantize.formats import ONERT_GGML_CPU_FLAGS, host_flags, tensor_host_flags

# ONERT_GGML_CPU_FLAGS: /proc/cpuinfo flag names of the instructions found in onert 0.1.0's
# libbackend_cpu.so; the formats that need them say so in circleops.quantize.formats


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo; None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def missing_flags(needed: tuple[str, ...] | list[str]) -> list[str]:
    """The x86-64 CPU flags among ``needed`` this CPU lacks ([] when it has them, on another
    architecture, or when the flags cannot be read: then the runtime is left to try)."""
    if not needed or platform.machine().lower() not in ("x86_64", "amd64"):
        return []  # the AVX-512 build is the x86_64 wheel's
    flags = cpu_flags()
    if flags is None:
        return []
    return [f for f in needed if f not in flags]


def missing_for_onert_ggml() -> list[str]:
    """The CPU flags onert 0.1.0's GGML kernels need that this CPU lacks ([] when it can run
    them, or when the flags cannot be read: then onert is left to try)."""
    return missing_flags(ONERT_GGML_CPU_FLAGS)


def onert_ggml_refusal(path: str | os.PathLike, ggml_types: set[str] | frozenset[str]) -> str | None:
    """Why onert must not run ``path`` here (a message), or None when it can."""
    missing = missing_flags(tensor_host_flags(ggml_types, "onert")) if ggml_types else []
    if not missing:
        return None
    return (f"onert cannot run {path} on this CPU: the file holds {', '.join(sorted(ggml_types))} weights, and "
            f"onert 0.1.0's GGML kernels are compiled for AVX-512 (this CPU lacks {', '.join(missing)}), so "
            f"onert would stop the process with 'Illegal instruction'. The file is fine for a CPU with "
            f"AVX-512 VNNI. Here: run it with --runtime reference (circleops' interpreter runs GGML weights "
            f"as onert does), or convert with --quantize w8 (int8 weights onert runs on any x86-64) or "
            f"without --quantize.")


def runtime_for_host(runtime: str, default: bool, quantize: str | None, doing: str = "verify") -> tuple[str, str | None]:
    """``runtime`` if this CPU runs ``quantize``'s weights on it (the format's host
    requirements, circleops.quantize.formats), else: a ``default`` runtime gives way to the
    reference interpreter with a note; one named explicitly raises HostCPUError.
    ``doing``: "verify" or "run", for the words of the note."""
    from circleops.errors import HostCPUError

    missing = missing_flags(host_flags(quantize, runtime))
    if not missing:
        return runtime, None
    why = (f"{runtime} 0.1.0's GGML kernels are compiled for AVX-512 and this CPU lacks {', '.join(missing)} "
           f"({runtime} would stop with 'Illegal instruction')")
    if not default:
        raise HostCPUError(f"cannot {doing} {quantize} weights with {runtime} on this machine: {why}. Use the "
                           f"reference interpreter (--runtime reference), which runs GGML weights as {runtime} does, "
                           f"a CPU with AVX-512 VNNI, or convert with --quantize w8 (int8 weights onert runs on "
                           f"any x86-64).")
    done = "verified" if doing == "verify" else "running"
    return "reference", (f"{done} on circleops' reference interpreter, not {runtime}: {why}. The interpreter "
                         f"computes GGML weights as {runtime} does; the files run on {runtime} on a CPU with AVX-512 "
                         f"VNNI (for onert here: --quantize w8).")


def onert_or_reference(requested: bool | str | None, quantize: str | None, doing: str = "verify") -> tuple[str, str | None]:
    """The runtime for a target-onert file quantized as ``quantize`` on this machine
    (circleops.runtime.choose_runtime for target onert, without its format check)."""
    default = requested is True or requested is None
    return runtime_for_host("onert" if default else str(requested), default, quantize, doing)
