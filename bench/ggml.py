"""Benchmark (not a test): SmolLM2-135M decode on onert with fp32, GGML_Q8_0 and GGML_Q4_0
weights (or any --quantize, e.g. w8's int8 hybrid weights), at NUM_THREADS=1 and 2, and the
files' sizes.

    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/none
    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/q8_0 --quantize q8_0
    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/q4_0 --quantize q4_0
    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/w8 --quantize w8
    python bench/ggml.py /tmp/smol/none /tmp/smol/q8_0 /tmp/smol/q4_0 --steps 30
    python bench/ggml.py /tmp/smol/none /tmp/smol/w8 --steps 40 --prefill 15   # any CPU (no AVX-512)

One onert session per (directory, thread count), each created with its NUM_THREADS
(onert reads it from the environment when a session is made). Then one decode step of
each session in turn, round after round (interleaved, so load from other processes falls
on all alike), and the median ms per step. The caches are the real ones: each session
keeps feeding its own new caches back, at consecutive positions after a common prefill.
Prints the load average before and after.

Ratios are against the fp32 directory listed last before each row, so one interleaved run
can compare two builds: ``old/none old/q8_0 old/q4_0 new/none new/q8_0 new/q4_0``. The
"cache" column is the manifest's form: "full" (version-1 directories: whole caches out and
back in) or "rows" (only the new k/v rows out, written into the Generator's caches in place;
"heads": head-major caches, none transposed per step).
``--prefill N`` also times N prefill runs per session (the graph's whole length, from a
zero cache), interleaved the same way.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def _size(directory: Path, manifest) -> int:
    return sum((directory / f).stat().st_size for f in set(manifest.files.values()))


def _cache_form(manifest) -> str:
    from circleops.options import HEAD_MAJOR

    return manifest.cache_update + (", heads" if manifest.cache_layout == HEAD_MAJOR else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="directories written by convert --graphs (fp32 first)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per session (default 30)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="NUM_THREADS values (default 1 2)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N", help="also time N prefill runs per session")
    args = ap.parse_args(argv)

    import numpy as np

    from circleops.generation.generator import Generator
    from circleops.package.manifest import read_manifest

    load_before = os.getloadavg()
    sessions = []
    prompt = [1, 9690, 2692, 253, 655, 28]  # "Once upon a time," in SmolLM2's vocabulary (any ids do)
    for d in args.dirs:
        manifest = read_manifest(d)
        for n in args.threads:
            os.environ["NUM_THREADS"] = str(n)
            gen = Generator(manifest, runtime="onert")
            logits = gen.prefill(prompt)
            sessions.append({"dir": d, "threads": n, "gen": gen, "token": int(np.argmax(logits)), "times": [],
                             "bytes": _size(Path(d), manifest), "quantize": manifest.quantize or "fp32",
                             "prefill": [], "length": manifest.prefill_len, "cache": _cache_form(manifest)})
    for _ in range(args.steps):
        for s in sessions:
            t = time.perf_counter()
            logits = s["gen"].decode(s["token"])
            s["times"].append(time.perf_counter() - t)
            s["token"] = int(np.argmax(logits))
    for _ in range(args.prefill):
        for s in sessions:
            ids = [1 + (k * 7919) % 40000 for k in range(s["length"])]  # any ids: the whole graph length
            s["gen"].reset()
            t = time.perf_counter()
            s["gen"].prefill(ids)
            s["prefill"].append(time.perf_counter() - t)
    load_after = os.getloadavg()

    print(f"SmolLM2-135M decode on onert, median of {args.steps} interleaved steps; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)\n")
    head = "| dir | weights | cache | NUM_THREADS | ms/token | vs fp32 (same threads) | files | vs fp32 |"
    if args.prefill:
        head += " prefill ms (length) |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    base: dict[int, tuple[float, int]] = {}  # threads -> (fp32 ms, fp32 bytes) of the last fp32 dir
    for s in sessions:
        ms = statistics.median(s["times"]) * 1e3
        if s["quantize"] == "fp32":
            base[s["threads"]] = (ms, s["bytes"])
        ref_ms, ref_bytes = base.get(s["threads"], (float("nan"), 0))
        row = (f"| {s['dir']} | {s['quantize']} | {s['cache']} | {s['threads']} | {ms:.1f} | {ms / ref_ms:.2f}x | "
               f"{s['bytes'] / 1e6:.0f} MB | {s['bytes'] / ref_bytes if ref_bytes else float('nan'):.2f}x |")
        if args.prefill:
            row += f" {statistics.median(s['prefill']) * 1e3:.0f} ({s['length']}) |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
