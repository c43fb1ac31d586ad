"""Resident memory of one `circleops convert ... --graphs` per stage (issue 32: who holds the peak).

Runs the command as a child (without --quiet: its stage lines on stderr are the clock), and
every 0.2 s reads /proc/PID/status of the command and of each of its descendants (the verify
runtime's child): anonymous (RssAnon: torch tensors, numpy arrays, buffers) and file-backed
(RssFile: the mapped safetensors and written files) resident bytes. Prints per stage the
largest of each, and the whole run's peak (the command's RSS plus its children's at one instant,
and the largest single process, which is what `/usr/bin/time` and os.wait4 call the peak).
The verify child is forked: its RSS counts the parent's resident pages it shares
(copy-on-write), so the RSS sum counts them twice; the proportional set size (Pss, from
/proc/PID/smaps_rollup: a shared page split between its sharers) summed over the processes
is what the machine holds for the run at once, the "pss" column.

    python bench/convert_memory.py -- /work/models/llama-3.2-1b-shape --graphs prefill,decode \
        --target onert --quantize q4_0 --verify -o /tmp/out-1b
    python bench/convert_memory.py --yaml /tmp/mem.yaml -- MODEL --graphs ... (the table as YAML rows too)

Holds /tmp/big-model.lock while it runs (one big conversion on the machine at a time).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

GB = 1e9


def _status(pid: int) -> dict[str, int]:
    """RssAnon / RssFile / RssShmem / VmRSS of ``pid`` in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem", "VmRSS"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _pss(pid: int) -> int:
    """Pss of ``pid`` in bytes (0 once it is gone): its private pages and its share of shared ones."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                todo += kids
        except OSError:
            continue
    return found


class Sampler:
    """The stage the command is in (its last stderr line) and, per stage, the peaks."""

    def __init__(self, pid: int):
        self.pid = pid
        self.stage = "start"
        self.order: list[str] = []
        self.peaks: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()

    def enter(self, stage: str) -> None:
        with self.lock:
            self.stage = stage
            if stage not in self.peaks:
                self.order.append(stage)
                self.peaks[stage] = {}

    def sample(self) -> None:
        main = _status(self.pid)
        kid_ids = _children(self.pid)
        kids = [_status(k) for k in kid_ids]
        row = {"anon": main.get("RssAnon", 0), "file": main.get("RssFile", 0), "rss": main.get("VmRSS", 0),
               "child": max([k.get("VmRSS", 0) for k in kids], default=0),
               "sum": main.get("VmRSS", 0) + sum(k.get("VmRSS", 0) for k in kids),
               "pss": _pss(self.pid) + sum(_pss(k) for k in kid_ids)}
        with self.lock:
            if self.stage not in self.peaks:
                self.order.append(self.stage)
                self.peaks[self.stage] = {}
            peak = self.peaks[self.stage]
            for k, v in row.items():
                peak[k] = max(peak.get(k, 0), v)


def run(cmd: list[str]) -> tuple[Sampler, int, float, float, int]:
    """Run ``cmd`` sampled: (sampler, exit code, wall seconds, CPU seconds of it and its children,
    ru_maxrss in bytes: the largest resident set of it or a child it waited for, between samples too)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            sampler.sample()
            time.sleep(0.2)
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    for line in proc.stderr:
        sys.stderr.write(line)
        if line.startswith("circleops: "):
            sampler.enter(line[len("circleops: "):].strip()[:60])
    _, status, usage = os.wait4(proc.pid, 0)
    done.set()
    thread.join()
    return (sampler, os.waitstatus_to_exitcode(status), time.perf_counter() - t, usage.ru_utime + usage.ru_stime,
            usage.ru_maxrss * 1024)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yaml", help="write the per-stage rows here")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then circleops convert's arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cmd = [sys.executable, "-m", "circleops.cli", "convert", *args]
    with open("/tmp/big-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        load = os.getloadavg()
        sampler, code, wall, cpu, maxrss = run(cmd)
    rows = []
    keys = ("anon", "file", "rss", "child", "sum", "pss")
    print(f"{'stage':60s} " + " ".join(f"{k:>7s}" for k in keys) + "  (GB)")
    for stage in sampler.order:
        p = sampler.peaks[stage]
        if not p:
            continue
        rows.append([stage, *(round(p.get(k, 0) / GB, 2) for k in keys)])
        print(f"{stage:60s} " + " ".join(f"{v:7.2f}" for v in rows[-1][1:]))
    peak_sum = max(p.get("sum", 0) for p in sampler.peaks.values() if p) / GB
    peak_one = max(max(p.get("rss", 0), p.get("child", 0)) for p in sampler.peaks.values() if p) / GB
    peak_pss = max(p.get("pss", 0) for p in sampler.peaks.values() if p) / GB
    print(f"exit {code}; wall {wall:.0f} s, CPU {cpu:.0f} s; peak of one process {peak_one:.2f} GB, of the command "
          f"and its children at once {peak_sum:.2f} GB RSS, {peak_pss:.2f} GB Pss; ru_maxrss {maxrss / GB:.2f} GB; "
          f"load {load[0]:.1f} at the start")
    if a.yaml:
        import yaml

        Path(a.yaml).write_text(yaml.safe_dump({
            "command": " ".join(["circleops", "convert", *args]), "exit": code, "wall_s": round(wall),
            "cpu_s": round(cpu), "peak_one_gb": round(peak_one, 2), "peak_sum_gb": round(peak_sum, 2),
            "peak_pss_gb": round(peak_pss, 2), "maxrss_gb": round(maxrss / GB, 2),
            "load": round(load[0], 1), "columns": ["stage", *keys], "rows": rows},
            sort_keys=False))
    return code


if __name__ == "__main__":
    sys.exit(main())
