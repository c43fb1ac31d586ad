"""Benchmark (not a test): how long the hostile-file refusals take, the timings that
tests/fuzz once asserted (issue 25: the tests now bound work and memory instead).

    python bench/hostile_refusals.py [--repeat 5]

Prints, per case, the best of --repeat wall times: the reader refusing an amplification bomb
(20000 subgraphs sharing one operator table) and the reference interpreter refusing ops whose
constants ask for ~2^40 elements (tests/fuzz/test_alloc_budget.py's VALUES table).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in ("fuzz", "")]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        try:
            fn()
        except Exception:  # noqa: BLE001 - the refusal is what is timed
            pass
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import fuzz
    import test_alloc_budget as alloc

    from circleops.runtime import reference
    from circleops.serialize import read_model

    os.environ.pop("CIRCLEOPS_MAX_TENSOR_BYTES", None)
    with tempfile.TemporaryDirectory() as tmp:
        seeds = {s.name: s for s in fuzz.build_seeds(Path(tmp))}
        for fmt in ("circle", "tflite"):
            path = Path(tmp) / f"bomb.{fmt}"
            path.write_bytes(fuzz._bomb(seeds[f"tiny_{fmt}"].data, fmt, 20000))
            print(f"amplification bomb ({fmt}, {path.stat().st_size} bytes): {best(lambda: read_model(path), args.repeat) * 1e3:.1f} ms")
    for opcode, (feeds, consts, options) in alloc.VALUES.items():
        model = alloc._model(opcode, feeds, consts, options)
        print(f"{opcode} asking for ~2^40 elements: {best(lambda: reference.run(model, feeds), args.repeat) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
