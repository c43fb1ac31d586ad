"""Benchmark (not a test): where one decode step's time goes on onert, per operator type.

    python bench/onert_trace.py /tmp/smol/q4_0 [/tmp/smol/none ...] --steps 5

For each directory written by ``convert --graphs prefill,decode --target onert``: a child
process runs a prefill and ``--steps`` decode steps with onert's tracing on (TRACING_MODE=1,
NUM_THREADS=1 unless set, the trace in a temporary WORKSPACE_DIR); the decode graph's
per-operator latencies (its session's "Running count" sections of trace.table.md, the first
run left out): each operator's median over the steps, summed by operator type. The total is the time in
kernels; a step's wall time adds onert's executor and the Python calls around it.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = """
import sys
import numpy as np
from circleops.generation.generator import Generator
gen = Generator(sys.argv[1], runtime="onert")
token = int(np.argmax(gen.prefill([1, 9690, 2692, 253, 655, 28])))
for _ in range(int(sys.argv[2])):
    token = int(np.argmax(gen.decode(token)))
"""
_SECTION = re.compile(r"# Session: (\d+), Subgraph: \d+, Running count: (\d+)")
_OP = re.compile(r"\| \$\d+ subgraph @(\d+) (\S+) \| \w+ \| (\d+) \|")


def decode_breakdown(table: str, session: str | None = None) -> tuple[dict[str, float], int, int]:
    """({op type: ms per run}, ops per run, runs) of ``session`` in trace.table.md text
    (None: the decode graph's, the last session the Generator opens: onert numbers sessions
    in creation order, and with several prefill graphs, the default 64,8, decode is not 1).

    Each operator's latency is its median over the runs, then summed by type: on a shared
    machine a preemption inflates a few operators of one run, not the median of each."""
    if session is None:
        session = max((m.group(1) for m in _SECTION.finditer(table)), key=int)
    per_op: dict[str, list[int]] = collections.defaultdict(list)
    kind: dict[str, str] = {}
    runs, current = 0, False
    for line in table.splitlines():
        m = _SECTION.match(line)
        if m:
            current = m.group(1) == session and m.group(2) != "0"  # the first run pays one-off setup
            runs += current
            continue
        m = _OP.match(line)
        if m and current:
            per_op[m.group(1)].append(int(m.group(3)))
            kind[m.group(1)] = m.group(2)
    totals: dict[str, float] = collections.Counter()
    for op, latencies in per_op.items():
        totals[kind[op]] += statistics.median(latencies) / 1000
    return dict(totals), len(per_op), runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="directories written by convert --graphs prefill,decode --target onert")
    ap.add_argument("--steps", type=int, default=5, help="decode steps traced (default 5; the first is left out)")
    args = ap.parse_args(argv)
    env = dict(os.environ, TRACING_MODE="1")
    env.setdefault("NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    load_before = os.getloadavg()
    results = {}
    for d in args.dirs:
        with tempfile.TemporaryDirectory() as work:
            subprocess.run([sys.executable, "-c", _CHILD, d, str(args.steps)], cwd=work, check=True,
                           env=dict(env, WORKSPACE_DIR=work), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[d] = decode_breakdown((Path(work) / "trace.table.md").read_text())
    load_after = os.getloadavg()
    print(f"onert decode step, ms in kernels by operator type (median of {args.steps - 1} traced steps, "
          f"NUM_THREADS={env['NUM_THREADS']}); load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n")
    names = sorted({n for per, _, _ in results.values() for n in per},
                   key=lambda n: -max(per.get(n, 0.0) for per, _, _ in results.values()))
    print("| op | " + " | ".join(results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for n in names:
        if max(per.get(n, 0.0) for per, _, _ in results.values()) >= 0.05:
            print(f"| {n} | " + " | ".join(f"{per.get(n, 0.0):.2f}" for per, _, _ in results.values()) + " |")
    print("| **total in kernels** | " + " | ".join(f"**{sum(per.values()):.1f}**" for per, _, _ in results.values()) + " |")
    print("| operators | " + " | ".join(str(ops) for _, ops, _ in results.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
