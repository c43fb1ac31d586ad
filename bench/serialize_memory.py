"""Benchmark (not a test): time and peak RSS of write_model on a large synthetic model.

    python bench/serialize_memory.py --gb 1.0 --fmt circle [--weights-after] [--path out]

Builds a chain of FULLY_CONNECTED layers whose weights total --gb GiB (fp32 torch
parameters, plus one tied embedding used twice), then writes it. Prints the weight bytes,
peak RSS before and during the write, and the ratio peak / weight bytes.
"""
from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build(gb: float, hidden: int = 2048, transposed: bool = False):
    import torch

    from circleops import ir

    per_layer = hidden * hidden * 4
    n_layers = max(1, int(gb * 2**30 // per_layer))
    g = torch.Generator().manual_seed(0)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, hidden), "FLOAT32"))
    sg.inputs = [x]
    emb = torch.empty(hidden, hidden).uniform_(-0.05, 0.05, generator=g)  # tied: stored once
    cur = x
    for i in range(n_layers):
        w = emb if i in (0, n_layers - 1) else torch.empty(hidden, hidden).uniform_(-0.05, 0.05, generator=g)
        if transposed:  # non-contiguous views: the writer copies each one only while writing it
            w = w.t()
        wi = sg.add_tensor(ir.Tensor(f"layer{i}.weight", (hidden, hidden), "FLOAT32", w))
        y = sg.add_tensor(ir.Tensor(f"h{i}", (1, hidden), "FLOAT32"))
        sg.operators.append(ir.Operator("FULLY_CONNECTED", [cur, wi, -1], [y], "FullyConnectedOptions", {}))
        cur = y
    sg.outputs = [cur]
    model = ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": cur})])
    weight_bytes = (n_layers - 1) * per_layer if n_layers > 1 else per_layer
    return model, weight_bytes, n_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--fmt", default="circle")
    ap.add_argument("--weights-after", action="store_true")
    ap.add_argument("--path")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--transposed", action="store_true", help="weights as non-contiguous w.t() views")
    args = ap.parse_args()

    import torch  # noqa: F401 - imported before the baseline

    from circleops.serialize import write_model

    base = rss_mb()
    model, weight_bytes, n = build(args.gb, transposed=args.transposed)
    after_build = rss_mb()
    path = args.path or os.path.join(tempfile.gettempdir(), f"bench_serialize.{args.fmt}")
    t0 = time.perf_counter()
    info = write_model(model, path, args.fmt, weights_after=args.weights_after or None)
    dt = time.perf_counter() - t0
    peak = peak_mb()
    w = weight_bytes / 2**20
    print(f"layers {n}, unique weight bytes {w:.0f} MB, file {info.file_bytes / 2**20:.0f} MB, layout {info.layout}, "
          f"shared {info.shared_buffers}")
    print(f"RSS: imports {base:.0f} MB, after building weights {after_build:.0f} MB, peak {peak:.0f} MB")
    print(f"write_model {dt:.2f} s ({info.file_bytes / 2**20 / dt:.0f} MB/s); "
          f"peak RSS / weight bytes = {peak / w:.3f}; extra over the built model {peak - after_build:.0f} MB")
    if not args.keep:
        os.unlink(path)


if __name__ == "__main__":
    main()
