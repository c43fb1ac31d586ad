"""Which quantized (PT2E) ops onert 0.1.0 runs: one tiny model per op, quantized with
CircleQuantizer, written for target onert, loaded and run in onert, compared with the
reference interpreter's integer kernels (error in output steps). Files are written for
target circle (every op integer), except the rows marked for target onert.

    python bench/onert_quantized.py [uint8|int16]   # prints a markdown table (docs/benchmarks.md)

onert prints its real error to stderr; the table keeps the first line of it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import numpy as np
import torch
from torch import nn


class One(nn.Module):
    def __init__(self, fn, *mods):
        super().__init__()
        self.fn = fn
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        return self.fn(x, *self.mods)


def probes():
    torch.manual_seed(0)
    img = torch.randn(1, 4, 8, 8)
    seq = torch.randn(1, 6, 16)
    return {
        "QUANTIZE+DEQUANTIZE (relu between)": (One(lambda x: torch.relu(x)), img),
        "CONV_2D (int8 per-channel weights)": (One(lambda x, c: c(x), nn.Conv2d(4, 8, 3)), img),
        "CONV_2D (uint8 per-tensor weights)": (One(lambda x, c: c(x), nn.Conv2d(4, 8, 3)), img, "uint8"),
        "DEPTHWISE_CONV_2D (int8 per-channel)": (One(lambda x, c: c(x), nn.Conv2d(4, 4, 3, groups=4)), img),
        "DEPTHWISE_CONV_2D (uint8 per-tensor)": (One(lambda x, c: c(x), nn.Conv2d(4, 4, 3, groups=4)), img, "uint8"),
        "FULLY_CONNECTED (int8 per-channel)": (One(lambda x, l: l(x), nn.Linear(16, 8)), seq[:, :1]),
        "FULLY_CONNECTED (uint8 per-tensor)": (One(lambda x, l: l(x), nn.Linear(16, 8)), seq[:, :1], "uint8"),
        "ADD": (One(lambda x: x + x * 0.5), seq),
        "MUL": (One(lambda x: x * torch.tanh(x)), seq),
        "MEAN (last axis, keepdims)": (One(lambda x: x.mean(-1, keepdim=True)), seq),
        "MEAN (H and W, no keepdims)": (One(lambda x: x.mean((2, 3))), img),
        "STRIDED_SLICE": (One(lambda x: x[:, :3] * 1.0), seq),
        "LOGISTIC (sigmoid)": (One(lambda x: torch.sigmoid(x)), seq),
        "SOFTMAX": (One(lambda x: torch.softmax(x, -1)), seq),
        "MAX_POOL_2D": (One(lambda x: torch.nn.functional.max_pool2d(x, 2)), img),
        "RESHAPE/TRANSPOSE": (One(lambda x: x.reshape(1, 6, 4, 4).transpose(1, 2) * 1.0), seq),
        "BATCH_MATMUL": (One(lambda x: x @ x.transpose(1, 2)), seq),
        "GATHER (embedding)": (One(lambda x, e: e(x), nn.Embedding(32, 16)), torch.randint(0, 32, (1, 6))),
        "RMS_NORM": (One(lambda x, w: torch.ops.circle.rms_norm(x, w.weight, 1e-6), nn.LayerNorm(16)), seq),
        "MIRROR_PAD (GATHERs on onert)": (One(lambda x, p: p(x) * 1.0, nn.ReflectionPad2d(1)), img, "int8", "onert"),
        "INSTANCE_NORM (decomposed on onert)": (One(lambda x, n: n(x), nn.InstanceNorm2d(4, affine=True)), img,
                                                "uint8", "onert"),
    }


@contextlib.contextmanager
def stderr_to(path):
    fd = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def main(scheme: str = "uint8") -> int:
    import onert

    import circleops
    from circleops.passes.fusion import fuse_patterns
    from circleops.quantize import pt2e
    from circleops.runtime import reference
    from circleops.serialize import read_model

    rows = []
    tmp = tempfile.mkdtemp()
    for name, (model, x, *rest) in probes().items():
        weight, target = (rest + ["int8", "circle"][len(rest):])[:2]
        model.eval()
        path = os.path.join(tmp, "p.circle")
        ep, _ = fuse_patterns(torch.export.export(model, (x,)))
        samples = pt2e.calibration_samples((x,), 2) if x.is_floating_point() else [(x,)]
        _, qep = pt2e.quantize(model, (x,), pt2e.make_quantizer(scheme, weight=weight),
                               samples, exported=ep)
        # target circle keeps every op integer (target onert keeps the ones it lacks float);
        # the last rows need onert's own lowering of ops it lacks even in float
        circleops.save(qep, path, target=target)
        sg = read_model(path).subgraphs[0]
        ops = " ".join(op.opcode for op in sg.operators)
        err_path = os.path.join(tmp, "stderr.txt")
        try:
            with stderr_to(err_path):
                out = onert.infer.session(path, "cpu").infer([x.numpy()])[0]
            ref = reference.run(path, [x.numpy()])[0]
            step = float(sg.tensors[sg.operators[-1].inputs[0]].quant.scale[0])
            result = f"runs; max diff vs reference {np.abs(out - ref).max() / step:.1f} steps"
        except Exception as err:  # noqa: BLE001 - onert's errors are all NNFW_STATUS_ERROR
            detail = open(err_path).read().strip().splitlines()
            result = f"fails: {detail[0] if detail else err}"
        rows.append((name, ops, result))
    print(f"| op ({scheme} activations) | ops in the file | onert 0.1.0 |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
