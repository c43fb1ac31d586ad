"""Benchmark (not a test): which SmolLM2-135M linears an int4 file keeps at 8 bits (issue 34).

    python bench/int4_quality.py                         # every variant, 8 windows of 256
    python bench/int4_quality.py --variants int4 int4+down8 --write   # -> bench/results/28-int4-quality.yaml

Each variant is torch running the weights the tflite file would hold, with the arithmetic
LiteRT's XNNPACK does on them: every decoder linear int4 in blocks of 32 (circleops.quantize.int4:
importance-weighted scales on the bf16 grid, the importance of `convert`'s calibration text) or,
where the variant says, int8 per channel (circleops.quantize.int8); the embedding and the tied
head one int8 table; every linear's input rounded to int8 per row, asymmetric, as XNNPACK's qd8
kernels do (circleops.quantize.int8.quantize_rows_asymmetric). Perplexity on circleops' shipped
text (circleops.tools.quant_report.text_ids), windows of 256 from an empty cache, as `circleops check`
scores a file. The all-int4 variant agrees with LiteRT running the file (bench/results/23-*:
30.811, this emulation 30.795), so the variants need no file each. The extra bytes are those
of the linears kept int8 over their int4 blocks.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS_FILE = ROOT / "bench" / "results" / "28-int4-quality.yaml"

# variant -> the linears (parameter name predicate) kept int8 per channel
VARIANTS = {
    "int4": lambda n: False,
    "int4+down8": lambda n: "mlp.down_proj" in n,
    "int4+v8": lambda n: "self_attn.v_proj" in n,
    "int4+first/last layer 8": lambda n: re.search(r"layers\.(0|29)\.", n) is not None,
}


def perplexity(model: torch.nn.Module, windows: list[list[int]]) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(torch.tensor([w])).logits[0, :-1].double()
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(w[1:]), reduction="sum").item()
            n += len(w) - 1
    return math.exp(nll / n)


def text_windows(tok, window: int) -> dict[str, list[list[int]]]:
    """The SELECTION text (choices) and the shipped perplexity text (the figure), each as
    consecutive windows of ``window`` token ids (bench/int4_down.py, bench/int4_head.py)."""
    from circleops.quantize.selection import selection_ids
    from circleops.tools.quant_report import text_ids

    wins = {}
    for label, ids in (("selection", selection_ids(tok, 49152)), ("shipped", text_ids(tok, 49152))):
        wins[label] = [ids[k * window:(k + 1) * window] for k in range(len(ids) // window)]
    return wins


def scorer(model: torch.nn.Module, wins: dict[str, list[list[int]]], out: dict, path: str):
    """score(label, **extra): the perplexity on each text's windows, as % over out["fp32"], one
    row appended to out["rows"] and the run's JSON rewritten at ``path`` (bench/int4_down.py,
    bench/int4_head.py: a run interrupted keeps its rows)."""
    import json

    def score(label: str, **extra) -> dict:
        row = {"variant": label, **extra}
        for t, w in wins.items():
            p = perplexity(model, w)
            row[t] = round(p, 4)
            row[t + "_pct"] = round(100 * (p / out["fp32"][t] - 1), 3)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
        Path(path).write_text(json.dumps(out, indent=1))
        return row

    return score


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from circleops.sources.models import load_smollm2
    from circleops.tools.quant_report import text_ids
    from circleops.quantize import int4, int8
    from circleops.quantize.importance import input_importance

    model, tok = load_smollm2()
    model.eval()
    ids = text_ids(tok, 49152)
    windows = [ids[k * args.window:(k + 1) * args.window] for k in range(len(ids) // args.window)]
    load0, started = os.getloadavg()[0], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    fp32 = perplexity(model, windows)
    print(f"fp32 {fp32:.3f}", flush=True)
    importance = input_importance(model, (), tok)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    imp = {n: importance.get(("torch", m.weight.untyped_storage().data_ptr(), m.weight.numel(), str(m.weight.dtype)))
           for n, m in linears.items()}

    def rounded_input(mod, inputs):
        x = inputs[0]
        xq, sx, _ = int8.quantize_rows_asymmetric(x.reshape(-1, x.shape[-1]))
        return ((xq.to(torch.float32) * sx).reshape(x.shape),)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(rounded_input)
    table = model.model.embed_tokens.weight  # tied: the head's int8 rows too
    with torch.no_grad():
        table.copy_(int8.dequantize(int8.quantize_per_channel(table.detach().clone())))
    four = {n: int4.quantize(w, 32, imp[n]) for n, w in original.items()}
    rows = []
    for name in args.variants:
        eight, extra = VARIANTS[name], 0
        with torch.no_grad():
            for n, m in linears.items():
                if eight(n):
                    p8 = int8.quantize_per_channel(original[n])
                    m.weight.copy_(int8.dequantize(p8))
                    extra += p8.q.nbytes + p8.scale.nbytes - four[n].nbytes
                else:
                    m.weight.copy_(int4.dequantize(four[n]))
        ppl = perplexity(model, windows)
        print(f"{name}: {ppl:.3f} ({ppl / fp32 - 1:+.2%}), +{extra / 1e6:.1f} MB", flush=True)
        rows.append([name, f"{ppl:.3f}", f"{ppl / fp32 - 1:+.2%}", f"+{extra / 1e6:.1f}"])
    if args.write:
        import yaml

        sys.path.insert(0, str(ROOT / "bench"))
        import report

        text = (f"`python bench/int4_quality.py --write` ({started}; load average {load0:.1f} / "
                f"{os.getloadavg()[0]:.1f}). SmolLM2-135M, torch emulating the int4 file's arithmetic (int4 blocks of "
                f"32 or int8 per channel per linear, int8 table and head, XNNPACK's per-row int8 input rounding), "
                f"perplexity on the shipped text, {len(windows)} windows of {args.window}; torch fp32 {fp32:.3f}. "
                f"{args.note}").rstrip() + "\n"
        data = {"heading": "bench/int4_quality.py — which SmolLM2 linears the int4 file keeps at 8 bits (issue 34)",
                "blocks": [{"text": text},
                           {"table": {"columns": ["variant", "perplexity", "vs fp32", "file MB over all-int4"],
                                      "align": ["left", "right", "right", "right"], "rows": rows}}]}
        RESULTS_FILE.write_text(yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True))
        report.main([])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
