"""Benchmark (not a test): what w8 costs SmolLM2 in perplexity, and where, by emulating onert's
hybrid FULLY_CONNECTED in torch (circleops.quantize.int8.hybrid_linear on every nn.Linear).

    python bench/w8_emulate.py [WINDOWS] [--alpha A ...]

Variants: int8 weights with fp32 activations; w8 as written; w8 with down_proj / lm_head kept
fp32; w8 with SmoothQuant input-channel scales m = max|x|^a / max|W|^(1-a) (x / m, W * m; the
maxima from the fp32 run over the same windows). Windows of 256 tokens of the shipped text.
docs/benchmarks.md ("bench/ggml.py with --quantize w8") has the figures.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import torch

from circleops.sources import models
from circleops.quantize import int8
from circleops.tools.quant_report import text_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("windows", type=int, nargs="?", default=4)
    ap.add_argument("--alpha", type=float, nargs="*", default=[0.3, 0.5])
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = models.load("smollm2")
    model, tok = lm.module.eval(), lm.tokenizer
    ids = text_ids(tok, model.config.vocab_size)
    w = 256
    chunks = [ids[k * w:(k + 1) * w] for k in range(min(args.windows, len(ids) // w))]

    windows: list[float] = []  # the last ppl()'s mean NLL per window

    def ppl() -> float:
        nll = []
        with torch.no_grad():
            for c in chunks:
                logits = model(torch.tensor([c])).logits[0, :-1].double()
                nll.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor(c[1:]))))
        windows[:] = nll
        return math.exp(np.mean(nll))

    lins = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    orig = {n: m.weight.detach().clone() for n, m in lins.items()}
    xmax: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(mod, inp, out):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1]).abs().amax(0)
            xmax[name] = torch.maximum(xmax.get(name, torch.zeros_like(x)), x)
        return hook

    hooks = [m.register_forward_hook(record(n)) for n, m in lins.items()]
    base = ppl()
    for h in hooks:
        h.remove()
    print(f"fp32 {base:.3f} ({len(chunks)} windows of {w})", flush=True)

    def run(keep=lambda n: False, alpha=None, weights_only=False) -> float:
        hooks = []
        for n, m in lins.items():
            if keep(n):
                continue
            wt = orig[n]
            sm = None
            if alpha is not None:
                sm = (xmax[n].clamp_min(1e-5) ** alpha / wt.abs().amax(0).clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
            packed = int8.quantize_per_channel(wt * sm[None, :] if sm is not None else wt)
            if weights_only:
                m.weight.data.copy_(int8.dequantize(packed))
                continue
            q, s = torch.from_numpy(packed.q), torch.from_numpy(packed.scale)

            def hybrid(mod, inp, out, q=q, s=s, sm=sm):
                x = inp[0].reshape(-1, inp[0].shape[-1])
                y = int8.hybrid_linear(x / sm if sm is not None else x, q) * s
                return y.reshape(*inp[0].shape[:-1], -1)

            hooks.append(m.register_forward_hook(hybrid))
        try:
            return ppl()
        finally:
            for h in hooks:
                h.remove()
            for n, m in lins.items():
                m.weight.data.copy_(orig[n])

    def show(name: str, r: float) -> None:
        # the NLL per window too: alpha 0.5 and 0.8 once printed the same 30.556 on 4 windows
        # (30.55597 / 30.55584) from different windows (3.381 3.696 3.200 3.401 / 3.371 3.736 3.181 3.391)
        per = " ".join(f"{v:.4f}" for v in windows)
        print(f"| {name} | {r:.4f} | {(r / base - 1) * 100:+.2f} % | {per} |", flush=True)

    show("int8 weights, fp32 activations", run(weights_only=True))
    show("w8 (hybrid on every linear)", run())
    show("w8, down_proj fp32", run(keep=lambda n: "down_proj" in n))
    show("w8, lm_head fp32", run(keep=lambda n: "lm_head" in n))
    for a in args.alpha:
        show(f"w8 + SmoothQuant alpha {a}", run(alpha=a))


if __name__ == "__main__":
    main()
