"""Integer NPU recipes on a hold-out text: logits SQNR and top-1 agreement with fp32.

    python bench/npu_holdout.py [--recipes int16+w4+gptq,uint8,...] [--tokens 32] [--offset 0]

SmolLM2-135M; the hold-out text is the start of circleops/quantize/perplexity.txt (never
calibrated on: calibration uses circleops/quantize/calibration.txt, whose first words are
bench/pt2e.py's prompt). Its first ``--tokens`` tokens (from ``--offset``) are read once
(teacher forcing) by fp32 torch and by each recipe's file (circleops.convert, target
circle, the example input that sequence, 8 calibration windows), run by the reference
interpreter's integer kernels. Reported over every position of the sequence: logits SQNR
(10·log10(Σ fp32² / Σ (fp32 - file)²)) and top-1 agreement (argmax equal to fp32's at each
position); then the same over ``--windows`` consecutive windows of the text (the first one
included: 24 x 32 = 768 positions, a steadier figure than one window's 32); the file's size
against fp32's 4 bytes per parameter (tied table once), the convert time and its stages,
and the load average. Recipe names as bench/pt2e.py's, plus
"+NAME=VALUE" convert options (e.g. "+int8_weights=auto", "+gptq_refine=0"). "int16+w4+gptq" is
the 16a4w default for an LLM (groups of 16, act order, clipping search, 2 refinement passes,
--int8-weights auto); the preset before it: "int16+w4+gptq+g32+gptq_refine=0".
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pt2e import recipe as parse_recipe, sqnr_db  # noqa: E402


def holdout_ids(tok, tokens: int, offset: int = 0, windows: int = 1) -> torch.Tensor:
    """[windows, tokens] ids of the hold-out text (perplexity.txt, never calibrated on), from ``offset``."""
    from circleops.tools.quant_report import PERPLEXITY_TEXT

    ids = tok(PERPLEXITY_TEXT.read_text())["input_ids"]
    return torch.tensor([ids[offset + k * tokens:offset + (k + 1) * tokens] for k in range(windows)])


def options_of(name: str) -> tuple[str, list[str], str, dict]:
    """bench/pt2e.py's recipe, with "+key=value" convert options on top; "SCHEME:default":
    every integer option left out, so convert's defaults for an LLM choose (resolve_recipe)."""
    if name.endswith(":default"):
        scheme = name.split(":")[0]
        return scheme, None, f"`--quantize {scheme}` with the defaults for an LLM", {}
    plain = "+".join(t for t in name.split("+") if "=" not in t)
    scheme, parts, label, options = parse_recipe(plain)
    for token in name.split("+"):
        if "=" in token:
            k, v = token.split("=", 1)
            options[k] = int(v) if v.lstrip("-").isdigit() else {"true": True, "false": False}.get(v.lower(), v)
            label += f", {k}={v}"
    return scheme, parts, label, options


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="int16+w4+gptq")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--calibrate", type=int, default=8)
    p.add_argument("--windows", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import circleops
    from circleops.sources import models
    from circleops.runtime import reference

    model, tok = models.load_smollm2()
    model.eval()
    batch = holdout_ids(tok, args.tokens, args.offset, args.windows)
    seq = batch[:1]
    with torch.no_grad():
        fps = [model(batch[k:k + 1]).logits[0].numpy() for k in range(batch.shape[0])]
    fp = fps[0]
    fp32_bytes = 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"hold-out: {tok.decode(seq[0])!r} ({seq.shape[1]} tokens); torch threads {torch.get_num_threads()}")
    print(f"| recipe | logits SQNR | top-1 agreement | {args.windows} windows: SQNR | agreement | file | "
          "convert (stages) | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    tmp = args.out or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    for name in [r for r in args.recipes.split(",") if r]:
        scheme, parts, label, options = options_of(name)
        path = os.path.join(tmp, f"holdout_{name.replace('+', '_').replace('=', '-').replace(':', '_')}.circle")
        t, c = time.perf_counter(), time.process_time()
        report = circleops.convert(model, (seq,), path, target="circle", quantize=scheme, int16=parts,
                                   calibrate=args.calibrate, tokenizer=tok, **options)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        for line in report.quantization.summary_lines():
            print("   ", line, flush=True)
        session = reference.Session(path)  # the file read and planned once, run on each window
        got = [session.run([batch[k:k + 1].numpy()])[0][0] for k in range(batch.shape[0])]
        logits = got[0]
        agree = int((logits.argmax(-1) == fp.argmax(-1)).sum())
        agree_all = sum(int((g.argmax(-1) == f.argmax(-1)).sum()) for g, f in zip(got, fps))
        all_db = sqnr_db(np.concatenate(fps), np.concatenate(got))
        stages = ", ".join(f"{k} {v:.0f} s" for k, v in report.timings.items())
        print(f"| {name}: {label} | {sqnr_db(fp, logits):.1f} dB | {agree}/{seq.shape[1]} | {all_db:.1f} dB | "
              f"{agree_all}/{batch.numel()} ({agree_all / batch.numel():.1%}) | "
              f"{os.path.getsize(path) / 2**20:.0f} MiB ({os.path.getsize(path) / fp32_bytes:.2f}x fp32) | "
              f"{wall:.0f} s wall, {cpu:.0f} s CPU ({stages}) | {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
