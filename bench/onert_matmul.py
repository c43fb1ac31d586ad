"""Benchmark (not a test): the same matrix product as onert runs it, FULLY_CONNECTED against a
1x1 CONV_2D and a BATCH_MATMUL with a constant right operand, per shape, beside torch's
F.linear (MKL sgemm, torch.set_num_threads = NUM_THREADS: what the peer's prefill runs). The measurement behind circleops.lowering.linalg's choice for
target onert (CONV_2D from circleops.targets.ONERT.linear_as_conv.min_rows rows up, or for a very wide output).

    python bench/onert_matmul.py                       # the default shapes, 2 threads
    python bench/onert_matmul.py --shapes 64x512x32000 1x576x49152 --threads 1
    python bench/onert_matmul.py --ggml GGML_Q4_0 --shapes 1x576x1536 8x576x1536 64x576x1536 --threads 1

A shape is rows x in x out: x [rows, in] times a constant weight [out, in]. FULLY_CONNECTED
gets x as [1, rows, in]; CONV_2D gets [1, 1, rows, in] with the weight as its [out, 1, 1, in]
filter and a zero bias (onert's CONV_2D needs one); BATCH_MATMUL gets [1, rows, in] and the
weight transposed as [1, in, out]. All files come from circleops' own
writer, all outputs are checked against numpy, then the median of interleaved timed calls
is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_SHAPES = ["64x512x512", "64x512x1376", "64x1376x512", "64x512x32000", "64x576x49152", "64x2048x5632",
                  "16x512x32000", "4x512x32000", "4x576x1536", "2x576x1536", "1x576x1536", "1x2048x2048",
                  "1x512x4096", "1x512x8192", "1x512x32000", "1x576x49152", "1x2048x32000"]


def _model(kind: str, rows: int, inner: int, out: int, weight):
    import numpy as np

    from circleops import ir

    sg = ir.Subgraph("main")
    if kind == "FULLY_CONNECTED":
        x = sg.add_tensor(ir.Tensor("x", (1, rows, inner), "FLOAT32"))
        w = sg.add_tensor(ir.Tensor("w", (out, inner), "FLOAT32", weight))
        y = sg.add_tensor(ir.Tensor("y", (rows, out), "FLOAT32"))
        sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions", {}))
    elif kind == "BATCH_MATMUL":
        x = sg.add_tensor(ir.Tensor("x", (1, rows, inner), "FLOAT32"))
        w = sg.add_tensor(ir.Tensor("w", (1, inner, out), "FLOAT32", np.ascontiguousarray(weight.T)[None]))
        y = sg.add_tensor(ir.Tensor("y", (1, rows, out), "FLOAT32"))
        sg.operators.append(ir.Operator("BATCH_MATMUL", [x, w], [y], "BatchMatMulOptions", {}))
    else:
        x = sg.add_tensor(ir.Tensor("x", (1, 1, rows, inner), "FLOAT32"))
        w = sg.add_tensor(ir.Tensor("w", (out, 1, 1, inner), "FLOAT32", weight.reshape(out, 1, 1, inner)))
        b = sg.add_tensor(ir.Tensor("b", (out,), "FLOAT32", np.zeros(out, np.float32)))
        y = sg.add_tensor(ir.Tensor("y", (1, 1, rows, out), "FLOAT32"))
        sg.operators.append(ir.Operator("CONV_2D", [x, w, b], [y], "Conv2DOptions", {
            "padding": "VALID", "strideW": 1, "strideH": 1, "dilationWFactor": 1, "dilationHFactor": 1}))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})]), sg.tensors[x].shape


def _ggml_model(dtype: str, rows: int, inner: int, out: int, blocks):
    """One FULLY_CONNECTED with a GGML block weight, as circleops writes a quantized linear
    (x [rows, in], the weight's blocks [out, in]): onert runs it as a ggml graph of its own."""
    from circleops import ir

    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, inner), "FLOAT32"))
    w = sg.add_tensor(ir.Tensor("w", (out, inner), dtype, blocks))
    y = sg.add_tensor(ir.Tensor("y", (rows, out), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions", {}))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})])


def ggml(shapes: list[str], dtype: str, rounds: int = 40) -> int:
    """GGML FULLY_CONNECTED per shape: ms per call and per row (interleaved over the shapes),
    output checked against numpy on the dequantized weight (onert quantizes x to Q8_0)."""
    import numpy as np
    import onert
    import torch

    from circleops.quantize.ggml import dequantize, quantize
    from circleops.serialize import write_model

    rng = np.random.default_rng(0)
    sessions = {}
    with tempfile.TemporaryDirectory() as d:
        for spec in shapes:
            rows, inner, out = (int(v) for v in spec.lower().split("x"))
            weight = (rng.standard_normal((out, inner)) * inner ** -0.5).astype(np.float32)
            blocks = quantize(weight, dtype)
            x = rng.standard_normal((rows, inner)).astype(np.float32)
            path = Path(d) / f"{spec}.circle"
            write_model(_ggml_model(dtype, rows, inner, out, blocks), path)
            sess = onert.infer.session(str(path), "cpu")
            want = x @ dequantize(blocks, dtype, (out, inner)).numpy().T
            got = sess.infer([x])[0].reshape(rows, out)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            if err > 0.05:  # Q8_0 activations: ~1 % of the largest output
                print(f"{spec}: GGML FULLY_CONNECTED is wrong (relative error {err:.2e})", file=sys.stderr)
                return 1
            sessions[spec] = (sess, x, rows)
        times = {k: [] for k in sessions}
        cpu = {k: [] for k in sessions}
        for _ in range(rounds):
            for spec, (sess, x, _) in sessions.items():
                t, c = time.perf_counter(), time.process_time()
                sess.infer([x])
                times[spec].append(time.perf_counter() - t)
                cpu[spec].append(time.process_time() - c)
    print(f"{'rows x in x out':>18s} {dtype + ' FC':>14s} {'CPU':>9s} {'per row':>9s}   (onert, NUM_THREADS="
          f"{os.environ['NUM_THREADS']}, medians of {rounds} interleaved calls)")
    for spec, (_, _, rows) in sessions.items():
        wall, c = statistics.median(times[spec]) * 1e3, statistics.median(cpu[spec]) * 1e3
        print(f"{spec:>18s} {wall:11.3f} ms {c:6.3f} ms {wall / rows:6.3f} ms", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="ROWSxINxOUT (default: a sweep)")
    ap.add_argument("--threads", type=int, default=2, help="onert's NUM_THREADS (default 2)")
    ap.add_argument("--ggml", choices=["GGML_Q4_0", "GGML_Q8_0"], default=None,
                    help="time onert's GGML FULLY_CONNECTED with this weight type instead (ms per call and per row)")
    args = ap.parse_args(argv)
    os.environ["NUM_THREADS"] = str(args.threads)  # read when a session is created
    if args.ggml:
        return ggml(args.shapes, args.ggml)

    import numpy as np
    import onert

    from circleops.serialize import write_model

    rng = np.random.default_rng(0)
    import torch

    torch.set_num_threads(args.threads)
    print(f"{'rows x in x out':>18s} {'FULLY_CONNECTED':>16s} {'CONV_2D':>10s} {'conv/fc':>8s} {'BATCH_MATMUL':>13s} "
          f"{'torch':>10s} {'best/torch':>10s}   (onert and torch, {args.threads} threads, medians)")
    with tempfile.TemporaryDirectory() as d:
        for spec in args.shapes:
            rows, inner, out = (int(v) for v in spec.lower().split("x"))
            weight = (rng.standard_normal((out, inner)) * inner ** -0.5).astype(np.float32)
            x = rng.standard_normal((rows, inner)).astype(np.float32)
            want = x @ weight.T
            runs = {}
            for kind in ("FULLY_CONNECTED", "CONV_2D", "BATCH_MATMUL"):
                model, shape = _model(kind, rows, inner, out, weight)
                path = Path(d) / f"{kind}.circle"
                write_model(model, path)
                sess = onert.infer.session(str(path), "cpu")
                got = sess.infer([x.reshape(shape)])[0].reshape(rows, out)
                err = float(np.abs(got - want).max())
                if err > 1e-4:
                    print(f"{spec}: {kind} is wrong (max abs error {err:.2e})", file=sys.stderr)
                    return 1
                runs[kind] = (sess, x.reshape(shape))
            rounds = max(15, min(300, int(1e9 / (rows * inner * out))))
            times: dict[str, list[float]] = {k: [] for k in (*runs, "torch")}
            tx, tw = torch.from_numpy(x), torch.from_numpy(weight)
            for _ in range(rounds):
                for kind, (sess, xs) in runs.items():
                    t = time.perf_counter()
                    sess.infer([xs])
                    times[kind].append(time.perf_counter() - t)
                t = time.perf_counter()
                torch.nn.functional.linear(tx, tw)  # MKL's sgemm: the peer's prefill
                times["torch"].append(time.perf_counter() - t)
            fc, conv, bmm, ref = (statistics.median(times[k]) * 1e3
                                  for k in ("FULLY_CONNECTED", "CONV_2D", "BATCH_MATMUL", "torch"))
            print(f"{spec:>18s} {fc:13.2f} ms {conv:7.2f} ms {conv / fc:8.2f} {bmm:10.2f} ms {ref:7.2f} ms "
                  f"{min(fc, conv, bmm) / ref:10.2f}", flush=True)
            del runs
    return 0


if __name__ == "__main__":
    sys.exit(main())
