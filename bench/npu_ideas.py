"""The 16a4w NPU recipe's 4-bit rounding, one idea at a time (issue 34, bench/results/41).

    OMP_NUM_THREADS=1 python bench/npu_ideas.py --ideas base,g16,damp0.1,refine2,gen16 [--int16]

SmolLM2-135M rotated (circleops.quantize.rotate) as convert rotates it; every decoder linear
int4 on the per-group grid of circleops.quantize.grouped by the library's GPTQ (act order,
Hessian-weighted clipping search: what ``--gptq`` does), then the linears convert keeps at
int8 (``--int8-weights auto``: grouped.linear_sensitivity + choose_int8 within INT8_SHARE,
measured once on the rotated fp32 model and cached in /tmp). Scored against the fp32 model on
the hold-out text (perplexity.txt, never calibrated on): the first window of 32 tokens
(bench/npu_holdout.py's) and 24 windows of 32 (768 positions), weights only (fp32
activations, lm_head as it is); with --int16 also the int16 fake-quantized module (PT2E, as
convert builds it, lm_head int8) on the first 8 windows.

Ideas (each changes one thing from ``base``; "+" joins them):
  base      GPTQ act order + clipping search, groups of 32, damp 0.01, the calibration text in
            4 windows of 128 tokens (what convert does)
  gN        groups of N columns
  dampX     GPTQ damping X (of the mean Hessian diagonal)
  genN      + N sequences of 128 tokens the fp32 model samples (seeded) in the Hessians
  refineK   K passes of coordinate descent on each linear's output error after GPTQ
            (circleops.quantize.gptq.refine: each integer moved to its best level given the others)
  noint8    no int8 linears
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from npu_weights import holdout_batch, logits, score, int16_logits, smollm2_reference  # noqa: E402

SENS_CACHE = "/tmp/npu_ideas_sensitivity_g{group}.pt"


def parse(idea: str) -> dict:
    o = {"group": 32, "damp": 0.01, "gen": 0, "refine": 0, "int8": True}
    for part in idea.split("+"):
        if part == "base":
            continue
        elif part.startswith("g") and part[1:].isdigit():
            o["group"] = int(part[1:])
        elif part.startswith("damp"):
            o["damp"] = float(part[4:])
        elif part.startswith("gen"):
            o["gen"] = int(part[3:])
        elif part.startswith("refine"):
            o["refine"] = int(part[6:])
        elif part == "noint8":
            o["int8"] = False
        else:
            raise SystemExit(f"unknown idea {part!r}")
    return o


def generated(model, tok, n: int, length: int = 128) -> list[tuple]:
    """``n`` sequences of ``length`` tokens the fp32 (rotated: the same function) model samples,
    each begun with the BOS-less first token of a calibration window (seeded)."""
    from circleops.quantize import pt2e

    if not n:
        return []
    windows = pt2e.calibration_samples((torch.zeros(1, 16, dtype=torch.long),), n, tokenizer=tok)
    torch.manual_seed(0)
    starts = torch.cat([w[0][:, :1] for w in windows])
    with torch.no_grad():
        out = model.generate(starts, attention_mask=torch.ones_like(starts), do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                             pad_token_id=0)
    return [(row[None, :length],) for row in out]


def int8_choice(model, samples, group: int) -> dict:
    from circleops.quantize import grouped as Q

    path = SENS_CACHE.format(group=group)
    head = model.get_output_embeddings()
    linears = {n: m for n, m in Q.eligible_linears(model).items() if m is not head}
    if os.path.exists(path):
        noise = torch.load(path)
    else:
        t = time.process_time()
        noise = Q.linear_sensitivity(model, samples[:2], list(linears), group)
        torch.save(noise, path)
        print(f"    sensitivity (group {group}): {time.process_time() - t:.0f} s CPU", flush=True)
    chosen = Q.choose_int8(noise, {n: linears[n].weight.numel() for n in noise}, target=Q.INT8_TARGET,
                           budget=Q.INT8_SHARE)
    return {n: Q.int8_rounding(linears[n].weight) for n in chosen}


@contextlib.contextmanager
def rounded(model, samples, o: dict):
    """The decoder linears rounded as idea ``o`` says (in place, restored on exit): the report."""
    from circleops.quantize import gptq as G
    from circleops.quantize import grouped as Q

    head = model.get_output_embeddings()
    linears = {n: m for n, m in Q.eligible_linears(model).items() if m is not head}
    report = Q.GroupedReport(4, o["group"], "GPTQ")
    saved = {n: m.weight.detach().clone() for n, m in linears.items()}
    try:
        with torch.no_grad():
            hs, _ = G.hessians(model, linears, samples)
            for name, lin in linears.items():
                h = hs.pop(name)
                q, s_r, m = G.gptq_grouped(lin.weight, h, 4, o["group"], damp=o["damp"], act_order=True,
                                           clip_search=True)
                if o["refine"]:
                    q = G.refine_grouped(lin.weight, h, q, s_r[:, None] * m, o["group"], passes=o["refine"])
                lin.weight.copy_(Q.record(report, name, lin, q, s_r, m))
        yield report
    finally:
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(saved[n])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ideas", default="base")
    p.add_argument("--int16", action="store_true")
    args = p.parse_args()

    from circleops.quantize import grouped as Q
    from circleops.quantize import pt2e
    from circleops.quantize.ggml import one_thread
    from circleops.quantize.llm import GPTQ_TOKENS, GPTQ_WINDOW
    from circleops.quantize.rotate import rotated

    model, tok, batch, ref = smollm2_reference()
    text = pt2e.calibration_samples((torch.zeros(1, GPTQ_WINDOW, dtype=torch.long),), GPTQ_TOKENS // GPTQ_WINDOW,
                                    tokenizer=tok)
    pt2e_samples = pt2e.calibration_samples((torch.zeros(1, 32, dtype=torch.long),), 8, tokenizer=tok)
    print(f"hold-out: {batch.shape[0]} windows of 32 tokens; load {os.getloadavg()[0]:.1f}")
    print("| idea | first window SQNR | first window top-1 | 24 windows SQNR | 24 windows top-1 | KL | int8 share |"
          " int16: first window | int16: 8 windows SQNR | int16: 8 windows top-1 | CPU s (GPTQ+refine) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with contextlib.ExitStack() as stack, one_thread(), torch.no_grad():
        stack.enter_context(rotated(model, tok))
        for idea in args.ideas.split(","):
            o = parse(idea)
            t = time.process_time()
            samples = text + generated(model, tok, o["gen"])
            int8 = int8_choice(model, text, o["group"]) if o["int8"] else {}
            t = time.process_time()
            with rounded(model, samples, o) as report, Q.int8_kept(model, report, int8):
                cpu = time.process_time() - t
                got = logits(model, batch)
                r = score(ref, got)
                share = report.int8_params / max(report.int8_params + report.int4_params, 1)
                i16 = ""
                if args.int16:
                    g16 = int16_logits(model, batch[:8], pt2e_samples)
                    r16 = score(ref[:8], g16)
                    i16 = f"{r16['db0']:.1f} dB, {r16['agree0']}/32 | {r16['db']:.2f} dB | {r16['agree']:.1%}"
                else:
                    i16 = "- | - | -"
            print(f"| {idea} | {r['db0']:.1f} dB | {r['agree0']}/32 | {r['db']:.2f} dB | {r['agree']:.1%} | "
                  f"{r['kl']:.4f} | {share:.1%} ({len(int8)}) | {i16} | {cpu:.0f} | {os.getloadavg()[0]:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
