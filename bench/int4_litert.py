"""Benchmark (not a test): what LiteRT 2.3.0 runs for int4 weights, measured on one-op files
built with circleops' own IR and writer (issue 34; circleops.quantize.int4 states the facts).

    python bench/int4_litert.py            # print
    python bench/int4_litert.py --write    # -> bench/results/21-int4-ops.yaml and docs/benchmarks.md

For each block size: whether XNNPACK delegates the blockwise FULLY_CONNECTED, and how far
LiteRT's output is from circleops' kernel (int4.blockwise_linear: int8 asymmetric rows, block
scales rounded to bf16) and from the same kernel with the fp16 scales as they are (a file whose
scales are not bf16 values). Then the speed of one FULLY_CONNECTED, 1 and 64 rows, SmolLM2's
576x1536 and 1536x576 shapes: fp32, w8 (int8 per channel), int4 per channel, int4 blocks of
32 / 64 / 128, medians of interleaved repetitions, 1 and 2 threads, with the load average.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS_FILE = ROOT / "bench" / "results" / "21-int4-ops.yaml"

from circleops import ir  # noqa: E402
from circleops.quantize import int4, int8  # noqa: E402
from circleops.quantize.int4_tflite import weight_tensor  # noqa: E402
from circleops.serialize import write_model  # noqa: E402


def fc_file(path: str, weight: ir.Tensor, rows: int, version: int) -> None:
    n, k = weight.shape
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, k), "FLOAT32"))
    w = sg.add_tensor(weight)
    y = sg.add_tensor(ir.Tensor("y", (rows, n), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": 0, "keepNumDims": False}, version))
    sg.inputs, sg.outputs = [x], [y]
    write_model(ir.Model([sg]), path, "tflite")


def interpreter(path: str, x: np.ndarray, threads: int = 1):
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path, num_threads=threads)
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return it


def delegation(work: str) -> list[list[str]]:
    rng = np.random.default_rng(0)
    rows = []
    for block in (8, 16, 32, 64, 96, 128, 192):
        n, k = 64, 576 if 576 % block == 0 else 384
        q = rng.integers(-8, 8, (n, k)).astype(np.int8)
        scales = rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float16)
        packed = int4.Int4Weight(q, scales, block)
        x = (rng.standard_normal((2, k)) + 0.5).astype(np.float32)
        path = os.path.join(work, f"b{block}.tflite")
        fc_file(path, weight_tensor("w", (n, k), packed), 2, 13)
        it = interpreter(path, x)
        got = it.get_tensor(it.get_output_details()[0]["index"])
        delegated = any(o["op_name"] == "DELEGATE" for o in it._get_ops_details())
        xt, qt = torch.from_numpy(x), torch.from_numpy(q)
        bf16 = int4.blockwise_linear(xt, qt, torch.from_numpy(scales.astype(np.float32)), block).numpy()
        # the same product with the fp16 scales as they are (no bf16 rounding)
        xq, sx, _ = int8.quantize_rows_asymmetric(xt)
        wd = qt.double() * torch.from_numpy(scales.astype(np.float64)).repeat_interleave(block, 1)
        fp16 = ((xq @ wd.T) * sx.double()).numpy()
        scale = float(np.abs(bf16).max())
        rows.append([str(block), f"{k}", "yes" if delegated else "no (builtin kernel)",
                     f"{np.abs(got - bf16).max() / scale:.1e}", f"{np.abs(got - fp16).max() / scale:.1e}"])
    return rows


def speed(work: str, threads: int, reps_one: int, rounds: int) -> list[list[str]]:
    rng = np.random.default_rng(1)
    out = []
    for n, k in ((1536, 576), (576, 1536)):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        forms = {"fp32": (ir.Tensor("w", (n, k), "FLOAT32", w), 1)}
        p8 = int8.quantize_per_channel(w)
        forms["w8"] = (ir.Tensor("w", (n, k), "INT8", p8.q, ir.QuantParams(p8.scale, np.zeros(n, np.int64), 0)), 5)
        for name, block in (("int4-pc", 0), ("int4 b32", 32), ("int4 b64", 64), ("int4 b128", 128)):
            b = int4.block_for(k, block)
            forms[name if b == block else f"{name} (b{b})"] = (weight_tensor("w", (n, k), int4.quantize(w, b)), 13)
        for rows in (1, 64):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            its = {}
            for name, (t, version) in forms.items():
                path = os.path.join(work, f"s_{n}_{k}_{rows}_{name.replace(' ', '_')}.tflite")
                fc_file(path, t, rows, version)
                its[name] = interpreter(path, x, threads)
            times = {name: [] for name in its}
            reps = reps_one if rows == 1 else max(1, reps_one // 20)
            for _ in range(rounds):
                for name, it in its.items():
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        it.invoke()
                    times[name].append((time.perf_counter() - t0) / reps * 1e6)
            w8 = float(np.median(times["w8"]))
            for name, ts in times.items():
                med = float(np.median(ts))
                out.append([f"{n}x{k}", str(rows), str(threads), name, f"{med:.1f}", f"{med / w8:.2f}"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=2000, help="invocations per timing of a one-row product")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as work:
        deleg = delegation(work)
        sp = [r for t in args.threads for r in speed(work, t, args.reps, args.rounds)]
    load1 = os.getloadavg()[0]
    for r in deleg:
        print(" | ".join(r))
    for r in sp:
        print(" | ".join(r))
    if args.write:
        import yaml

        sys.path.insert(0, str(ROOT / "bench"))
        import report
        from llm_speed import cpu_flags, cpu_model

        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        data = {"heading": "bench/int4_litert.py — int4 weights in LiteRT 2.3.0, one FULLY_CONNECTED (issue 34)",
                "blocks": [
                    {"text": f"`python bench/int4_litert.py --write` ({stamp}). CPU: {cpu_model()}, flags "
                             f"{', '.join(cpu_flags())}. Load average (1 min) before / after: {load0:.1f} / {load1:.1f}. "
                             f"{args.note}\n"},
                    {"heading": "### Which blocks XNNPACK takes, and the scale it computes with"},
                    {"text": "INT4 weight [64, K], BlockwiseQuantization with FLOAT16 scales that are not bf16 values, "
                             "2 input rows. Error relative to the output's largest magnitude, against circleops' kernel "
                             "(int8 asymmetric rows, block scales rounded to bf16) and against the same product with the "
                             "fp16 scales as stored: XNNPACK computes with bf16 scales.\n"},
                    {"table": {"columns": ["block", "K", "XNNPACK delegates", "vs kernel (bf16 scales)",
                                           "vs fp16 scales"],
                               "align": ["right", "right", "left", "right", "right"], "rows": deleg}},
                    {"heading": "### One product's time against w8 (median µs of interleaved repetitions)"},
                    {"table": {"columns": ["weight N x K", "rows", "threads", "weights", "µs", "/ w8"],
                               "align": ["left", "right", "right", "left", "right", "right"], "rows": sp}},
                ]}
        RESULTS_FILE.write_text(yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True))
        report.main([])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
