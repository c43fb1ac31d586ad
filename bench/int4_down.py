"""Benchmark (not a test): SmolLM2-135M's MLP down projections at 4 bits in the LiteRT int4 file (issue 34).

    python bench/int4_down.py --out /tmp/int4down/emulation.json      # every variant, both texts

torch emulating the file's arithmetic (as bench/int4_quality.py: int4 blocks of 32 with
importance-weighted bf16-grid scales, or int8 per channel; one int8 table for the embedding
and tied head; every linear's input rounded to int8 per row, asymmetric, as XNNPACK's qd8
kernels do). Perplexity in windows of 256 on two texts: the SELECTION text
(circleops/quantize/selection.txt), on which choices are made, and the shipped scored text
(perplexity.txt), which is only reported. Variants of the 30 downs' rounding:

* ``rtn``: circleops.quantize.int4.quantize (what every other int4 linear gets);
* ``clip``: the same with wider clipping candidates (the block's largest magnitude onto up to
  -12 levels: clipped) — circleops.quantize.int4's candidate search, extended;
* ``gptq``: GPTQ at those static scales, act order, Hessian of the calibration text
  (circleops.quantize.int4_gptq.gptq_static), damping 0.01 and 0.1;
* ``had32``: an online Hadamard of 32 on each down's input (x·H per block of 32, folded into the
  weight as W·H), the rotation a LiteRT graph could carry as one small product per layer;
* ``b16``: blocks of 16 (XNNPACK does not delegate them: information only);
* per-layer: each down alone at 4 bits (``--per-layer``), the others int8, on the selection text;
  then the least sensitive k downs at 4 bits for k in ``--ks``, on both texts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def perplexity(model: torch.nn.Module, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w])).logits[0, :-1].double()
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
            n += len(w) - 1
    return math.exp(nll / n)


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def clipped_quantize(w: torch.Tensor, imp: torch.Tensor, extra: tuple[float, ...]):
    from circleops.quantize import int4

    saved = int4._MULTIPLIERS
    int4._MULTIPLIERS = saved + tuple(-(8.0 + s) for s in extra)
    try:
        return int4.quantize(w, 32, imp)
    finally:
        int4._MULTIPLIERS = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=["rtn", "clip", "gptq", "gptq-d0.1", "had32", "b16"])
    ap.add_argument("--per-layer", default="", help="the rounding the per-layer ranking uses (empty: none)")
    ap.add_argument("--ks", type=int, nargs="*", default=[10, 15, 20, 25])
    ap.add_argument("--shares", type=float, nargs="*", default=[],
                    help="int4_choice.choose at these shares (its measured choice), each scored on both texts")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from circleops.sources.models import load_smollm2
    from circleops.tools.quant_report import text_ids
    from circleops.quantize import int4, int8
    from circleops.quantize.importance import input_importance, calibration_ids
    from circleops.quantize.selection import selection_ids

    model, tok = load_smollm2()
    model.eval()
    wins = {}
    for label, ids in (("selection", selection_ids(tok, 49152)), ("shipped", text_ids(tok, 49152))):
        wins[label] = [ids[k * args.window:(k + 1) * args.window] for k in range(len(ids) // args.window)]
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load0": os.getloadavg()[0],
                 "windows": {k: len(v) for k, v in wins.items()}, "rows": []}
    cpu0 = time.process_time()

    def score(label: str) -> dict:
        row = {"variant": label}
        for t, w in wins.items():
            p = perplexity(model, w)
            row[t] = round(p, 4)
            row[t + "_pct"] = round(100 * (p / out["fp32"][t] - 1), 3)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        Path(args.out).write_text(json.dumps(out, indent=1))
        return row

    out["fp32"] = {}
    for t, w in wins.items():
        out["fp32"][t] = perplexity(model, w)
    print("fp32", out["fp32"], flush=True)
    importance = input_importance(model, (), tok)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    imp = {n: importance.get(("torch", m.weight.untyped_storage().data_ptr(), m.weight.numel(), str(m.weight.dtype)))
           for n, m in linears.items()}
    downs = [n for n in linears if n.endswith("mlp.down_proj")]
    # GPTQ Hessians (calibration text) and rotated-input importances of the downs, fp32 model
    from circleops.quantize.gptq import hessians
    from circleops.quantize.int4_gptq import gptq_static

    need_h = any(m.startswith("gptq") for m in args.methods)
    hs, tokens = (hessians(model, {n: linears[n] for n in downs}, [(calibration_ids(model, tok),)])
                  if need_h else ({}, 0))
    H32 = hadamard(32)
    rot_imp: dict[str, torch.Tensor] = {}
    if "had32" in args.methods:
        def rot(x: torch.Tensor) -> torch.Tensor:
            return (x.reshape(*x.shape[:-1], -1, 32) @ H32).reshape(x.shape)

        acc = {n: [torch.zeros(linears[n].in_features, dtype=torch.float64), 0] for n in downs}
        hooks = []
        for n in downs:
            def pre(mod, inputs, n=n):
                x = rot(inputs[0].reshape(-1, inputs[0].shape[-1]))
                acc[n][0] += (x.double() ** 2).sum(0)
                acc[n][1] += x.shape[0]
            hooks.append(linears[n].register_forward_pre_hook(pre))
        with torch.no_grad():
            model(calibration_ids(model, tok))
        for h in hooks:
            h.remove()
        rot_imp = {n: (a / max(c, 1)).float() for n, (a, c) in acc.items()}

    # the convert's measured choice (circleops.quantize.int4_choice) at each share, on the float model
    from circleops.quantize import int4_choice

    choices = {}
    for share in args.shares:
        c0 = time.process_time()
        choice = int4_choice.choose(model, tok, importance, 32, "int4", share=share)
        choices[share] = (choice, time.process_time() - c0)
        print(share, choice.summary_line(), flush=True)
    # the file's arithmetic: int8 per-row rounding of every linear's input, the int8 table
    rotate_input: set[str] = set()

    def rounded_input(mod, inputs):
        x = inputs[0]
        if getattr(mod, "_had32", False):
            x = (x.reshape(*x.shape[:-1], -1, 32) @ H32).reshape(x.shape)
        xq, sx, _ = int8.quantize_rows_asymmetric(x.reshape(-1, x.shape[-1]))
        return ((xq.to(torch.float32) * sx).reshape(x.shape),)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(rounded_input)
    table = model.model.embed_tokens.weight
    with torch.no_grad():
        table.copy_(int8.dequantize(int8.quantize_per_channel(table.detach().clone())))
        for n, m in linears.items():
            if n not in downs:
                m.weight.copy_(int4.dequantize(int4.quantize(original[n], 32, imp[n])))
    eight = {n: int8.dequantize(int8.quantize_per_channel(original[n])) for n in downs}

    def down_weights(method: str) -> dict[str, torch.Tensor]:
        res = {}
        for n in downs:
            w = original[n]
            if method == "rtn":
                res[n] = int4.dequantize(int4.quantize(w, 32, imp[n]))
            elif method == "clip":
                res[n] = int4.dequantize(clipped_quantize(w, imp[n], (1.5, 2.0, 2.5, 3.0, 4.0)))
            elif method.startswith("gptq"):
                damp = float(method.split("-d")[1]) if "-d" in method else 0.01
                packed = int4.quantize(w, 32, imp[n])
                scale = int4.expanded_scales(packed)
                res[n] = gptq_static(w, hs[n], scale, damp=damp) * scale
            elif method == "had32":
                wr = (w.reshape(w.shape[0], -1, 32) @ H32).reshape(w.shape)  # W·H (H symmetric)
                res[n] = int4.dequantize(int4.quantize(wr, 32, rot_imp[n]))
            elif method == "b16":
                res[n] = int4.dequantize(int4.quantize(w, 16, imp[n]))
            else:
                raise ValueError(method)
        return res

    def apply(four: dict[str, torch.Tensor], at4: set[str], had: bool = False) -> None:
        with torch.no_grad():
            for n in downs:
                linears[n]._had32 = had and n in at4
                linears[n].weight.copy_(four[n] if n in at4 else eight[n])

    apply({}, set())
    score("current: downs int8")
    methods: dict[str, dict] = {}
    for method in args.methods:
        t0 = time.process_time()
        methods[method] = down_weights(method)
        apply(methods[method], set(downs), had=method == "had32")
        row = score(f"all downs int4 {method}")
        row["rounding_cpu_s"] = round(time.process_time() - t0, 1)
    for share, (choice, cpu) in choices.items():
        four = methods.get("rtn") or down_weights("rtn")
        at4 = {n for n in downs if f"{n}.weight" in choice.four_bit}
        apply(four, at4)
        row = score(f"share {share}: {len(at4)} downs int4, kept int8: "
                    + " ".join(n.split(".")[2] for n in downs if n not in at4))
        row["choose_cpu_s"] = round(cpu, 1)
        row["costs"] = {n.split(".")[2]: c for n, c in choice.costs.items()}
    if args.per_layer:
        method = args.per_layer
        four = methods.get(method) or down_weights(method)
        base = out["rows"][0]["selection"]
        sens = {}
        for n in downs:
            apply(four, {n}, had=method == "had32")
            sens[n] = perplexity(model, wins["selection"]) / base - 1
            print(f"{n} {100 * sens[n]:+.3f} %", flush=True)
        out["per_layer_selection_pct"] = {n: round(100 * s, 4) for n, s in sens.items()}
        order = sorted(downs, key=lambda n: sens[n])
        for k in args.ks:
            apply(four, set(order[:k]), had=method == "had32")
            score(f"{k} least sensitive downs int4 {method} (chosen on selection)")
    out["cpu_s"] = round(time.process_time() - cpu0, 1)
    out["load1"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
