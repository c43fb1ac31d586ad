"""Generation speed over model sizes (issue 32): circleops on onert and LiteRT beside
ik_llama.cpp on the same weights, one interleaved run.

    python bench/scale_speed.py --run "1B q4_0 onert=circleops-q4_0:/work/models/out-1b-q4" \
        --run "1B Q4_0 ik=ik-Q4_0:/work/models/llama-3.2-1b-shape-q4_0.gguf" --threads 1 2 --rounds 2 \
        --vocab 128256 --json /tmp/scale-speed.json

Each ``--run LABEL=ENGINE:ARTIFACT[@PYTHON]`` is one of bench/llm_speed.py's engines
(circleops-q4_0 / circleops-fp32: a circleops onert directory; circleops-tflite-fp32 /
circleops-tflite-w8: a LiteRT one; ik-Q4_0 / ik-F32: a GGUF, run by --ik-python) and the
artifact it runs; @PYTHON runs it under another interpreter (the onert 0.2.0.dev venv for a
signature directory). Every measurement is llm_speed.py's child (a fresh process: TTFT of each
--prompts length, then decode ms/token over --decode-steps greedy steps after the shortest
prompt; wall and CPU seconds), threads exact (NUM_THREADS=N for every circleops graph), the
runs round-robin per round so load falls on all alike; per round the parent also measures a
streaming read (numpy sum of 1 GiB, best of 3) for the bandwidth floor of each onert decode
(its decode graph's bytes / that rate). Prompts: random ids below --vocab, the same for all.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def spec_file(work: Path, vocab: int, prompts: list[int], steps: int) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    ids = [int(i) for i in rng.integers(3, vocab, max(prompts))]
    spec = {"prompts": {str(n): ids[:n] for n in prompts}, "decode_steps": steps, "reps": 1, "exact_threads": True}
    path = work / f"scale-spec-{vocab}.json"
    path.write_text(json.dumps(spec))
    return path


def decode_bytes(engine: str, artifact: str) -> int | None:
    """Bytes a decode step reads: circleops' decode files; a GGUF's whole size."""
    p = Path(artifact)
    if p.is_file():
        return p.stat().st_size
    from circleops.package.manifest import read_manifest

    m = read_manifest(p)
    return sum((p / f).stat().st_size for f in dict.fromkeys(m.graph_files("decode")))


def main() -> int:
    import onert_scale

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], metavar="LABEL=ENGINE:ARTIFACT[@PYTHON]")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 300])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--ik-python", default="/work/venvs/ik/bin/python")
    ap.add_argument("--work", type=Path, default=Path("/tmp/scale-speed"))
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--yaml", type=Path, default=None, help="no measuring: the results file from --json")
    ap.add_argument("--note", default="", help="the results text's first sentence (date, machine, load)")
    args = ap.parse_args()
    if args.yaml:
        write_yaml(json.loads(args.json.read_text()), args.yaml, args.note)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    spec = spec_file(args.work, args.vocab, args.prompts, args.decode_steps)
    import llm_speed

    runs = []
    for spec_text in args.run:
        label, rest = spec_text.split("=", 1)
        engine, artifact = rest.split(":", 1)
        artifact, _, python = artifact.partition("@")
        if not python:
            python = args.ik_python if engine.startswith("ik-") else sys.executable
        runs.append((label, engine, artifact, python))
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    for rnd in range(args.rounds):
        gbps = onert_scale.streaming_read_gbps()
        print(f"round {rnd + 1}: streaming read {gbps:.1f} GB/s, load {os.getloadavg()[0]:.1f}", flush=True)
        for threads in args.threads:
            for label, engine, artifact, python in runs:
                load = os.getloadavg()[0]
                r = llm_speed.run_child(engine, python, artifact, threads, spec)
                r.update(label=label, round=rnd + 1, gbps=gbps, load=load, artifact=artifact,
                         decode_bytes=decode_bytes(engine, artifact), time=time.strftime("%H:%M:%S"))
                results.append(r)
                args.json.write_text(json.dumps(results, indent=1))
                if "error" in r:
                    print(f"  {label} t{threads}: FAILED {r['error']}", flush=True)
                    continue
                floor = r["decode_bytes"] / (gbps * 1e9) * 1000
                print(f"  {label} t{threads}: TTFT " + " ".join(
                    f"{n}: {1000 * v:.0f} ms (CPU {1000 * r['ttft_cpu'][n]:.0f})" for n, v in r["ttft"].items()) +
                    f"; decode {r['decode_ms']:.1f} ms/token (CPU {r['decode_cpu_ms']:.1f}; floor {floor:.1f}, "
                    f"{r['decode_ms'] / floor:.2f}x); load {load:.1f}", flush=True)
    return 0


def write_yaml(results: list[dict], path: Path, note: str) -> None:
    """The runs as a bench/report.py results file: one row per (label, threads, round)."""
    import yaml

    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["label"], str(r["threads"]), str(r["round"]), "failed", "", "", "", "", "", f"{r['load']:.1f}"])
            continue
        long = max(r["ttft"], key=int)
        floor = r["decode_bytes"] / (r["gbps"] * 1e9) * 1000
        rows.append([r["label"], str(r["threads"]), str(r["round"]), f"{1000 * r['ttft'][long]:.0f}",
                     f"{1000 * r['ttft_cpu'][long]:.0f}", f"{r['decode_ms']:.1f}", f"{r['decode_cpu_ms']:.1f}",
                     f"{r['decode_bytes'] / 1e6:.0f}", f"{floor:.1f} ({r['decode_ms'] / floor:.2f}x)", f"{r['load']:.1f}"])
    long = max((max(r["ttft"], key=int) for r in results if "ttft" in r), key=int, default="300")
    data = {"heading": "bench/scale_speed.py — TTFT and decode over model sizes beside ik_llama.cpp (issue 32)",
            "blocks": [{"text": note + "\n"},
                       {"table": {"columns": ["run", "threads", "round", f"TTFT {long} ms", f"TTFT {long} CPU ms",
                                              "decode ms/token", "decode CPU ms/token", "MB read per token",
                                              "floor ms (decode / floor)", "load"],
                                  "align": ["left"] + ["right"] * 9, "rows": rows}}]}
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110))


if __name__ == "__main__":
    sys.exit(main())
