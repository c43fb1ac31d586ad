"""`circleops convert DIR --graphs prefill,decode --verify` over model sizes (issue 32): wall and
CPU time, peak RSS and bytes written per target and format, each run a fresh process as a user
runs it (os.wait4 of the child: ru_maxrss is the largest resident set of the command and its
verify child, CPU time is both together).

    python bench/convert_scale.py --only 1B --make-only                # make /work/models/llama-3.2-1b-shape
    python bench/convert_scale.py --only 3B --make-only                # /work/models/llama-3.2-3b-shape (12.85 GB)
    python bench/convert_scale.py --work /tmp/scale --only 135M,0.5B   # the models are made when missing
    python bench/convert_scale.py --work /tmp/scale --yaml bench/results/24-convert-scale.yaml

The models are random (std 0.05) HF directories of real shapes: SmolLM2-135M's, Qwen2.5-0.5B's
sizes on the Llama architecture (494M), and the 1B, 1.5B and 3B shapes of the table below. Every run
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
    "Llama-3.2-1B shape": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                               max_position_embeddings=131072,
                               rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0,
                                                 low_freq_factor=1.0, original_max_position_embeddings=8192)),
    # Llama-3.2-3B's config: 3.21 B parameters, 12.85 GB in fp32 (issue 32: the largest size people ship)
    "Llama-3.2-3B shape": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                               num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=131072,
                               rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0,
                                                 low_freq_factor=1.0, original_max_position_embeddings=8192)),
    "Qwen2.5-1.5B shape": dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                               num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                               max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # sliding windows of 512 in 5 of every 6 layers (transformers' default layer_types); tied, embeddings x sqrt(1152)
    "Gemma-3-1B shape": dict(family="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                             num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                             max_position_embeddings=32768, sliding_window=512, rms_norm_eps=1e-6,
                             rope_theta=1000000.0, query_pre_attn_scalar=256, bos_token_id=2, eos_token_id=1,
                             pad_token_id=0),
}
RUNS = [("tflite", None), ("tflite", "w8"), ("onert", "q4_0")]
BIG = 1_000_000_000  # parameters from which a run takes the lock


def make_model(path: Path, sizes: dict) -> None:
    import torch
    import transformers

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    sizes = dict(sizes)
    family = sizes.pop("family", "llama")
    kwargs = dict(max_position_embeddings=8192, tie_word_embeddings=True, initializer_range=0.05,
                  rms_norm_eps=1e-5, rope_theta=500000.0)
    kwargs.update(sizes)
    if family == "qwen2":  # q/k/v biases (zero-initialised by transformers, as a real checkpoint's are not)
        cfg, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
    elif family == "gemma3":
        cfg, cls = transformers.Gemma3TextConfig(**kwargs), transformers.Gemma3ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(**kwargs), transformers.LlamaForCausalLM
    with torch.no_grad():
        model = cls(cfg).eval()
        for name, p in model.named_parameters():  # biases too: random std 0.05 like the weights
            if name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)


def model_dir_name(name: str) -> str:
    """'Llama-3.2-1B shape' -> 'llama-3.2-1b-shape' (the directory under --models)."""
    return name.lower().replace(" (llama)", "-llama").replace(" ", "-")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_one(model: Path, target: str, fmt: str | None, out: Path, big: bool, verify: bool = True) -> dict:
    cmd = [sys.executable, "-m", "circleops.cli", "convert", str(model), "--graphs", "prefill,decode",
           "--target", target, "-o", str(out), "--quiet"] + (["--quantize", fmt] if fmt else []) + \
        (["--verify"] if verify else [])
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
    ap.add_argument("--models", type=Path, default=Path("/work/models"),
                    help="where the random HF directories are (made there when missing)")
    ap.add_argument("--make-only", action="store_true", help="make the models of --only, convert nothing")
    ap.add_argument("--runs", default=None, help="target:format pairs, e.g. onert:q4_0,tflite:fp32 (default: "
                    + ",".join(f"{t}:{f or 'fp32'}" for t, f in RUNS) + ")")
    ap.add_argument("--no-verify", action="store_true", help="convert without --verify")
    ap.add_argument("--yaml", type=Path, default=None)
    ap.add_argument("--only", default=None, help="comma-separated model names to run (default all)")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    models = {name: args.models / model_dir_name(name) for name in SHAPES}
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        models = {k: v for k, v in models.items() if any(s in k for s in keep)}
    for name, path in models.items():
        make_model(path, SHAPES[name])
    if args.make_only:
        return 0
    start_load = os.getloadavg()
    rows = []
    for name, path in models.items():
        n = parameters(path)
        fp32 = 4 * n
        runs = RUNS if not args.runs else [(t, None if f == "fp32" else f) for t, f in
                                           (pair.split(":") for pair in args.runs.split(","))]
        for target, fmt in runs:
            out = args.work / f"out-{path.name}-{target}-{fmt or 'fp32'}"
            r = run_one(path, target, fmt, out, n >= BIG, verify=not args.no_verify)
            row = [name, f"{n / 1e6:.0f}M", target, fmt or "fp32", f"{r['wall']:.0f} s", f"{r['cpu']:.0f} s",
                   f"{r['peak'] / 1e9:.2f} GB", f"{r['peak'] / fp32:.2f}x",
                   f"{r['written'] / 1e9:.2f} GB" if r["ok"] else "-", f"{r['load']:.1f}",
                   ("passed" if not args.no_verify else "written, not verified") if r["ok"] else f"failed: {r['error']}"]
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
