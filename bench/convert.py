"""Benchmark (not a test): ``circleops convert`` against tico 0.3.0, end to end as a user
runs each (a fresh process: imports, model load, export, conversion, write), wall time and
peak RSS, reported as ratios circleops / tico from the same run.

    python bench/convert.py                       # Llama h512 L4 vocab 32000 (45M), 3 rounds
    python bench/convert.py --tinyllama           # + TinyLlama-1.1B config, random weights
    python bench/convert.py --tico-python /tmp/tico-venv/bin/python --rounds 5 --json out.json

Runs alternate (circleops, tico, circleops, ...) so that load from other processes on the
machine falls on both alike; the median of the rounds is reported. See bench/README.md for
setting up tico in its own venv (it must not replace the main torch).

Then both files of the 45M model run in onert (``--latency-runs``, default 20; 0 skips it):
the same input ids, ``--threads`` (default 2; NUM_THREADS for onert, and ours converted with
``convert --threads N``, the form that is fastest at that count), each output checked against torch (max abs
error printed), interleaved timed runs after a warm-up, and the median onert latency of
ours / tico's reported as a ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
THREADS = 2  # default --threads; onert_latency sets NUM_THREADS (onert reads it when a session is made)

LLAMA_45M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                 tie_word_embeddings=False)
TINYLLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)


def make_models(work: Path, tinyllama: bool) -> list[dict]:
    """The benchmark models: the 45M Llama saved as an HF directory; TinyLlama as a config."""
    import torch
    import transformers

    cases = []
    hf_dir = work / "llama-h512-l4"
    if not (hf_dir / "model.safetensors").exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_45M))
        model.save_pretrained(hf_dir)
        del model
    cases.append({"name": "llama-h512-l4 (45.4M, HF dir)", "ours": [str(hf_dir)], "tico": str(hf_dir),
                  "weight_bytes": (hf_dir / "model.safetensors").stat().st_size, "hf_dir": hf_dir})
    if tinyllama:
        cfg = work / "tinyllama-config.json"
        config = transformers.LlamaConfig(**TINYLLAMA)
        config.architectures = ["LlamaForCausalLM"]
        config.to_json_file(str(cfg))
        params = 32000 * 2048 * 2 + 2048 + 22 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048)
        cases.append({"name": "TinyLlama-1.1B config (random weights)", "ours": ["--config", str(cfg)],
                      "tico": str(cfg), "weight_bytes": params * 4})
    return cases


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Wall time, the child's CPU time (user + system) and peak RSS (os.wait4), and whether it
    succeeded. On a loaded machine the CPU time is the steadier figure."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "ok": proc.returncode == 0,
            "tail": (err or out).strip().splitlines()[-3:]}


def onert_latency(files: dict[str, Path], hf_dir: Path, seq_len: int, runs: int, warmup: int = 3,
                  threads: int = THREADS) -> dict:
    """Both files in onert on the same ids: max abs error against torch, then the median
    of ``runs`` interleaved timed calls each (one call of every file per round)."""
    import numpy as np
    import onert
    import torch
    import transformers

    torch.set_num_threads(threads)
    os.environ["NUM_THREADS"] = str(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.numpy()
    del model
    ids_np = ids.numpy()
    sessions = {name: onert.infer.session(str(path), "cpu") for name, path in files.items()}
    result: dict = {"threads": threads, "runs": runs, "load_before": os.getloadavg()[0]}
    for name, sess in sessions.items():
        got = sess.infer([ids_np])[0]
        # onert ignores FULLY_CONNECTED's keepNumDims: a file ending in a rank-3 FC comes
        # back [S, vocab]; compare the values, and say so
        result[f"{name}_output_shape"] = list(got.shape)
        result[f"{name}_max_abs_error"] = float(np.abs(got.reshape(want.shape).astype(np.float64) - want).max())
    for _ in range(warmup):
        for sess in sessions.values():
            sess.infer([ids_np])
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(runs):
        for name, sess in sessions.items():
            t = time.perf_counter()
            sess.infer([ids_np])
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        result[f"{name}_ms"] = statistics.median(ts) * 1e3
        result[f"{name}_min_ms"] = min(ts) * 1e3
    result["load_after"] = os.getloadavg()[0]
    if "circleops" in times and "tico" in times:
        result["ratio"] = result["circleops_ms"] / result["tico_ms"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tico-python", default="/tmp/tico-venv/bin/python",
                    help="python of the venv where tico 0.3.0 is installed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--target", default="onert", choices=["circle", "onert"])
    ap.add_argument("--tinyllama", action="store_true", help="also the 1.1B config (minutes, ~12 GB for tico)")
    ap.add_argument("--no-tico", action="store_true", help="only circleops (no ratios)")
    ap.add_argument("--work", default=None, help="directory for models and outputs (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="the thread count the files are converted for and run with in onert (default 2)")
    ap.add_argument("--latency-runs", type=int, default=20,
                    help="timed onert runs of each file of the 45M model after the conversions (0: skip)")
    args = ap.parse_args(argv)

    work = Path(args.work or tempfile.mkdtemp(prefix="circleops-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cases = make_models(work, args.tinyllama)
    use_tico = not args.no_tico
    if use_tico and not Path(args.tico_python).exists():
        print(f"no tico python at {args.tico_python}: see bench/README.md, or pass --no-tico", file=sys.stderr)
        return 1

    results = []
    for case in cases:
        runs: dict[str, list[dict]] = {"circleops": [], "tico": []}
        out, tout = work / "ours.circle", work / "tico.circle"
        for r in range(args.rounds):
            out.unlink(missing_ok=True)
            ours = [sys.executable, "-m", "circleops.cli", "convert", *case["ours"], "-o", str(out),
                    "--target", args.target, "--seq-len", str(args.seq_len), "--quiet",
                    "--threads", str(args.threads)]
            runs["circleops"].append(run_measured(ours))
            if use_tico:
                tout.unlink(missing_ok=True)
                tico = [args.tico_python, str(HERE / "_tico_convert.py"), case["tico"], str(tout), str(args.seq_len)]
                runs["tico"].append(run_measured(tico))
            print(f"{case['name']} round {r + 1} (load average {os.getloadavg()[0]:.1f}): " + ", ".join(
                f"{k} {v[-1]['seconds']:.1f}s (CPU {v[-1]['cpu_seconds']:.1f}s) {v[-1]['peak_rss_bytes'] / 1e9:.2f}GB"
                f"{'' if v[-1]['ok'] else ' FAILED'}"
                for k, v in runs.items() if v), flush=True)
        row = {"model": case["name"], "weight_bytes": case["weight_bytes"]}
        for tool, rs in runs.items():
            if not rs:
                continue
            failed = [x for x in rs if not x["ok"]]
            if failed:
                print(f"  {tool} failed: {failed[0]['tail']}", file=sys.stderr)
            row[tool] = {"seconds": statistics.median(x["seconds"] for x in rs),
                         "cpu_seconds": statistics.median(x["cpu_seconds"] for x in rs),
                         "peak_rss_bytes": statistics.median(x["peak_rss_bytes"] for x in rs),
                         "all_seconds": [round(x["seconds"], 2) for x in rs], "ok": not failed}
        ours_r = row["circleops"]
        row["circleops_rss_over_weights"] = ours_r["peak_rss_bytes"] / case["weight_bytes"]
        if use_tico and "tico" in row:
            row["time_ratio"] = ours_r["seconds"] / row["tico"]["seconds"]
            row["cpu_ratio"] = ours_r["cpu_seconds"] / row["tico"]["cpu_seconds"]
            row["rss_ratio"] = ours_r["peak_rss_bytes"] / row["tico"]["peak_rss_bytes"]
        files = {name: path for name, path in (("circleops", out), ("tico", tout)) if path.exists()}
        if args.latency_runs > 0 and "hf_dir" in case and args.target == "onert" and files:
            print(f"{case['name']}: onert latency, {args.threads} threads, median of {args.latency_runs} interleaved runs",
                  flush=True)
            row["onert_latency"] = onert_latency(files, case["hf_dir"], args.seq_len, args.latency_runs,
                                                threads=args.threads)
        out.unlink(missing_ok=True)
        tout.unlink(missing_ok=True)
        results.append(row)

    print()
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end")
    print(f"{'model':42} {'circleops':>24} {'tico 0.3.0':>24} {'time ratio':>10} {'CPU ratio':>9} {'RSS ratio':>9} "
          f"{'RSS/weights':>11}")
    for row in results:
        o, t = row["circleops"], row.get("tico")
        fmt = lambda x: (f"{x['seconds']:6.1f}s CPU {x['cpu_seconds']:5.1f}s {x['peak_rss_bytes'] / 1e9:5.2f}GB"  # noqa: E731
                         if x else "-")
        print(f"{row['model']:42} {fmt(o):>24} {fmt(t):>24} {row.get('time_ratio', float('nan')):10.2f} "
              f"{row.get('cpu_ratio', float('nan')):9.2f} {row.get('rss_ratio', float('nan')):9.2f} "
              f"{row['circleops_rss_over_weights']:11.2f}")
    for row in results:
        lat = row.get("onert_latency")
        if not lat:
            continue
        print(f"\nonert latency, {row['model']}, seq {args.seq_len}, {lat['threads']} threads, median of "
              f"{lat['runs']} (load average {lat['load_before']:.1f} -> {lat['load_after']:.1f}):")
        for name in ("circleops", "tico"):
            if f"{name}_ms" in lat:
                print(f"  {name:10s} {lat[name + '_ms']:7.1f} ms (min {lat[name + '_min_ms']:.1f})  "
                      f"max |output - torch| {lat[name + '_max_abs_error']:.2e}  output {lat[name + '_output_shape']}")
        if "ratio" in lat:
            print(f"  circleops / tico: {lat['ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
