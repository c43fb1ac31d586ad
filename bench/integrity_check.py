"""Benchmark (not a test): what circleops' integrity check of a file costs (issue 24).

    python bench/integrity_check.py                          # SmolLM2's onert graphs, converted once into --dir
    python bench/integrity_check.py --dir /tmp/verify_smol --rounds 7

1. ``check_file`` on each graph of the directory: the first call of a fresh process (the
   table layouts read from the generated bindings, once per process; the bindings already
   imported, as they are when a runtime Session checks a file) and the median of --rounds warm calls.
2. Time to first token as ``circleops generate`` gets it: ``Generator(dir)`` (one onert
   session per graph, each checked first) + ``generate(prompt, max_new_tokens=1)``, with
   the check and with it stubbed out, alternating, medians of --rounds. The difference
   should be the check's cost (part 1) times the number of graphs, nothing more.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_COLD = """
import sys, time
from circleops.serialize.schema import get_schema
get_schema("circle").opnames; get_schema("circle").reader_cls("Model")  # what a Session has loaded
from circleops.serialize import integrity
t, c = time.perf_counter(), time.process_time(); integrity.check_file(sys.argv[1])
print(time.perf_counter() - t, time.process_time() - c)
"""


def cold_ms(path: Path) -> tuple[float, float]:
    """The first check_file of a fresh process: wall and CPU ms (medians of 3 processes)."""
    runs = [subprocess.run([sys.executable, "-c", _COLD, str(path)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()[-2:] for _ in range(3)]
    return (statistics.median(float(r[0]) for r in runs) * 1e3, statistics.median(float(r[1]) for r in runs) * 1e3)


def warm_ms(path: Path, rounds: int) -> tuple[float, float, int]:
    """Warm check_file calls: median wall and CPU ms, and the tables walked."""
    from circleops.serialize.integrity import check_file

    info = check_file(path)
    wall, cpu = [], []
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        check_file(path)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3, info.tables


def first_token(directory: Path, rounds: int, prompt: list[int]) -> tuple[float, float]:
    """Median seconds of Generator(dir) + one token, with and without the integrity check."""
    import circleops.runtime.onert as onert_module
    from circleops.generation.generator import Generator
    from circleops.serialize.integrity import check_file

    real = onert_module.check_file
    checked = {}

    def stub(path):  # the same answer, without the walk
        if path not in checked:
            checked[path] = real(path)
        return checked[path]

    def once() -> float:
        t = time.perf_counter()
        gen = Generator(directory)
        gen.generate(prompt, max_new_tokens=1)
        return time.perf_counter() - t

    onert_module.check_file = stub
    once()  # warm-up: page cache, onert's libraries, the stub's answers
    onert_module.check_file = check_file
    once()
    with_v, without = [], []
    try:
        for _ in range(rounds):
            onert_module.check_file = check_file
            with_v.append(once())
            onert_module.check_file = stub
            without.append(once())
    finally:
        onert_module.check_file = real
    return statistics.median(with_v), statistics.median(without)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/verify_smol"),
                        help="graphs of `circleops convert smollm2 --graphs prefill,decode --target onert` "
                             "(converted there when missing)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-ttft", action="store_true", help="only the check's own cost")
    args = parser.parse_args()
    if not (args.dir / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "circleops.cli", "convert", "smollm2", "--graphs", "prefill,decode",
                        "--target", "onert", "-o", str(args.dir)], check=True)
    os.environ.setdefault("NUM_THREADS", "1")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for path in sorted(args.dir.glob("*.circle")):
        warm, warm_cpu, tables = warm_ms(path, args.rounds)
        cold, cold_cpu = cold_ms(path)
        print(f"{path.name}: {path.stat().st_size / 1e6:.0f} MB, {tables} tables: first call in a process "
              f"{cold:.1f} ms ({cold_cpu:.1f} ms CPU), then {warm:.1f} ms ({warm_cpu:.1f} ms CPU; median of "
              f"{args.rounds})")
    if not args.no_ttft:
        with_v, without = first_token(args.dir, args.rounds, list(range(1, 21)))
        graphs = len(list(args.dir.glob("*.circle")))
        print(f"Generator + first token (20-token prompt, {graphs} graphs): checked {with_v * 1e3:.0f} ms, "
              f"unchecked {without * 1e3:.0f} ms, difference {(with_v - without) * 1e3:+.0f} ms")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
