"""Benchmark (not a test): where SmolLM2's time to first token goes with circleops on onert.

    python bench/llm_profile.py /tmp/circleops-llm-speed/onert-fp32 [more dirs] --prompts 5 300
    python bench/llm_profile.py DIR --part python         # only the Python side (no tracing)

Two parts, for each directory written by ``circleops convert smollm2 --graphs prefill,decode
--target onert``:

* **kernels** (``--part trace``): a child process runs the Generator's prefill of each
  --prompts length (--runs times, the first left out) and --runs decode steps with onert's
  own tracing on (TRACING_MODE=1, NUM_THREADS=--threads, trace.table.md in a temporary
  WORKSPACE_DIR). Per graph (onert numbers its sessions in creation order: the Generator
  opens the prefill graphs longest first, then decode): the session's run latency as onert
  measured it, the time in its kernels and the time between them (per run, from
  trace.chrome.json: onert's executor, and on a loaded machine preemptions), and the time in
  kernels by operator type (each operator's median over the runs, summed by type) for the
  shares. Also the wall time of the same Generator calls in the same process: the
  difference between that and onert's run latency is circleops' Python side (input checks,
  set_input/get_output, stderr capture, the cache rows written back).
* **python** (``--part python``): the Generator's own cost per call with onert replaced by a
  session that does nothing (returns preallocated outputs of the graph's shapes): what a
  prefill and a decode step cost before any kernel runs; and the cost of the pieces
  circleops.runtime.onert.Session.run wraps around onert's run (its fd-2 capture, per call).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("The lighthouse keeper counted the ships that passed the harbour, wrote their names in a ledger "
        "and watched the weather turn. ")

_CHILD = """
import json, sys, time
from circleops.generation.generator import Generator
from circleops.sources.models import smollm2_dir
from transformers import AutoTokenizer
d, runs, prompts = sys.argv[1], int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")]
text = sys.argv[4]
ids = [int(i) for i in AutoTokenizer.from_pretrained(str(smollm2_dir()))(text * 40)["input_ids"]]
gen = Generator(d, runtime="onert")
order = list(gen.manifest.prefill_graphs.values()) + ["decode"]  # the sessions' creation order
walls = {}
for n in prompts:
    w = []
    for _ in range(runs):
        t = time.perf_counter(); gen.prefill(ids[:n]); w.append(time.perf_counter() - t)
    walls[f"prefill {n}"] = w[1:]
gen.prefill(ids[:5]); token = 1; w = []
for _ in range(runs):
    t = time.perf_counter(); token = int(gen.decode(token).argmax()); w.append(time.perf_counter() - t)
walls["decode"] = w[1:]
print(json.dumps({"order": order, "walls": walls, "chunks": {n: gen.plan(0, n) for n in prompts}}))
"""
_SECTION = re.compile(r"# Session: (\d+), Subgraph: \d+, Running count: (\d+)")
_TOTAL = re.compile(r"\| (\d+) \| \d+ \| \d+ \| \d+ \| \d+ \|")
_OP = re.compile(r"\| \$\d+ subgraph @(\d+) (\S+) \| \w+ \| (\d+) \|")


def sessions_breakdown(table: str) -> dict[str, dict]:
    """{session: {"runs": n, "run_ms": [each run's latency], "ops": {op type: ms per run},
    "n_ops": ops per run}} from trace.table.md text, the first run of each session left out
    (it pays one-off preparation). An operator's latency is its median over the runs, then
    summed by type: a preemption on a shared machine inflates a few operators of one run, not
    the median of each."""
    per_op: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    kind: dict[str, dict[str, str]] = collections.defaultdict(dict)
    run_us: dict[str, list[int]] = collections.defaultdict(list)
    session, current, want_total = None, False, False
    for line in table.splitlines():
        m = _SECTION.match(line)
        if m:
            session, current, want_total = m.group(1), m.group(2) != "0", m.group(2) != "0"
            continue
        if not current:
            continue
        m = _OP.match(line)
        if m:
            per_op[session][m.group(1)].append(int(m.group(3)))
            kind[session][m.group(1)] = m.group(2)
            continue
        m = _TOTAL.match(line)
        if m and want_total:
            run_us[session].append(int(m.group(1)))
            want_total = False
    out = {}
    for s, ops in per_op.items():
        totals: dict[str, float] = collections.Counter()
        for op, lat in ops.items():
            totals[kind[s][op]] += statistics.median(lat) / 1000
        out[s] = {"runs": len(run_us[s]), "run_ms": [u / 1000 for u in run_us[s]], "ops": dict(totals),
                  "n_ops": len(ops)}
    return out


def run_breakdown(events: list[dict]) -> dict[str, dict[str, list[float]]]:
    """{session: {"run_ms", "kernel_ms", "between_ms": one value per run}} from onert's
    trace.chrome.json events, the first run of each session left out: a run's span, the sum
    of its operators' spans, and the rest (onert's executor between kernels: shape
    inference, allocation, and on a loaded machine the preemptions that fall between them)."""
    out: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    seen: collections.Counter = collections.Counter()
    start: dict[str, int] = {}
    kernels: dict[str, int] = {}
    op_start: dict[str, int] = {}
    for e in events:
        name, session, ts = e.get("name", ""), e.get("args", {}).get("session"), int(e.get("ts", 0))
        if session is None:
            continue
        if name.startswith("$"):  # the subgraph's span: one run
            if e["ph"] == "B":
                start[session], kernels[session] = ts, 0
            elif session in start:
                if seen[session]:
                    run = ts - start[session]
                    out[session]["run_ms"].append(run / 1000)
                    out[session]["kernel_ms"].append(kernels[session] / 1000)
                    out[session]["between_ms"].append((run - kernels[session]) / 1000)
                seen[session] += 1
        elif name.startswith("@") and session in start:
            if e["ph"] == "B":
                op_start[session] = ts
            else:
                kernels[session] += ts - op_start[session]
    return out


def trace(d: str, prompts: list[int], runs: int, threads: int) -> dict:
    """Trace one directory in a child process; per graph, what onert's run of it is made of."""
    env = dict(os.environ, TRACING_MODE="1", NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as work:
        proc = subprocess.run([sys.executable, "-c", _CHILD, d, str(runs), ",".join(map(str, prompts)), TEXT],
                              cwd=work, check=True, env=dict(env, WORKSPACE_DIR=work), capture_output=True, text=True)
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        sessions = sessions_breakdown((Path(work) / "trace.table.md").read_text())
        spans = run_breakdown(json.loads((Path(work) / "trace.chrome.json").read_text())["traceEvents"])
    for s, b in sessions.items():
        b.update(spans.get(s, {}))
    return {"graphs": {info["order"][int(s)]: b for s, b in sessions.items()}, "walls": info["walls"],
            "chunks": info["chunks"]}


class NoOpSession:
    """Stands for an onert session: returns preallocated outputs of the graph's shapes."""

    def __init__(self, session):
        import numpy as np

        self.inputs_spec = session.inputs
        self.outs = [np.zeros([max(1, int(x)) for x in s.shape], dtype=s.dtype) for s in session.outputs]

    @property
    def inputs(self):
        return self.inputs_spec

    def run(self, inputs):
        return self.outs


def python_side(d: str, calls: int) -> dict:
    """ms per Generator call with onert's runs replaced by NoOpSession, and the per-run cost of
    circleops.runtime.onert.Session.run's fd-2 capture."""
    from circleops.generation.generator import Generator
    from circleops.runtime.onert import captured_stderr

    gen = Generator(d, runtime="onert")
    gen.prefill_sessions = {n: NoOpSession(s) for n, s in gen.prefill_sessions.items()}
    gen.decode_session = NoOpSession(gen.decode_session)
    out = {}
    for n in (5, 300):
        ids = list(range(10, 10 + n))
        gen.prefill(ids)
        t = time.perf_counter()
        for _ in range(calls):
            gen.prefill(ids)
        out[f"prefill {n} ms"] = 1000 * (time.perf_counter() - t) / calls
    gen.prefill([10, 11, 12])
    t = time.perf_counter()
    for _ in range(calls):
        gen.decode(5)
        gen.history.pop()  # stay at the same position
    out["decode step ms"] = 1000 * (time.perf_counter() - t) / calls
    t = time.perf_counter()
    for _ in range(calls):
        with captured_stderr():
            pass
    out["fd-2 capture ms per run"] = 1000 * (time.perf_counter() - t) / calls
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--prompts", type=int, nargs="+", default=[5, 300])
    ap.add_argument("--runs", type=int, default=4, help="runs of each prefill and decode (the first left out)")
    ap.add_argument("--threads", type=int, default=1, help="NUM_THREADS for the traced child")
    ap.add_argument("--part", choices=["trace", "python", "both"], default="both")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    results: dict = {"load_before": round(os.getloadavg()[0], 1)}
    for d in args.dirs:
        r = results[d] = {}
        if args.part in ("python", "both"):
            r["python"] = python_side(d, 50)
            print(f"{d}: the Generator's Python side, onert stubbed: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in r["python"].items()), flush=True)
        if args.part in ("trace", "both"):
            r["trace"] = t = trace(d, args.prompts, args.runs, args.threads)
            print(f"\n{d}, NUM_THREADS={args.threads}: chunks {t['chunks']}; walls (s) "
                  + "; ".join(f"{k}: {statistics.median(v):.3f}" for k, v in t["walls"].items()))
            for g, b in t["graphs"].items():
                kernels = sum(b["ops"].values())
                med = {k: statistics.median(b[k]) if b.get(k) else float("nan") for k in ("run_ms", "kernel_ms", "between_ms")}
                print(f"  {g}: {b['runs']} runs, {b['n_ops']} ops; per run (medians): onert run {med['run_ms']:.1f} ms, "
                      f"in kernels {med['kernel_ms']:.1f} ms, between kernels {med['between_ms']:.1f} ms")
                for op, ms in sorted(b["ops"].items(), key=lambda kv: -kv[1]):
                    if ms >= 0.01 * kernels:
                        print(f"    {op:<16} {ms:8.2f} ms {100 * ms / kernels:5.1f} %")
    results["load_after"] = round(os.getloadavg()[0], 1)
    print(f"\nload average {results['load_before']} before, {results['load_after']} after")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
