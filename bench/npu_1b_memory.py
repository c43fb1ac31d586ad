"""Issue 32, the 16a4w convert at the Llama-3.2-1B shape: the memory of its two row-blocked steps,
measured on a table of ROWS x 2048 fp32 (the lm_head / embedding are 128256 x 2048), whole (the
block knob set past the table: the code before) against by blocks (the default), each in a fresh
process (ru_maxrss above the table once it exists):

* GPTQ 8-bit per output channel (circleops.quantize.gptq.row_blocks, GPTQ_ROW_ELEMENTS) with a
  Hessian of 512 random rows;
* the integer lowering's quantize_array + params_from_data, int8 per row
  (circleops.quantize.integer.graph.BLOCK_ELEMENTS).

    python bench/npu_1b_memory.py --rows 32064
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def child(what: str, rows: int, whole: bool) -> dict:
    import torch

    from circleops.quantize import gptq
    from circleops.quantize.integer import graph

    torch.manual_seed(0)
    w = torch.randn(rows, 2048)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if what == "gptq":
        G = gptq
        x = torch.randn(512, 2048)
        h = x.T @ x
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if whole:
            G.GPTQ_ROW_ELEMENTS = w.numel()
        with torch.no_grad():
            for r in G.row_blocks(w):
                b = w[r]
                q, scale = G.gptq(b, h, 8)
                b.copy_(q * scale[:, None])
        check = float(w.double().sum())
    else:
        G = graph
        if whole:
            G.BLOCK_ELEMENTS = w.numel()
        qp = G.params_from_data(w, "INT8", 0)
        check = int(G.quantize_array(w, "INT8", qp).astype("int64").sum())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"step": what, "rows": rows, "whole": whole, "table_gb": w.numel() * 4 / 1e9,
            "peak_above_table_gb": (peak - base) / 1e6, "check": check}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32064)
    ap.add_argument("--child", nargs=2, metavar=("STEP", "WHOLE"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.rows, args.child[1] == "1")))
        return 0
    for what in ("gptq", "quantize_array"):
        for whole in (True, False):
            out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--child", what, str(int(whole))],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"{what:15s} {'whole' if whole else 'blocks':6s} table {r['table_gb']:.3f} GB: peak "
                  f"{r['peak_above_table_gb']:.2f} GB above it (check {r['check']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
