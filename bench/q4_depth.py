"""Why a q4_0 file's verify error grows with depth (issue 32): one written prefill graph run
by onert and by the reference interpreter (the same weights, the same Q8_0 input rounding in
torch), and by the reference interpreter with that rounding perturbed below one fp32 ulp.

    python bench/q4_depth.py OUT_DIR [--tokens 32] [--runs onert,reference,jitter,jitter2,half-away]

OUT_DIR: a `circleops convert --graphs prefill,decode --target onert --quantize q4_0` directory.
The prompt is the first ``--tokens`` of verify's ids (circleops.sources.models.example_token_ids), run
as verify runs it (the longest prefill graph from pos 0). Printed: each run's max abs
difference of the last prompt token's logits from the reference interpreter's.

  jitter       each GGML linear's input multiplied by (1 + u 2^-24), u uniform in [-1, 1]
               (one fp32 rounding more or less: what another summation order does to it)
  half-away    the Q8_0 codes rounded half away from zero (ggml's scalar reference) instead of to even
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def jittered(scale: float, seed: int):
    from circleops.quantize import ggml

    g = torch.Generator().manual_seed(seed)

    def q8(x: torch.Tensor) -> torch.Tensor:
        u = 2 * torch.rand(x.shape, generator=g) - 1
        return ggml.quantize_q8_0_input(x * (1 + scale * u))
    return q8


def half_away(x: torch.Tensor) -> torch.Tensor:
    from circleops.quantize.ggml import BLOCK

    xb = x.to(torch.float32).reshape(-1, BLOCK)
    amax = xb.abs().amax(dim=1, keepdim=True)
    mul = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    v = xb * mul
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * (amax / 127.0).to(torch.float16).to(torch.float32)).reshape(x.shape)


def logits(directory: str, ids: list[int], runtime: str, rounding=None, dense=None) -> np.ndarray:
    from circleops.generation.generator import empty_caches, open_graph
    from circleops.package.manifest import read_manifest
    from circleops.runtime.kernels import nn

    m = read_manifest(Path(directory))
    n = max(m.prefill_graphs)
    buf = np.full((1, n), m.pad_token_id, dtype=np.int64)
    buf[0, :len(ids)] = ids
    from circleops.quantize import ggml

    saved, saved_dense = nn.quantize_q8_0_input, ggml.BlockTensor.dense
    session = out = None
    if dense is not None:
        ggml.BlockTensor.dense = dense
    if rounding is not None:
        nn.quantize_q8_0_input = rounding
    try:
        session = open_graph(m, m.prefill_graphs[n], runtime)
        out = session.run([buf, np.zeros(1, np.int64), np.array([len(ids) - 1], np.int64), *empty_caches(m)])
        return np.array(out[0][0, 0])
    finally:
        nn.quantize_q8_0_input, ggml.BlockTensor.dense = saved, saved_dense
        session = out = None
        gc.collect()  # the interpreter's unpacked weights (5 GB at 1B) before the next run


def damaged(tensor_index: int, blocks: slice, factor: float):
    """A BlockTensor.dense whose ``tensor_index``-th Q4_0 weight (in first-use order) has the
    fp16 scales of ``blocks`` multiplied by ``factor``: a wrong block scale, as a packing bug
    would write it."""
    from circleops.quantize import ggml

    seen = []
    original = ggml.BlockTensor.dense

    def dense(self):
        if self._dense is None and self.dtype == "GGML_Q4_0" and len(self.shape) == 2:
            seen.append(self)
            if len(seen) == tensor_index + 1:
                b = self.blocks.clone().reshape(-1, 18)
                d = b[blocks, :2].contiguous().view(torch.float16).float() * factor
                b[blocks, :2] = d.to(torch.float16).view(torch.uint8)
                self._dense = ggml.dequantize(b, self.dtype, self.shape)
        return original(self)
    return dense


RUNS = {"reference": ("reference", None), "onert": ("onert", None),
        "jitter": ("reference", jittered(2.0 ** -24, 1)), "jitter2": ("reference", jittered(2.0 ** -24, 2)),
        "half-away": ("reference", half_away),
        "jitter-2^-20": ("reference", jittered(2.0 ** -20, 1)), "jitter-2^-16": ("reference", jittered(2.0 ** -16, 1)),
        # the first Q4_0 weight (layer 0's q projection): block 0's scale x2; every block x2
        "one-block-x2": ("reference", None, damaged(0, slice(0, 1), 2.0)),
        "one-row-x2": ("reference", None, damaged(0, slice(0, 64), 2.0)),
        "tensor-x1.1": ("reference", None, damaged(0, slice(None), 1.1)),
        "tensor-x2": ("reference", None, damaged(0, slice(None), 2.0)),
        "mid-tensor-x2": ("reference", None, damaged(50, slice(None), 2.0))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", default="reference,onert,jitter,jitter2,half-away")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from circleops.package.manifest import read_manifest
    from circleops.sources.models import example_token_ids

    vocab = read_manifest(Path(args.directory)).vocab_size
    ids = [int(i) for i in example_token_ids(args.tokens + 1, vocab)[0][:args.tokens]]
    if args.child:  # one run per process: the interpreter's unpacked weights leave with it
        np.save(f"/tmp/q4_depth_{args.child}.npy", logits(args.directory, ids, *RUNS[args.child]))
        return 0
    res: dict = {}
    base = None
    names = args.runs.split(",")
    for name in names:
        t = time.time()
        usage = _run_child([sys.executable, __file__, args.directory, "--tokens", str(args.tokens), "--child", name])
        got = np.load(f"/tmp/q4_depth_{name}.npy")
        if base is None:
            base = got
            res["max_logit"] = float(np.abs(got).max())
        res[name] = float(np.abs(got - base).max())
        print(f"{name}: max abs logit difference from {names[0]} {res[name]:.4g} (max|logit| {res['max_logit']:.3g}; "
              f"{usage.ru_utime + usage.ru_stime:.0f} s CPU, peak RSS {usage.ru_maxrss / 1e6:.1f} GB, "
              f"{time.time() - t:.0f} s wall)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def _run_child(cmd: list[str]):
    import os
    import subprocess

    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd[-1]} failed: status {status}")
    return usage


if __name__ == "__main__":
    sys.exit(main())
