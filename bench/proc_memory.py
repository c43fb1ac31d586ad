"""Where a command's memory is, per process and per mapping (issue 32: the LiteRT verify child).

Runs the command (its stage lines on stderr are the clock, as for bench/convert_memory.py) and
every 0.25 s reads /proc/PID/status of it and of each descendant; when a process reaches a new
peak (by 50 MB) it also reads /proc/PID/smaps, grouped by mapping: each file mapped (the
checkpoint, the .tflite, XNNPACK's weight cache), [heap], other anonymous memory; with each
one's anonymous, shared and private-dirty bytes. A forked child's Rss counts the pages it
shares with its parent; smaps says how many. Prints every process's peak with its five largest
mappings, the largest RSS sum of the processes at one instant, and per stage the command's
largest RSS (anonymous + file-backed then) and its children's.

    flock /tmp/big-model.lock python bench/proc_memory.py --json /tmp/run.json -- \
        circleops convert /work/models/gemma-3-1b-shape --graphs prefill,decode --target tflite --verify -o OUT
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from convert_memory import _status  # RssAnon / RssFile / RssShmem / VmRSS of a pid (bench/ is sys.path[0])


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _smaps(pid: int) -> dict[str, dict[str, int]] | None:
    """Mapping name -> {Rss, Anonymous, Shared_Clean, Private_Dirty, ...} bytes (those over 20 MB)."""
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    try:
        with open(f"/proc/{pid}/smaps") as f:
            name = "[anon]"
            for line in f:
                parts = line.split()
                if "-" in parts[0] and ":" not in parts[0] and len(parts) >= 5:
                    name = parts[5] if len(parts) >= 6 else "[anon]"
                    if name.startswith("/") and "/site-packages/" in name:
                        name = "[site-packages libraries]"
                elif parts[0] in ("Rss:", "Anonymous:", "Shared_Clean:", "Shared_Dirty:", "Private_Clean:",
                                  "Private_Dirty:"):
                    groups[name][parts[0][:-1]] += int(parts[1]) * 1024
    except OSError:
        return None
    return {k: dict(v) for k, v in groups.items() if v.get("Rss", 0) > 20e6}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")[:120]
    except OSError:
        return "?"


def sample(cmd: list[str], every: float = 0.25) -> dict[str, Any]:
    """Run ``cmd`` and sample it (see the module's docstring); the samples as a dict."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1)
    stages: list[tuple[float, str]] = []

    def tee() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.startswith("circleops: "):
                stages.append((round(time.time() - t0, 1), line.strip()[len("circleops: "):]))

    threading.Thread(target=tee, daemon=True).start()
    peaks: dict[int, dict[str, Any]] = {}
    timeline: list[tuple[float, list[tuple[int, dict[str, int]]]]] = []
    sum_peak = (0, 0.0)
    while proc.poll() is None:
        now = round(time.time() - t0, 1)
        row = [(p, _status(p)) for p in _tree(proc.pid)]
        row = [(p, st) for p, st in row if st]
        for p, st in row:
            prev = peaks.get(p)
            if prev is None or st["VmRSS"] > prev["rss"] + 50e6:
                peaks[p] = dict(rss=st["VmRSS"], t=now, status=st, smaps=_smaps(p), cmd=_cmdline(p))
            elif st["VmRSS"] > prev["rss"]:
                prev.update(rss=st["VmRSS"], t=now, status=st)
        total = sum(st["VmRSS"] for _, st in row)
        if total > sum_peak[0]:
            sum_peak = (total, now)
        timeline.append((now, row))
        time.sleep(every)
    return dict(rc=proc.returncode, wall=time.time() - t0, peaks=peaks, sum_peak=sum_peak, stages=stages,
                timeline=timeline)


def report(s: dict[str, Any]) -> None:
    gb = 1e9
    for pid, v in s["peaks"].items():
        st = v["status"]
        print(f"pid {pid} peak {v['rss'] / gb:.2f} GB at {v['t']} s (anon {st['RssAnon'] / gb:.2f}, file "
              f"{st['RssFile'] / gb:.2f})  {v['cmd'][:80]}")
        for name, g in sorted((v["smaps"] or {}).items(), key=lambda kv: -kv[1].get("Rss", 0))[:5]:
            print(f"    {g.get('Rss', 0) / gb:6.2f} GB  anonymous {g.get('Anonymous', 0) / gb:.2f}  private dirty "
                  f"{g.get('Private_Dirty', 0) / gb:.2f}  {name}")
    print(f"largest sum at once {s['sum_peak'][0] / gb:.2f} GB at {s['sum_peak'][1]} s; exit {s['rc']}")
    bounds = s["stages"] + [(float("inf"), "end")]
    main = next(iter(s["peaks"]), None)

    def fmt(st: dict[str, int] | None) -> str:
        return "-" if not st else f"{st['VmRSS'] / gb:.2f} ({st['RssAnon'] / gb:.2f} + {st['RssFile'] / gb:.2f})"

    for (start, name), (end, _) in zip(bounds, bounds[1:]):
        best: dict[str, int] | None = None
        child: dict[str, int] | None = None
        for t, row in s["timeline"]:
            if not start <= t < end:
                continue
            for p, st in row:
                if p == main and (best is None or st["VmRSS"] > best["VmRSS"]):
                    best = st
                elif p != main and (child is None or st["VmRSS"] > child["VmRSS"]):
                    child = st
        print(f"{start:7.1f} s  {name:32s} command {fmt(best)}  child {fmt(child)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the samples here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("give the command after --")
    s = sample(cmd)
    report(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, default=str)
    return int(s["rc"] or 0)


if __name__ == "__main__":
    sys.exit(main())
