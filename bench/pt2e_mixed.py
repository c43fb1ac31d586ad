"""Where uint8 loses on SmolLM2, and what measured mixed precision buys (torch, fake-quantized).

    python bench/pt2e_mixed.py [--calibrate 4] [--min-db 25] [--budgets 0.1,0.25,0.4] [--top 45] [--no-rotate]

The fp32 model greedily continues "Once upon a time," by 32 tokens; the model (Hadamard-rotated
unless --no-rotate, circleops.quantize.rotate) wrapped to return the logits and every decoder
layer's output is exported with the adapters, pattern-fused and prepared with CircleQuantizer
(uint8 activations, int8 per-channel weights), calibrated on windows of the shipped
calibration text. circleops.quantize.sensitivity then scores every activation's own uint8
rounding (per-token SQNR, worst first: --top of them are printed), and for each budget the
chosen ops get int16 and the model is prepared, calibrated and converted again. Reported for
the convert_pt2e module (what an integer file is verified against): logits SQNR and greedy
agreement over the 32 predicting positions, and each layer's output SQNR against the fp32
(rotated) model.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import time

import torch


def sqnr(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    return 10 * math.log10(float(ref.pow(2).sum()) / max(float((ref - got).pow(2).sum()), 1e-30))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibrate", type=int, default=4)
    p.add_argument("--min-db", type=float, default=25.0)
    p.add_argument("--budgets", default="0.1,0.25,0.4")
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--no-rotate", action="store_true")
    args = p.parse_args()
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from circleops.sources import models
    from circleops.pipeline.convert import export, hf_export_settings
    from circleops.numerics import LayerOutputs
    from circleops.passes.fusion import fuse_patterns
    from circleops.quantize import pt2e
    from circleops.quantize.rotate import rotated
    from circleops.quantize.sensitivity import annotated_ops, choose_int16, tensor_sqnr

    model, tok = models.load_smollm2()
    model.eval()
    ids = tok("Once upon a time,", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=32, do_sample=False)
    start = ids.shape[1] - 1
    lo = LayerOutputs(model).eval()
    with torch.no_grad():
        fp = lo(seq)[0][0, start:-1]
    samples = pt2e.calibration_samples((seq,), args.calibrate, tokenizer=tok, vocab_size=model.config.vocab_size)
    with contextlib.ExitStack() as stack, hf_export_settings(model), torch.no_grad():
        if not args.no_rotate:
            print(stack.enter_context(rotated(model, tok)).summary_line())
        t = time.perf_counter()
        ep, _ = fuse_patterns(export(lo, (seq,), adapters=True, warn_list=[]), model=lo)
        prepared = prepare_pt2e(ep.module(), pt2e.make_quantizer("uint8"))
        for a in samples:
            prepared(*a)
        scores = tensor_sqnr(prepared, samples[:2])
        ops = annotated_ops(prepared)
        known = {n.name for n in prepared.graph.nodes if "quantization_annotation" in n.meta}
        del prepared
        print(f"{ops} annotated ops, {len(scores)} uint8 activations scored in {time.perf_counter() - t:.0f} s "
              f"(load average {os.getloadavg()[0]:.1f}); the worst {args.top}:")
        for s in scores[:args.top]:
            print(f"  {s.sqnr_db:6.1f} dB  {s.op:16s} {s.producer:14s} {s.module}")
        ref = lo(seq)
        for budget in [float(b) for b in args.budgets.split(",") if b]:
            t = time.perf_counter()
            report = choose_int16(scores, ops, min_db=args.min_db, budget=budget, known=known)
            q = pt2e.make_quantizer("uint8")
            for name in report.int16_ops:
                q.set_node_name(name, "int16")
            converted, _ = pt2e.quantize(lo, (seq,), q, samples, exported=ep, export_fn=lambda m, a: None)
            got = converted(seq)
            g = got[0][0, start:-1]
            print(f"| {report.summary_line()} | {sqnr(fp, g):.1f} dB | {int((fp.argmax(-1) == g.argmax(-1)).sum())}/32 | "
                  f"{time.perf_counter() - t:.0f} s | {os.getloadavg()[0]:.1f} |", flush=True)
            print("  layers:", " ".join(f"{sqnr(w, x):.1f}" for w, x in zip(ref[1:], got[1:])), flush=True)


if __name__ == "__main__":
    main()
