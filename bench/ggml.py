"""Benchmark (not a test): SmolLM2-135M decode on onert with fp32, GGML_Q8_0 and GGML_Q4_0
weights, at NUM_THREADS=1 and 2, and the files' sizes.

    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/none
    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/q8_0 --quantize q8_0
    python -m circleops.cli convert smollm2 --graphs prefill,decode --target onert -o /tmp/smol/q4_0 --quantize q4_0
    python bench/ggml.py /tmp/smol/none /tmp/smol/q8_0 /tmp/smol/q4_0 --steps 30

One onert session per (directory, thread count), each created with its NUM_THREADS
(onert reads it from the environment when a session is made). Then one decode step of
each session in turn, round after round (interleaved, so load from other processes falls
on all alike), and the median ms per step. The caches are the real ones: each session
keeps feeding its own new caches back, at consecutive positions after a common prefill.
Prints the load average before and after.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="directories written by convert --graphs (fp32 first)")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per session (default 30)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="NUM_THREADS values (default 1 2)")
    args = ap.parse_args(argv)

    import numpy as np

    from circleops.generate import Generator
    from circleops.manifest import read_manifest

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
                             "bytes": _size(Path(d), manifest), "quantize": manifest.quantize or "fp32"})
    for _ in range(args.steps):
        for s in sessions:
            t = time.perf_counter()
            logits = s["gen"].decode(s["token"])
            s["times"].append(time.perf_counter() - t)
            s["token"] = int(np.argmax(logits))
    load_after = os.getloadavg()

    base = {s["threads"]: statistics.median(s["times"]) for s in sessions if s["dir"] == args.dirs[0]}
    fp32_bytes = sessions[0]["bytes"]
    print(f"SmolLM2-135M decode on onert, median of {args.steps} interleaved steps; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after ({os.cpu_count()} cores)\n")
    print("| weights | NUM_THREADS | ms/token | vs fp32 (same threads) | files | vs fp32 |")
    print("|---|---|---|---|---|---|")
    for s in sessions:
        ms = statistics.median(s["times"]) * 1e3
        print(f"| {s['quantize']} | {s['threads']} | {ms:.1f} | {ms / (base[s['threads']] * 1e3):.2f}x | "
              f"{s['bytes'] / 1e6:.0f} MB | {s['bytes'] / fp32_bytes:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
