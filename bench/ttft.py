"""Benchmark (not a test): time to first token on onert, as `circleops generate` gets it,
against transformers, for a short and a long prompt, per set of prefill graphs and threads.

    python bench/ttft.py                                   # --seq-len sets 64,8 (the default), 8, 64, 128,8, 256,64,8
    python bench/ttft.py --configs 64,8 --threads 1 2 --rounds 5
    python bench/ttft.py --dir out/                        # the graphs `convert --graphs` wrote there

SmolLM2-135M's graphs are converted once for target onert with every length the configs
name (cache --max-cache-len, default 512 as `convert --graphs`), then each config (a
`--seq-len` value) runs as a Generator over its own subset of the prefill graphs: the same
`Generator.generate` path `circleops generate` takes (its chunk plan over those lengths, the
one-row logits, the decode session opened too), timed as `generate(prompt,
max_new_tokens=1).prefill_seconds` (prefill runs + the argmax). torch:
`model.generate(ids, max_new_tokens=1)` (greedy, DynamicCache), in the same process,
alternating with onert, torch.set_num_threads = NUM_THREADS. Medians of --rounds after one
warm-up run per session; the ratio onert / torch is what issue 13 asks to keep <= 2. Also the
CPU seconds each took (time.process_time, every thread of the process): on a shared machine
wall times follow the other jobs, CPU seconds much less (at 1 thread they are close to an
idle machine's wall time).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

TEXT = ("The lighthouse keeper counted the ships that passed the harbour, wrote their names in a ledger "
        "and watched the weather turn. ")
CONFIGS = ["64,8", "8", "64", "128,8", "256,64,8"]


def subset(manifest, lengths):
    """The manifest of ``manifest``'s directory with only the prefill graphs of ``lengths``
    (named as convert_graphs names them for that set)."""
    from circleops.package.manifest import prefill_graph_name

    files, signatures = {"decode": manifest.files["decode"]}, {"decode": manifest.signatures["decode"]}
    for n in lengths:
        g = prefill_graph_name(n, lengths)
        files[g] = manifest.files[manifest.prefill_graphs[n]]
        signatures[g] = manifest.signatures[manifest.prefill_graphs[n]]
    return dataclasses.replace(manifest, files=files, signatures=signatures, prefill_len=max(lengths),
                               prefill_lens=sorted(lengths, reverse=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=CONFIGS, help="--seq-len values: prefill lengths, comma-separated")
    ap.add_argument("--prompts", type=int, nargs="+", default=[5, 300], help="prompt lengths in tokens")
    ap.add_argument("--max-cache-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="NUM_THREADS values (and torch's)")
    ap.add_argument("--quantize", default=None, help="q4_0 / q8_0 weights (convert --quantize)")
    ap.add_argument("--dir", default=None, help="use the graphs already in this directory (its lengths only)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch

    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs, prefill_lengths
    from circleops.package.manifest import read_manifest
    from circleops.sources.models import load_smollm2

    model, tokenizer = load_smollm2()
    model.eval()
    ids = [int(i) for i in tokenizer(TEXT * 40)["input_ids"]]
    prompts = {n: ids[:n] for n in args.prompts}

    def torch_ttft(prompt: list[int]) -> tuple[float, float]:
        x = torch.tensor([prompt])
        t, c = time.perf_counter(), time.process_time()
        with torch.no_grad():
            model.generate(x, max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(x))
        return time.perf_counter() - t, time.process_time() - c

    with tempfile.TemporaryDirectory() as work:
        if args.dir:
            manifest = read_manifest(args.dir)
            configs = [tuple(manifest.prefill_graphs)]
        else:
            configs = [prefill_lengths(c) for c in args.configs]
            every = sorted({n for c in configs for n in c}, reverse=True)
            t = time.perf_counter()
            convert_graphs(load_smollm2()[0], Path(work) / "graphs", target="onert", prefill_len=every,
                           max_cache_len=args.max_cache_len, quantize=args.quantize)
            print(f"converted prefill lengths {every} + decode in {time.perf_counter() - t:.0f} s")
            manifest = read_manifest(Path(work) / "graphs")
        print(f"load average {os.getloadavg()[0]:.2f} at the start; rounds {args.rounds}; cache "
              f"{manifest.max_cache_len}; weights {manifest.quantize or 'fp32'}")
        print(f"{'--seq-len':>10} {'threads':>7} {'prompt':>6} {'onert s':>8} {'torch s':>8} {'onert/torch':>11} "
              f"{'onert cpu s':>11} {'torch cpu s':>11} {'cpu ratio':>9}  runs")
        for threads in args.threads:
            os.environ["NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
            for lengths in configs:
                gen = Generator(subset(manifest, lengths), runtime="onert")
                for n, prompt in prompts.items():
                    gen.generate(prompt, 1)  # warm-up: a session's first run prepares it
                    times, runs = [], []
                    for _ in range(args.rounds):
                        c = time.process_time()
                        result = gen.generate(prompt, 1)
                        c = time.process_time() - c
                        times.append((result.prefill_seconds, c, *torch_ttft(prompt)))
                        runs = result.prefill_chunks
                    o, oc, p, pc = (statistics.median(t[i] for t in times) for i in range(4))
                    print(f"{','.join(map(str, lengths)):>10} {threads:>7} {n:>6} {o:>8.3f} {p:>8.3f} {o / p:>11.2f} "
                          f"{oc:>11.3f} {pc:>11.3f} {oc / pc:>9.2f}  {'+'.join(map(str, runs))}", flush=True)
                del gen
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
