"""Measurement (not a test): can one Circle file with a dynamic sequence dimension serve
both prefill (S = N) and decode (S = 1) on onert? If it could, target onert would write one
539 MB SmolLM2 file instead of two.

    python bench/onert_dynamic_seq.py

A small graph as circleops writes it for target onert (x [1, 5, 8] -> RMS_NORM -> RESHAPE
-> CONV_2D 1x1 -> RESHAPE -> LOGISTIC -> MUL, the shape of every linear layer of the
prefill graph), with RESHAPE targets rewritten to -1 and shape_signature -1 on the
sequence dimension, then run in onert (Python API: `infer` fixes -1 dims to the first
input's shape before prepare, and calls set_input_tensorinfo when a later input's shape
differs). Three layouts, each in its own process (onert crashes in some):

  all    shape_signature -1 on the input and every activation tensor, one session, S = 5, 1, 7
  input  shape_signature -1 on the input only, one session, S = 5, 1, 7, 64
  fresh  shape_signature -1 on the input only, a new session per S (5, 1, 7)

Measured with onert 0.1.0 (x86_64, cpu backend), errors against torch:
  all    every run fails, S = 5 included: "num_elements() cannot calculate when any
         dimension is unspecified"
  input  S = 5 right (1.2e-07); S = 1 and 7 return the S = 5 output shape (1, 5, 16):
         wrong results without an error; S = 64 crashes the process (SIGSEGV; in another
         run "double free or corruption")
  fresh  S = 5 right; a new session first run with S = 1 or 7 fails at prepare
         ("ShapeValidator failed at line 1141"); once, the session after that crashed
So onert 0.1.0 cannot run one file at two sequence lengths, and target onert keeps one file
per graph (TargetProfile.one_file_per_graph, circleops/targets.py). The graphs also differ beyond shapes:
decode uses onert's fused ROPE (which reads one row of its tables, right only for S == 1)
and FULLY_CONNECTED for one-row linears where prefill uses decomposed RoPE and CONV_2D.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

S0 = 5


def _write(directory: Path, only_input: bool) -> tuple[Path, object]:
    import flatbuffers
    import numpy as np
    import torch
    from circle_schema import circle

    import circleops
    import circleops.ops  # noqa: F401

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 16, bias=False)
            self.w = torch.nn.Parameter(torch.rand(8) + 0.5)

        def forward(self, x):
            return torch.nn.functional.silu(self.lin(torch.ops.circle.rms_norm(x, self.w)))

    model = Block().eval()
    static = directory / "static.circle"
    circleops.save(torch.export.export(model, (torch.randn(1, S0, 8),)), str(static), target="onert")
    m = circle.Model.ModelT.InitFromObj(circle.Model.Model.GetRootAs(static.read_bytes(), 0))
    sg = m.subgraphs[0]
    names = {v: k for k, v in vars(circle.BuiltinOperator.BuiltinOperator).items() if not k.startswith("_")}
    for op in sg.operators:
        if names.get(m.operatorCodes[op.opcodeIndex].deprecatedBuiltinCode) == "RESHAPE":
            t = sg.tensors[op.inputs[1]]
            shape = np.frombuffer(bytes(m.buffers[t.buffer].data), dtype=np.int32).copy()
            shape[shape == S0] = -1
            m.buffers[t.buffer].data = np.frombuffer(shape.tobytes(), dtype=np.uint8)
    for i, t in enumerate(sg.tensors):
        activation = m.buffers[t.buffer].data is None
        if activation and S0 in list(t.shape) and (not only_input or i == sg.inputs[0]):
            t.shapeSignature = [-1 if d == S0 else int(d) for d in t.shape]
    b = flatbuffers.Builder(0)
    b.Finish(m.Pack(b), file_identifier=b"CIR0")
    path = directory / "dynamic.circle"
    path.write_bytes(b.Output())
    return path, model


def _run(mode: str) -> None:
    import numpy as np
    import onert
    import torch

    with tempfile.TemporaryDirectory() as d:
        path, model = _write(Path(d), only_input=mode != "all")
        lengths = [5, 1, 7, 64] if mode == "input" else [5, 1, 7]
        session = onert.infer.session(str(path), "cpu")
        for s in lengths:
            if mode == "fresh":
                session = onert.infer.session(str(path), "cpu")
            x = np.random.default_rng(s).standard_normal((1, s, 8)).astype(np.float32)
            want = model(torch.from_numpy(x)).detach().numpy()
            try:
                out = session.infer([x])[0]
            except Exception as err:  # noqa: BLE001  (what onert says is the measurement)
                print(f"{mode:6s} S={s:3d}: fails: {err}", flush=True)
                continue
            if out.shape != want.shape:
                print(f"{mode:6s} S={s:3d}: output shape {out.shape}, expected {want.shape}: wrong", flush=True)
            else:
                print(f"{mode:6s} S={s:3d}: max abs error {np.abs(out - want).max():.2g}", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        _run(sys.argv[1])
        return
    for mode in ("all", "input", "fresh"):
        proc = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(mode)]
        print("\n".join(lines))
        if proc.returncode != 0:
            tail = [ln for ln in proc.stderr.splitlines() if "double free" in ln or "Error" in ln][-1:]
            print(f"{mode:6s} process ended with status {proc.returncode} {' '.join(tail)}")


if __name__ == "__main__":
    main()
