"""Integer (PT2E) models: accuracy against fp32, and onert latency.

    python bench/pt2e.py smollm2 [--calibrate 8]   # SmolLM2-135M: int16 and uint8 files
    python bench/pt2e.py convnet                   # ResNet-style net with instance norm, uint8

smollm2: the fp32 model greedily continues "Once upon a time," by 32 tokens; each integer
file (circleops.convert(..., quantize=...), run by the reference interpreter's integer
kernels) reads that same sequence once (teacher forcing). Reported: logits SQNR in dB
(10·log10(Σ fp32² / Σ (fp32 - int)²) over the 32 predicted positions), greedy agreement
(argmax equal at each of the 32 positions), file size and convert time.

convnet: a small ResNet-style classifier (conv + instance norm + ReLU, residual blocks,
global average pool, linear), random weights (seed 0), 64 seeded inputs: top-1 agreement
of the uint8 file (run in onert) with fp32 torch, and onert latency of the fp32 and uint8
files (interleaved medians, 1 thread).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

PROMPT = "Once upon a time,"
NEW_TOKENS = 32


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - got) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


def smollm2(calibrate: int) -> None:
    import circleops
    from circleops import models
    from circleops.runtime import reference

    model, tok = models.load_smollm2()
    model.eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        fp = model(seq).logits[0, ids.shape[1] - 1:-1].numpy()  # the 32 predicting positions
    print(f"SmolLM2-135M, prompt {PROMPT!r} + {NEW_TOKENS} greedy tokens (seq {seq.shape[1]}), "
          f"calibration {calibrate} windows of circleops/quantize/calibration.txt")
    print(f"fp32 continuation: {tok.decode(seq[0, ids.shape[1]:])!r}")
    print("| file | logits SQNR (dB) | greedy agreement (32 tokens) | file size | convert time |")
    print("|---|---|---|---|---|")
    tmp = tempfile.mkdtemp()
    for scheme in ("int16", "uint8"):
        path = os.path.join(tmp, f"smollm2_{scheme}.circle")
        t = time.perf_counter()
        circleops.convert(model, (seq,), path, target="circle", quantize=scheme, calibrate=calibrate, tokenizer=tok)
        seconds = time.perf_counter() - t
        logits = reference.run(path, [seq.numpy()])[0][0, ids.shape[1] - 1:-1]
        agree = int((logits.argmax(-1) == fp.argmax(-1)).sum())
        print(f"| {scheme} activations, int8 weights | {sqnr_db(fp, logits):.1f} | {agree}/{NEW_TOKENS} | "
              f"{os.path.getsize(path) / 2**20:.0f} MB | {seconds:.0f} s |")


class Block(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(c, c, 3, padding=1), nn.InstanceNorm2d(c, affine=True)
        self.c2, self.n2 = nn.Conv2d(c, c, 3, padding=1), nn.InstanceNorm2d(c, affine=True)

    def forward(self, x):
        return torch.relu(self.n2(self.c2(torch.relu(self.n1(self.c1(x))))) + x)


class ResNetIN(nn.Module):
    """conv stem, 3 residual blocks with instance norm, 2 strided convs, pool, linear."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.InstanceNorm2d(w, affine=True), nn.ReLU())
        self.body = nn.Sequential(Block(w), nn.Conv2d(w, 2 * w, 3, 2, 1), nn.ReLU(), Block(2 * w),
                                  nn.Conv2d(2 * w, 4 * w, 3, 2, 1), nn.ReLU(), Block(4 * w))
        self.head = nn.Linear(4 * w, classes)

    def forward(self, x):
        # keepdim: onert 0.1.0 fails at prepare on a MEAN over H, W without keepDims, fp32 too
        return self.head(self.body(self.stem(x)).mean((2, 3), keepdim=True).flatten(1))


def convnet(n_inputs: int = 64, runs: int = 30) -> None:
    import onert

    import circleops

    torch.manual_seed(0)
    model = ResNetIN().eval()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 3, 32, 32, generator=gen) for _ in range(n_inputs)]
    tmp = tempfile.mkdtemp()
    fp_path, q_path = os.path.join(tmp, "fp32.circle"), os.path.join(tmp, "uint8.circle")
    circleops.convert(model, (xs[0],), fp_path, target="onert", verify=True)
    circleops.convert(model, (xs[0],), q_path, target="onert", quantize="uint8", calibrate=16, verify=True)
    os.environ["NUM_THREADS"] = "1"
    sessions = {name: onert.infer.session(p, "cpu") for name, p in (("fp32", fp_path), ("uint8", q_path))}
    agree = 0
    with torch.no_grad():
        for x in xs:
            want = int(model(x).argmax())
            got = int(np.argmax(sessions["uint8"].infer([x.numpy()])[0]))
            agree += want == got
    times: dict[str, list[float]] = {"fp32": [], "uint8": []}
    x = xs[0].numpy()
    for _ in range(runs):
        for name, s in sessions.items():
            t = time.perf_counter()
            s.infer([x])
            times[name].append(time.perf_counter() - t)
    fp_ms, q_ms = (statistics.median(times[k]) * 1e3 for k in ("fp32", "uint8"))
    print(f"ResNet-style net with instance norm, 32x32 input, random weights (seed 0), {n_inputs} seeded inputs")
    print(f"load average {os.getloadavg()[0]:.2f}, onert NUM_THREADS=1, {runs} interleaved runs")
    print("| file | top-1 agreement with fp32 torch | onert latency (median) | file size |")
    print("|---|---|---|---|")
    print(f"| fp32 | - | {fp_ms:.2f} ms | {os.path.getsize(fp_path) / 1024:.0f} KB |")
    print(f"| uint8 (weights uint8 per tensor) | {agree}/{n_inputs} | {q_ms:.2f} ms | "
          f"{os.path.getsize(q_path) / 1024:.0f} KB |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("smollm2", "convnet"))
    p.add_argument("--calibrate", type=int, default=8)
    args = p.parse_args()
    smollm2(args.calibrate) if args.what == "smollm2" else convnet()
    return 0


if __name__ == "__main__":
    sys.exit(main())
