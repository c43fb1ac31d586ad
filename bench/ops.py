"""Eager speed of circle::rms_norm against HF's LlamaRMSNorm and torch.nn.functional.rms_norm.

    python bench/ops.py [--threads N] [--rounds R] [--clock cpu|wall] [--grad]

All three compute the same thing (circle::rms_norm is bit-equal to LlamaRMSNorm). Each
round times a short block of calls of every candidate in turn, so load from other
processes hits them alike; the best block per candidate is reported, as time per call and
as a ratio to the HF module. By default the clock is the process CPU time on one thread:
on a shared machine wall time mostly measures the scheduler. glibc's heap trimming makes
the MB-sized temporaries page-fault on every call or never, depending on the heap layout
the previous calls left (a 2-4x swing at [1, 128, 4096]); by default the trim and mmap
thresholds are pinned (mallopt) so that the candidates are compared on compute and
dispatch, not on allocator luck (--malloc default to leave glibc alone). Target:
circle::rms_norm within 1.2x of LlamaRMSNorm.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time
from typing import Callable

import torch

import circleops.ops  # noqa: F401  (registers torch.ops.circle.*)

SHAPES = ((1, 128, 4096), (8, 512, 2048))
DTYPES = (torch.float32, torch.bfloat16)
EPS = 1e-6


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def pin_malloc(limit: int = 1 << 30) -> bool:
    """Keep freed memory in glibc's heap (no trim, no per-allocation mmap). False if not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return bool(libc.mallopt(_M_TRIM_THRESHOLD, limit)) and bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20))
    except (OSError, AttributeError):
        return False


def _block_seconds(fn: Callable[[], torch.Tensor], calls: int, clock: Callable[[], float]) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def measure(candidates: dict[str, Callable[[], torch.Tensor]], rounds: int, clock: Callable[[], float] = time.process_time,
            budget_s: float = 0.01) -> dict[str, float]:
    """Best seconds per call of each candidate, interleaved over ``rounds`` rounds."""
    for fn in candidates.values():  # warm up, and size the blocks to ~budget_s each
        fn()
    calls = {name: max(1, int(budget_s / max(_block_seconds(fn, 3, time.perf_counter), 1e-7)))
             for name, fn in candidates.items()}
    best = {name: float("inf") for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            best[name] = min(best[name], _block_seconds(fn, calls[name], clock))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default: 1)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="cpu", help="process CPU time (default) or wall time")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--malloc", choices=("pinned", "default"), default="pinned",
                        help="pin glibc's trim/mmap thresholds (default) or leave them alone")
    parser.add_argument("--grad", action="store_true", help="run with autograd on (weights require grad), as in training")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pinned = args.malloc == "pinned" and pin_malloc()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {'grad' if args.grad else 'no_grad'}, "
          f"{args.clock} clock, malloc {'pinned' if pinned else 'default'}, best of {args.rounds} interleaved rounds")
    print(f"{'dtype':9} {'shape':15} {'HF LlamaRMSNorm':>16} {'circle::rms_norm':>17} {'F.rms_norm':>12}   circle/HF  F/HF")
    worst = 0.0
    for dtype in DTYPES:
        for shape in SHAPES:
            hidden = shape[-1]
            hf = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
            with torch.no_grad():
                hf.weight.uniform_(0.5, 1.5)
            hf.weight.requires_grad_(args.grad)
            x = torch.randn(*shape, dtype=dtype)
            w = hf.weight
            candidates = {
                "hf": lambda: hf(x),
                "circle": lambda: torch.ops.circle.rms_norm(x, w, EPS),
                "F": lambda: torch.nn.functional.rms_norm(x, (hidden,), w, EPS),
            }
            with torch.set_grad_enabled(args.grad):
                assert torch.equal(candidates["circle"](), candidates["hf"]()), "circle::rms_norm must equal LlamaRMSNorm"
                t = measure(candidates, args.rounds, CLOCKS[args.clock])
            ratio = t["circle"] / t["hf"]
            worst = max(worst, ratio)
            print(f"{str(dtype)[6:]:9} {str(list(shape)):15} {t['hf'] * 1e6:13.0f} us {t['circle'] * 1e6:14.0f} us "
                  f"{t['F'] * 1e6:9.0f} us   {ratio:8.2f}x {t['F'] / t['hf']:5.2f}x")
    print(f"worst circle/HF ratio: {worst:.2f}x (target <= 1.2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
