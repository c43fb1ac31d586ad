"""The written integer generation graphs (prefill + decode) on the hold-out text: logits SQNR and
top-1 agreement with fp32, and greedy tokens against fp32's (issues 32 and 34).

    python bench/npu_graphs_holdout.py DIR [DIR ...] [--prompt "Once upon a time,"] [--new-tokens 16]

DIR is what ``circleops convert smollm2 --graphs prefill,decode --target circle --quantize int16
[--weight-bits 4] -o DIR`` wrote. bench/npu_holdout.py measures a single-graph file (one forward
of 32 tokens); ``circleops convert --graphs`` reports the quality of torch's quantized modules
(the converted PT2E graphs the files are verified against). This runs the files themselves, in
the reference interpreter's integer kernels, on the positions convert's quality line reads: the
first n tokens of the hold-out text (circleops/quantize/perplexity.txt, never calibrated on;
n = the longest prefill graph's length) through the prefill graph, then up to 32 teacher-forced
decode steps (each on the caches the files wrote), every logit row against SmolLM2-135M's fp32
logits of the same prefix (transformers, no cache). SQNR = 10 log10(sum fp32^2 / sum (fp32 -
file)^2) over those rows; top-1 = rows whose argmax equals fp32's. Then ``--new-tokens`` greedy
tokens of ``--prompt`` through circleops.generation.generate (what ``circleops generate`` runs)
against transformers' greedy tokens of the fp32 model: how many of the first match in a row.
CPU seconds (user + system of this process) are printed beside each figure, and the load average.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time


def cpu() -> float:
    """User + system CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def teacher_forced(directory: str, model, tokenizer) -> tuple[float, int, int]:
    """(SQNR dB, top-1 agreement, positions) of the files in ``directory`` against fp32."""
    import math

    import numpy as np

    from circleops.generation.generator import Generator
    from circleops.recipes import llm_integer

    gen = Generator(directory, runtime="reference")
    n = gen.manifest.prefill_len
    length = min(gen.manifest.max_cache_len, n + llm_integer.QUALITY_DECODE_STEPS)
    ids = llm_integer.hold_out_ids(model, tokenizer, length)
    want = llm_integer.fp32_logits(model, ids).numpy()[n - 1:]
    got = [np.asarray(gen.prefill([int(t) for t in ids[0, :n]]), dtype=np.float64)]
    for pos in range(n, length):
        got.append(np.asarray(gen.decode(int(ids[0, pos])), dtype=np.float64))
    got = np.stack(got)
    noise = float(((got - want) ** 2).sum())
    db = math.inf if noise == 0 else 10 * math.log10(float((want ** 2).sum()) / noise)
    return db, int((got.argmax(-1) == want.argmax(-1)).sum()), len(got)


def greedy_match(directory: str, model, tokenizer, prompt: str, new: int) -> tuple[int, str, str]:
    """(leading tokens equal to fp32's greedy ones, the file's text, fp32's text)."""
    import torch

    from circleops.generation.generator import generate

    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=new, do_sample=False)[0, ids.shape[1]:].tolist()
    got = generate(directory, ids[0].tolist(), new, runtime="reference").tokens
    same = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return same, tokenizer.decode(got), tokenizer.decode(want)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directories", nargs="+")
    p.add_argument("--prompt", default="Once upon a time,")
    p.add_argument("--new-tokens", type=int, default=16, help="0: no greedy comparison")
    p.add_argument("--no-teacher-forced", action="store_true",
                   help="only the greedy comparison (the teacher-forced pass costs ~33 reference-interpreter steps)")
    args = p.parse_args()

    from circleops.sources.models import load_smollm2

    model, tokenizer = load_smollm2()
    model.eval()
    for d in args.directories:
        c, t = cpu(), time.perf_counter()
        if not args.no_teacher_forced:
            db, agree, positions = teacher_forced(d, model, tokenizer)
            print(f"{d}: the files teacher-forced on the hold-out text: {db:.1f} dB, top-1 {agree}/{positions} "
                  f"({cpu() - c:.0f} s CPU, {time.perf_counter() - t:.0f} s wall, load {os.getloadavg()[0]:.1f})",
                  flush=True)
        if args.new_tokens:
            c, t = cpu(), time.perf_counter()
            same, text, want = greedy_match(d, model, tokenizer, args.prompt, args.new_tokens)
            print(f"{d}: greedy {args.new_tokens} tokens of {args.prompt!r}: the first {same} equal fp32's\n"
                  f"    file: {text!r}\n    fp32: {want!r}\n"
                  f"    ({cpu() - c:.0f} s CPU, {time.perf_counter() - t:.0f} s wall, load {os.getloadavg()[0]:.1f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
