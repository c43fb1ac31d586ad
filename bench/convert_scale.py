"""`circleops convert DIR --graphs prefill,decode --verify` over model sizes (issue 32): wall and
CPU time, peak RSS and bytes written per target and format, each run a fresh process as a user
runs it (os.wait4 of the child: ru_maxrss is the largest resident set of the command and its
verify child, CPU time is both together).

    python bench/convert_scale.py --work /tmp/scale                  # 135M, 500M (made there)
    python bench/convert_scale.py --work /tmp/scale --1b /work/models/llama-3.2-1b-shape
    python bench/convert_scale.py --work /tmp/scale --yaml bench/results/24-convert-scale.yaml

The models are random (std 0.05) HF directories of real shapes: SmolLM2-135M's, Qwen2.5-0.5B's
sizes on the Llama architecture (494M), and the Llama-3.2-1B shape given with --1b. Every run
that loads a 1B-class model holds /tmp/big-model.lock (one big run on the machine at a time).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {
    "SmolLM2-135M shape": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "Qwen2.5-0.5B sizes (Llama)": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                       head_dim=64),
}
RUNS = [("tflite", None), ("tflite", "w8"), ("onert", "q4_0")]
BIG = 1_000_000_000  # parameters from which a run takes the lock


def make_model(path: Path, sizes: dict) -> None:
    import torch
    import transformers

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**sizes, max_position_embeddings=8192, tie_word_embeddings=True,
                                   initializer_range=0.05, rms_norm_eps=1e-5, rope_theta=500000.0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(path), safe_serialization=True)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_one(model: Path, target: str, fmt: str | None, out: Path, big: bool) -> dict:
    cmd = [sys.executable, "-m", "circleops.cli", "convert", str(model), "--graphs", "prefill,decode",
           "--target", target, "--verify", "-o", str(out), "--quiet"] + (["--quantize", fmt] if fmt else [])
    lock = open("/tmp/big-model.lock", "w") if big else None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        load = os.getloadavg()[0]
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        stdout, stderr = proc.stdout.read(), proc.stderr.read()
    finally:
        if lock is not None:
            lock.close()
    ok = os.waitstatus_to_exitcode(status) == 0
    verify = next((ln.strip() for ln in stdout.splitlines() if ln.strip().startswith("verify")), "")
    return dict(ok=ok, wall=wall, cpu=usage.ru_utime + usage.ru_stime, peak=usage.ru_maxrss * 1024,
                written=dir_bytes(out) if ok else 0, load=load, verify=verify,
                error="" if ok else (stderr.strip().splitlines() or ["?"])[-1][:300])


def parameters(model: Path) -> int:
    from circleops.sources import sizes

    return sizes.estimate(model).parameters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/convert-scale"))
    ap.add_argument("--1b", dest="one_b", type=Path, default=None, help="the Llama-3.2-1B-shape HF directory")
    ap.add_argument("--yaml", type=Path, default=None)
    ap.add_argument("--only", default=None, help="comma-separated model names to run (default all)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    models = {}
    for name, sizes in SHAPES.items():
        path = args.work / name.split()[0].lower().replace(".", "")
        make_model(path, sizes)
        models[name] = path
    if args.one_b is not None:
        models["Llama-3.2-1B shape"] = args.one_b
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        models = {k: v for k, v in models.items() if any(s in k for s in keep)}
    start_load = os.getloadavg()
    rows = []
    for name, path in models.items():
        n = parameters(path)
        fp32 = 4 * n
        for target, fmt in RUNS:
            out = args.work / f"out-{path.name}-{target}-{fmt or 'fp32'}"
            r = run_one(path, target, fmt, out, n >= BIG)
            row = [name, f"{n / 1e6:.0f}M", target, fmt or "fp32", f"{r['wall']:.0f} s", f"{r['cpu']:.0f} s",
                   f"{r['peak'] / 1e9:.2f} GB", f"{r['peak'] / fp32:.2f}x",
                   f"{r['written'] / 1e9:.2f} GB" if r["ok"] else "-", f"{r['load']:.1f}",
                   "passed" if r["ok"] else f"failed: {r['error']}"]
            print(" | ".join(row), flush=True)
            rows.append(row)
            if args.yaml is not None:  # after every run: a partial table survives an interrupted one
                write_yaml(args.yaml, rows, start_load)
    return 0


def write_yaml(path: Path, rows: list, start_load: tuple) -> None:
    import yaml

    end_load = os.getloadavg()

    cpu = platform.processor() or "x86_64"
    text = (f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on the 2-core AVX-512 machine "
            f"({cpu}; {os.cpu_count()} CPUs, NUM_THREADS unset: LiteRT 2 threads, onert q4_0 1), shared with "
            f"other runs: load average {start_load[0]:.1f} at the start, {end_load[0]:.1f} at the last run's end (the "
            f"load column is at each run's start). Peak RSS: the largest resident set of the command or its "
            f"verify child (os.wait4); x fp32: over the fp32 weight bytes (4 x parameters).\n")
    data = {"heading": "bench/convert_scale.py — convert --graphs prefill,decode --verify over model sizes (issue 32)",
            "blocks": [{"text": text},
                       {"table": {"columns": ["model", "parameters", "target", "format", "wall", "CPU",
                                              "peak RSS", "x fp32", "written", "load", "verify"],
                                  "align": ["none", "right", "none", "none", "right", "right", "right", "right",
                                            "right", "right", "none"],
                                  "rows": rows}}]}
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100))


if __name__ == "__main__":
    raise SystemExit(main())
