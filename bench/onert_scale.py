"""onert generation at scale: what a split costs per token, what one signature file saves, and
decode against the memory-bandwidth floor (issue 32).

    python bench/onert_scale.py --run python:/out/smol-fp32 --run python:/out/smol-fp32-split \
        --run /work/venvs/onert-dev/bin/python:/out/smol-q4-sig --new 32 --rounds 2

Each ``--run PYTHON:DIR`` is a directory written by ``circleops convert --graphs`` and the
interpreter to generate it with (the base one has onert 0.1.0; a venv with onert
0.2.0.dev250922 runs the signature files). Per round every run is a fresh child process
(interleaved, so load falls on all alike) that opens a Generator, prefills ``--ids`` and
decodes ``--new`` tokens (EOS ignored), and reports: decode ms/token, the process's CPU
seconds over the decode, its peak RSS (VmHWM), the directory's bytes, the tokens. The
parent measures a streaming read each round: numpy's sum over 1 GiB of float32 (best of 3),
GB/s, so ``floor = bytes read per decode step / that rate`` is from the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_IDS = "1,504,3458,314,253,1115,28"  # SmolLM2 ids ("Once upon a time, ..."); < any vocab here


def streaming_read_gbps(gib: float = 1.0, repeats: int = 3) -> float:
    """numpy sum of ``gib`` GiB of float32: the best of ``repeats`` runs, GB/s (one thread)."""
    import numpy as np

    a = np.ones(int(gib * (1 << 30)) // 4, dtype=np.float32)
    a.sum()  # pages in
    best = min(_timed(a.sum) for _ in range(repeats))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_bytes(directory: Path) -> int:
    """Bytes a decode step reads: the decode graph's weights (its part files, or its signature's
    share of one file: the whole file, since every graph reads every weight)."""
    from circleops.package.manifest import read_manifest

    m = read_manifest(directory)
    return sum((directory / f).stat().st_size for f in dict.fromkeys(m.graph_files("decode")))


def _status_mb(field: str = "VmHWM") -> float:
    """A /proc/self/status size in MB: VmHWM the peak RSS (getrusage's ru_maxrss survives exec,
    so a child would report the parent's 1 GiB array), RssAnon / RssFile what it holds now."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(directory: str, ids: list[int], new: int, threads: int | None) -> dict:
    from circleops.generation.generator import Generator

    t = time.perf_counter()
    gen = Generator(directory, threads=threads)
    open_s = time.perf_counter() - t
    gen.generate(ids[:4], 2, stop_at_eos=False)  # warm: first runs allocate
    cpu0 = time.process_time()
    result = gen.generate(ids, new, stop_at_eos=False)
    cpu = time.process_time() - cpu0
    d = Path(directory)
    files = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
    return {"dir": directory, "open_s": open_s, "prefill_ms": 1000 * result.prefill_seconds,
            "decode_ms": 1000 * result.decode_seconds / max(1, result.decode_steps), "cpu_s": cpu,
            "wall_s": result.prefill_seconds + result.decode_seconds,
            "peak_rss_mb": _status_mb(), "anon_mb": _status_mb("RssAnon"), "file_mb": _status_mb("RssFile"),
            "dir_bytes": files,
            "decode_bytes": decode_bytes(d), "tokens": result.tokens, "runtime": result.runtime,
            "signature_api": gen.manifest.signature_api, "parts": len(gen.manifest.parts or [[0]])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # CODE: the circleops checkout the child imports (default this one): "before" and "after"
    # directories of a change, each run by its own code, interleaved
    parser.add_argument("--run", action="append", default=[], metavar="PYTHON:DIR[:CODE]")
    parser.add_argument("--ids", default=DEFAULT_IDS)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    if args.child:
        print("RESULT " + json.dumps(child(args.child, ids, args.new, args.threads)))
        return 0
    rows = []
    for r in range(args.rounds):
        gbps = streaming_read_gbps()
        print(f"round {r + 1}: streaming read {gbps:.1f} GB/s, load {os.getloadavg()[0]:.1f}", flush=True)
        for spec in args.run:
            python, directory, *code = spec.split(":", 2)
            cmd = [python, __file__, "--child", directory, "--ids", args.ids, "--new", str(args.new)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(
                code[0] if code else Path(__file__).resolve().parents[1])})
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(out.stdout[-2000:], out.stderr[-3000:], file=sys.stderr)
                continue
            res = {**json.loads(line[7:]), "round": r + 1, "gbps": gbps, "load": os.getloadavg()[0],
                   "code": code[0] if code else None}
            res["floor_ms"] = res["decode_bytes"] / (gbps * 1e9) * 1000
            rows.append(res)
            print(f"  {directory}: decode {res['decode_ms']:.1f} ms/token (floor {res['floor_ms']:.1f}, "
                  f"{res['decode_ms'] / res['floor_ms']:.2f}x), prefill {res['prefill_ms']:.0f} ms, CPU "
                  f"{res['cpu_s']:.2f} s / wall {res['wall_s']:.2f} s, peak RSS {res['peak_rss_mb']:.0f} MB (now anon "
                  f"{res['anon_mb']:.0f} + file {res['file_mb']:.0f}), "
                  f"dir {res['dir_bytes'] / 1e6:.0f} MB, parts {res['parts']}, api {res['signature_api']}, "
                  f"tokens {res['tokens'][:6]}...", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
