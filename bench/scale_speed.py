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


def measure(run: tuple[str, str, str, str], threads: int, rnd: int, gbps: float, spec: Path) -> dict:
    """One llm_speed.py child for ``run`` at ``threads``, with the load before it; printed."""
    import llm_speed

    label, engine, artifact, python = run
    load = os.getloadavg()[0]
    r = llm_speed.run_child(engine, python, artifact, threads, spec)
    r.update(label=label, round=rnd, gbps=gbps, load=load, artifact=artifact,
             decode_bytes=decode_bytes(engine, artifact), time=time.strftime("%H:%M:%S"))
    if "error" in r:
        print(f"  {label} t{threads}: FAILED {r['error']}", flush=True)
        return r
    floor = r["decode_bytes"] / (gbps * 1e9) * 1000
    print(f"  {label} t{threads}: TTFT " + " ".join(
        f"{n}: {1000 * v:.0f} ms (CPU {1000 * r['ttft_cpu'][n]:.0f})" for n, v in r["ttft"].items()) +
        f"; decode {r['decode_ms']:.1f} ms/token (CPU {r['decode_cpu_ms']:.1f}; floor {floor:.1f}, "
        f"{r['decode_ms'] / floor:.2f}x); peak {r.get('peak_rss_mb', 0):.0f} MB; load {load:.1f}", flush=True)
    return r


def main() -> int:
    import onert_scale

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], metavar="LABEL=ENGINE:ARTIFACT[@PYTHON]")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=1, help="the first round's number (a later pass appending to --json)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[8, 300])
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--ik-python", default="/work/venvs/ik/bin/python")
    ap.add_argument("--work", type=Path, default=Path("/tmp/scale-speed"))
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--yaml", type=Path, default=None, help="no measuring: the results file from --json")
    ap.add_argument("--note", default="", help="the results text's first sentence (date, machine, load)")
    ap.add_argument("--converts", type=Path, nargs=2, metavar=("LOGS", "OUTS"), default=None,
                    help="with --yaml: a table of LOGS/SIZE-TARGET-FORMAT.time (/usr/bin/time -v) and OUTS/SIZE-TARGET-FORMAT")
    ap.add_argument("--model", action="append", default=[], metavar="SIZE=DIR",
                    help="with --converts: each size's HF directory (its fp32 weight bytes)")
    ap.add_argument("--heading", default=HEADING, help="with --yaml: the section's heading")
    ap.add_argument("--after", default="", help="with --yaml: text after the tables (their reading)")
    args = ap.parse_args()
    if args.yaml:
        models = {m.split("=", 1)[0]: Path(m.split("=", 1)[1]) for m in args.model}
        converts = convert_rows(*args.converts, models) if args.converts else None
        write_yaml(json.loads(args.json.read_text()), args.yaml, args.note, converts, args.heading, args.after)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    spec = spec_file(args.work, args.vocab, args.prompts, args.decode_steps)
    runs = []
    for spec_text in args.run:
        label, rest = spec_text.split("=", 1)
        engine, artifact = rest.split(":", 1)
        artifact, _, python = artifact.partition("@")
        if not python:
            python = args.ik_python if engine.startswith("ik-") else sys.executable
        runs.append((label, engine, artifact, python))
    results = json.loads(args.json.read_text()) if args.json.exists() else []
    groups: dict[str, list] = {}  # the label's first word (its size): small sizes finish first
    for run in runs:
        groups.setdefault(run[0].split()[0], []).append(run)
    for size, group in groups.items():
        for rnd in range(args.first_round - 1, args.first_round - 1 + args.rounds):
            gbps = onert_scale.streaming_read_gbps()
            print(f"{size} round {rnd + 1}: streaming read {gbps:.1f} GB/s, load {os.getloadavg()[0]:.1f}", flush=True)
            for threads in args.threads:
                for run in group:
                    results.append(measure(run, threads, rnd + 1, gbps, spec))
                    args.json.write_text(json.dumps(results, indent=1))  # partial results survive a stop
    return 0


def speed_rows(results: list[dict]) -> list[list[str]]:
    """One row per (label, threads, round): TTFT of the longest prompt, decode, floor, peak RSS."""
    rows = []
    for r in results:
        if r.get("engine", "").startswith("ik-") and "greedy" not in r and "ttft" in r:
            r = dict(r, label=r["label"] + " (wrapper sample)")  # before the in-place argmax (llm_speed._Ik.greedy)
        if "error" in r:
            rows.append([r["label"], str(r["threads"]), str(r["round"]), "failed: " + " ".join(r["error"])[-120:],
                         "", "", "", "", "", "", f"{r['load']:.1f}"])
            continue
        long = max(r["ttft"], key=int)
        floor = r["decode_bytes"] / (r["gbps"] * 1e9) * 1000
        rows.append([r["label"], str(r["threads"]), str(r["round"]), f"{1000 * r['ttft'][long]:.0f}",
                     f"{1000 * r['ttft_cpu'][long]:.0f}", f"{r['decode_ms']:.1f}", f"{r['decode_cpu_ms']:.1f}",
                     f"{r['decode_bytes'] / 1e6:.0f}", f"{floor:.1f} ({r['decode_ms'] / floor:.2f}x)",
                     f"{r['peak_rss_mb'] / 1e3:.2f}" if "peak_rss_mb" in r else "", f"{r['load']:.1f}"])
    return rows


def parse_time_v(path: Path) -> dict[str, float]:
    """wall, CPU (user+sys) seconds and peak RSS bytes from a `/usr/bin/time -v -o` file."""
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        key, _, value = line.strip().rpartition(": ")
        if key == "User time (seconds)" or key == "System time (seconds)":
            out["cpu"] = out.get("cpu", 0.0) + float(value)
        elif key.startswith("Elapsed (wall clock) time"):
            parts = [float(x) for x in value.split(":")]
            out["wall"] = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
        elif key == "Maximum resident set size (kbytes)":
            out["peak"] = float(value) * 1024
        elif key == "Exit status":
            out["status"] = float(value)
    return out


def convert_rows(logs: Path, outs: Path, models: dict[str, Path]) -> list[list[str]]:
    """One row per LOGS/SIZE-TARGET-FORMAT.time: the convert's wall, CPU, peak RSS (and its ratio to
    the fp32 weight bytes of the model directory), bytes written (and their ratio to those)."""
    rows = []
    for size, model in models.items():
        fp32 = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        for f in sorted(logs.glob(f"{size}-*.time")):
            name = f.name[:-len(".time")]
            _, target, fmt = name.split("-", 2)
            t = parse_time_v(f)
            if "status" not in t:  # time -v writes its file at the end: a convert still running (or killed)
                rows.append([size, target, fmt, "unfinished", "", "", ""])
                continue
            written = sum(x.stat().st_size for x in (outs / name).rglob("*") if x.is_file()) if (outs / name).exists() else 0
            if not written and (logs / f"{name}.bytes").exists():  # the directory measured, then removed (disk)
                written = int((logs / f"{name}.bytes").read_text())
            ok = t.get("status", 1) == 0 and written
            rows.append([size, target, fmt, f"{t.get('wall', 0):.0f} s", f"{t.get('cpu', 0):.0f} s",
                         f"{t.get('peak', 0) / 1e9:.2f} GB ({t.get('peak', 0) / fp32:.2f}x)",
                         f"{written / 1e9:.3f} GB ({written / fp32:.2f}x)" if ok else f"failed (exit {t['status']:.0f})"])
    return rows


HEADING = "bench/scale_speed.py — TTFT and decode over model sizes beside ik_llama.cpp (issue 32)"


def write_yaml(results: list[dict], path: Path, note: str, converts: list[list[str]] | None = None,
               heading: str = HEADING, after: str = "") -> None:
    """The runs as a bench/report.py results file (and the converts' table when given)."""
    import yaml

    long = max((max(r["ttft"], key=int) for r in results if "ttft" in r), key=int, default="300")
    blocks: list[dict] = [{"text": note + "\n"}]
    if converts:
        blocks.append({"table": {"columns": ["size", "target", "format", "convert wall", "convert CPU",
                                             "peak RSS (x fp32 weights)", "written (x fp32 weights)"],
                                 "align": ["left"] * 3 + ["right"] * 4, "rows": converts}})
    blocks.append({"table": {"columns": ["run", "threads", "round", f"TTFT {long} ms", f"TTFT {long} CPU ms",
                                         "decode ms/token", "decode CPU ms/token", "MB read per token",
                                         "floor ms (decode / floor)", "peak RSS GB", "load"],
                             "align": ["left"] + ["right"] * 10, "rows": speed_rows(results)}})
    if after:  # the reading of the tables
        blocks.append({"text": after + "\n"})
    data = {"heading": heading, "blocks": blocks}
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110))


if __name__ == "__main__":
    sys.exit(main())
