"""Runtime latency of the files circleops writes: LiteRT on our .tflite, onert on our
.circle (target onert), and torch eager on the same model and input, from one run.

    python bench/latency.py                    # Llama h512 L4 vocab 32000, seq 64, random weights
    python bench/latency.py --smollm2          # + the real SmolLM2-135M (30 layers)
    python bench/latency.py --fp16             # + the fp16 .tflite (fp16 weights, see tflite_fp16)
    python bench/latency.py --runs 30 --json latency.json

Every runtime gets 2 threads. The runs are interleaved (one call of each runtime per
round), so load from other processes falls on all of them alike; the median per runtime
is reported, with the ratios to torch eager and to onert. Before timing, each file's
output is compared with torch (max abs error printed), so a fast wrong file cannot pass.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

THREADS = 2
os.environ.setdefault("NUM_THREADS", str(THREADS))  # onert's thread count (read from the environment)
# torch's OpenMP threads spin while waiting; on a loaded machine that made 2-thread torch
# 6x slower than 1 thread (measured): they sleep instead. Set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# the model of bench/convert.py: 45.4M parameters
LLAMA_45M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048,
                 tie_word_embeddings=False)


def build_llama():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA_45M)
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg).eval()


def build_smollm2():
    from circleops.sources.models import load_smollm2

    return load_smollm2()[0]


def runners(model, ids, work: Path, fp16: bool) -> dict[str, Callable[[], object]]:
    """name -> a zero-argument callable running one forward; checks each against torch."""
    import numpy as np
    import onert
    import torch
    from ai_edge_litert.interpreter import Interpreter

    import circleops
    from circleops.pipeline.convert import export_module

    torch.set_num_threads(THREADS)
    module = export_module(model)
    with torch.no_grad():
        want = module(ids).numpy()
    ids_np = ids.numpy()

    out: dict[str, Callable[[], object]] = {}

    def torch_eager():
        with torch.no_grad():
            return module(ids)

    out["torch eager"] = torch_eager

    def litert(path: Path):
        it = Interpreter(model_path=str(path), num_threads=THREADS)
        it.allocate_tensors()
        inp, outp = it.get_input_details()[0]["index"], it.get_output_details()[0]["index"]

        def run():
            it.set_tensor(inp, ids_np)
            it.invoke()
            return it.get_tensor(outp)
        return run

    t = time.perf_counter()
    tflite = work / "model.tflite"
    circleops.convert(model, (ids,), tflite, target="tflite")
    print(f"  converted .tflite in {time.perf_counter() - t:.1f} s ({tflite.stat().st_size / 1e6:.0f} MB)")
    out["LiteRT .tflite"] = litert(tflite)

    t = time.perf_counter()
    circle = work / "model.circle"
    circleops.convert(model, (ids,), circle, target="onert")
    print(f"  converted .circle in {time.perf_counter() - t:.1f} s ({circle.stat().st_size / 1e6:.0f} MB)")
    session = onert.infer.session(str(circle), "cpu")
    out["onert .circle"] = lambda: session.infer([ids_np])

    if fp16:
        half = work / "model_fp16.tflite"
        circleops.convert(copy.deepcopy(model).half(), (ids,), half, target="tflite", dtype="fp16")
        out["LiteRT .tflite fp16"] = litert(half)

    for name, run in out.items():
        got = run()
        got = got[0] if isinstance(got, list) else got
        got = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        err = float(np.abs(got.astype(np.float64) - want).max())
        print(f"  {name:22s} max |output - torch fp32| = {err:.2e}  (max |logit| {np.abs(want).max():.1f})")
    return out


def measure(runs: dict[str, Callable[[], object]], rounds: int, warmup: int) -> dict[str, float]:
    """Median seconds per call, interleaved rounds."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(title: str, medians: dict[str, float]) -> list[str]:
    base, onert = medians["torch eager"], medians["onert .circle"]
    lines = [f"\n{title}", f"  {'runtime':22s} {'median':>10s} {'/ torch':>9s} {'/ onert':>9s}"]
    for name, s in medians.items():
        lines.append(f"  {name:22s} {s * 1e3:8.1f} ms {s / base:9.2f} {s / onert:9.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--smollm2", action="store_true", help="also the real SmolLM2-135M")
    p.add_argument("--fp16", action="store_true", help="also the fp16 .tflite in LiteRT")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="also write the medians (seconds) as JSON")
    args = p.parse_args(argv)

    import torch

    cases = [("Llama h512 L4 vocab 32000 (45.4M, random weights)", build_llama)]
    if args.smollm2:
        cases.append(("SmolLM2-135M (30 layers)", build_smollm2))
    results, lines = {}, []
    for title, build in cases:
        print(f"{title}, seq {args.seq_len}:")
        model = build()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=g)
        with tempfile.TemporaryDirectory() as d:
            runs = runners(model, ids, Path(d), args.fp16)
            medians = measure(runs, args.runs, args.warmup)
        results[title] = medians
        lines += report(f"{title}, seq {args.seq_len}, {THREADS} threads, median of {args.runs}:", medians)
        del runs, model
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
