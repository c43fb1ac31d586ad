"""Benchmark (not a test): does a longer onert prefill graph shorten a long prompt?

Only onert's CONV_2D uses a second thread, and only from ~256 rows (docs/benchmarks.md,
bench/onert_matmul.py), so a 256-row prefill graph might let a 300-token prompt use both
cores. Converts SmolLM2 for onert twice (the default ``--seq-len 64,8`` and ``256,64,8``),
then times the first token of the same 300-token prompt through the Generator at 1 and 2
threads, each (directory, threads) a fresh process, interleaved over rounds:

    python bench/onert_prefill_rows.py --work /tmp/onert-rows --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FORMS = {"64,8 (default)": "64,8", "256,64,8": "256,64,8"}

_CHILD = r"""
import json, sys, time
import numpy as np
from circleops.generation.generator import Generator
gen = Generator(sys.argv[1], threads=int(sys.argv[2]))
prompt = [int(x) for x in np.random.RandomState(0).randint(100, 40000, size=300)]
wall, cpu = [], []
for _ in range(int(sys.argv[3])):
    t0, c0 = time.perf_counter(), time.process_time()
    first = gen.generate(prompt, 1).tokens[0]
    wall.append(time.perf_counter() - t0); cpu.append(time.process_time() - c0)
print(json.dumps({"wall_ms": 1e3 * sorted(wall)[len(wall) // 2], "cpu_ms": 1e3 * sorted(cpu)[len(cpu) // 2],
                  "first": int(first)}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/onert-rows")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=4, help="TTFTs per child (their median)")
    args = p.parse_args(argv)
    work = Path(args.work)
    for name, seq in FORMS.items():
        d = work / seq.replace(",", "-")
        if not (d / "manifest.json").exists():
            subprocess.run(["circleops", "convert", "smollm2", "--graphs", "prefill,decode", "--target", "onert",
                            "--seq-len", seq, "-o", str(d)], check=True)
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for threads in (1, 2):
            for name, seq in FORMS.items():
                out = subprocess.run([sys.executable, "-c", _CHILD, str(work / seq.replace(",", "-")), str(threads),
                                      str(args.reps)], capture_output=True, text=True, check=True)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                results.setdefault((name, threads), []).append(row)
                print(f"round {r} {name:>15} t{threads}: {row}", flush=True)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print("| --seq-len | threads | TTFT 300 ms (per round) | CPU ms (per round) | first token |")
    print("|:---|---:|---:|---:|---:|")
    for (name, threads), rows in results.items():
        wall = ", ".join(f"{x['wall_ms']:.0f}" for x in rows)
        cpu = ", ".join(f"{x['cpu_ms']:.0f}" for x in rows)
        print(f"| {name} | {threads} | {wall} | {cpu} | {rows[0]['first']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
