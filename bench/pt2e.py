"""Integer (PT2E) models: accuracy against fp32, and onert latency.

    python bench/pt2e.py smollm2 [--calibrate 8] [--recipes int16,uint8,llm,...] [--tico]
    python bench/pt2e.py convnet                   # ResNet-style net with instance norm, uint8

smollm2: the fp32 model greedily continues "Once upon a time," by 32 tokens; each integer
file (circleops.convert(..., quantize=..., int16=...), run by the reference interpreter's
integer kernels) reads that same sequence once (teacher forcing). Reported: logits SQNR in dB
(10·log10(Σ fp32² / Σ (fp32 - int)²) over the 32 predicted positions), greedy agreement
(argmax equal at each of the 32 positions), file size and convert time (circleops.convert:
export, calibration, lowering, write; the model already loaded). A recipe is int16, uint8,
or uint8 with int16 parts: "uint8+norms+residual" or a preset name ("llm" = uint8 + its parts);
options "+w4" (4-bit weights), "+gN" (groups of N columns, g0 per channel), "+gptq", "+norot".
--target tflite: the same recipes as full-integer .tflite files run in LiteRT (XNNPACK
interpreter, 2 threads), beside the fp32 .tflite, with LiteRT's median time for one forward
of the whole sequence (no KV cache: ms per token = that / sequence length).
--tico: tico 0.3.0's PTQ (tico.quantization, default PTQConfig()) on the same model and
calibration windows (bench/_tico_ptq.py in the tico venv), its file run the same way.

convnet: a small ResNet-style classifier (conv + instance norm + ReLU, residual blocks,
global average pool, linear), random weights (seed 0), 64 seeded inputs: top-1 agreement
of the uint8 file (run in onert) with fp32 torch, and onert latency of the fp32 and uint8
files (interleaved medians, 1 thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

PROMPT = "Once upon a time,"
NEW_TOKENS = 32
TICO_PYTHON = "/tmp/tico-venv/bin/python"
HERE = os.path.dirname(os.path.abspath(__file__))


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((ref.astype(np.float64) - got) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


def recipe(name: str) -> tuple[str, list[str], str, dict]:
    """(scheme, int16 parts, label, convert options) of a recipe name: "SCHEME[+PART...]" with
    parts from INT16_PARTS, "auto" (measured mixed precision) or a preset name, and the
    options "w4" (4-bit weights), "gptq", "norot" (no Hadamard rotation)."""
    from circleops.quantize import INT16_PRESETS

    if name in INT16_PRESETS:
        name = "uint8+" + "+".join(INT16_PRESETS[name])
    scheme, *tokens = name.split("+")
    groups = [int(t[1:]) for t in tokens if t[:1] == "g" and t[1:].isdigit()]
    options = {"weight_bits": 4 if "w4" in tokens else 8, "gptq": "gptq" in tokens,
               "rotate": "off" if "norot" in tokens else "auto"}
    if groups:  # "g32": --weight-group-size 32; "g0": per channel (no token: the default)
        options["weight_group_size"] = groups[0]
    if "w8auto" in tokens:  # --int8-weights auto
        options["int8_weights"] = "auto"
    parts = [t for t in tokens if t not in ("w4", "gptq", "norot", "w8auto") and not (t[:1] == "g" and t[1:].isdigit())]
    label = f"{scheme} activations" if not parts else f"uint8 + int16 {'+'.join(parts)} (`--int16 {','.join(parts)}`)"
    from circleops.quantize.recipe import group_size_for

    group = group_size_for(options["weight_bits"], options.get("weight_group_size"), llm=True)  # SmolLM2's
    label += f", int{options['weight_bits']} weights" + (f" in groups of {group}" if group else "") + \
        (", the most sensitive linears int8 (`--int8-weights auto`)" if "int8_weights" in options else "") + \
        (", GPTQ" if options["gptq"] else "") + (", no rotation" if options["rotate"] == "off" else ", rotated")
    return scheme, parts, label, options


def smollm2(calibrate: int, recipes: list[str], tico: bool, out_dir: str | None,
            tico_result: str | None = None, target: str = "circle") -> None:
    import circleops
    from circleops.sources import models
    from circleops.runtime import reference

    model, tok = models.load_smollm2()
    model.eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        seq = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        fp = model(seq).logits[0, ids.shape[1] - 1:-1].numpy()  # the 32 predicting positions
    start = ids.shape[1] - 1
    print(f"SmolLM2-135M, prompt {PROMPT!r} + {NEW_TOKENS} greedy tokens (seq {seq.shape[1]}), "
          f"calibration {calibrate} windows of circleops/quantize/calibration.txt; "
          f"torch threads {torch.get_num_threads()}")
    print(f"fp32 continuation: {tok.decode(seq[0, ids.shape[1]:])!r}")
    fp32_bytes = 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied once
    tmp = out_dir or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    rows = []

    def row(label: str, logits: np.ndarray | None, path: str | None, seconds: float | str, note: str = "") -> None:
        if logits is not None:
            agree = int((logits.argmax(-1) == fp.argmax(-1)).sum())
            cells = [f"{sqnr_db(fp, logits):.1f}", f"{agree}/{NEW_TOKENS}"]
        else:
            cells = ["-", "-"]
        size = f"{os.path.getsize(path) / 2**20:.0f} MB ({os.path.getsize(path) / fp32_bytes:.2f}x fp32)" \
            if path and os.path.exists(path) else "-"
        secs = f"{seconds:.0f} s" if isinstance(seconds, float) else seconds
        line = f"| {label} | {' | '.join(cells)} | {size} | {secs} | {os.getloadavg()[0]:.1f} |" + \
            (f" {note} |" if note else " |")
        rows.append(line)
        print(line, flush=True)

    print("| file | logits SQNR (dB) | greedy agreement (32 tokens) | file size | convert time | load avg | note |")
    print("|---|---|---|---|---|---|---|")
    if target == "tflite":
        litert_rows(model, seq, fp, start, tmp, calibrate, tok, recipes, row)
        recipes = []
    for name in recipes:
        scheme, parts, label, options = recipe(name)
        path = os.path.join(tmp, f"smollm2_{name.replace('+', '_')}.circle")
        t = time.perf_counter()
        report = circleops.convert(model, (seq,), path, target="circle", quantize=scheme, int16=parts,
                                   calibrate=calibrate, tokenizer=tok, **options)
        seconds = time.perf_counter() - t
        for line in report.quantization.summary_lines():
            print("   ", line, flush=True)
        print("    stages:", ", ".join(f"{k} {v:.0f} s" for k, v in report.timings.items()), flush=True)
        logits = reference.run(path, [seq.numpy()])[0][0, start:-1]
        row(label, logits, path, seconds, "circleops, reference interpreter")
    if tico or tico_result:
        tico_ptq(seq, fp, calibrate, tmp, start, row, tico_result)
    with open(os.path.join(tmp, "rows.md"), "a") as f:
        f.write("\n".join(rows) + "\n")


def litert_ms(path: str, seq: np.ndarray, runs: int = 10, threads: int = 2) -> tuple[float, float]:
    """(median wall ms, median CPU ms) of one LiteRT forward of ``seq`` (XNNPACK, ``threads``)."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path, num_threads=threads)
    it.allocate_tensors()
    inp, out = it.get_input_details()[0], it.get_output_details()[0]
    it.set_tensor(inp["index"], seq.astype(inp["dtype"]))
    it.invoke()  # warm-up
    wall, cpu = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        it.invoke()
        wall.append(1e3 * (time.perf_counter() - t))
        cpu.append(1e3 * (time.process_time() - c))
    return statistics.median(wall), statistics.median(cpu)


def litert_rows(model, seq, fp, start, tmp, calibrate, tok, recipes, row) -> None:
    """--target tflite: the fp32 .tflite, then each integer recipe as a full-integer .tflite,
    run in LiteRT (logits SQNR, greedy agreement, size, LiteRT time of the whole sequence)."""
    import circleops
    from circleops.runtime import litert

    ids = seq.numpy()
    n = ids.shape[1]
    fp32_path = os.path.join(tmp, "smollm2_fp32.tflite")
    t = time.perf_counter()
    circleops.convert(model, (seq,), fp32_path, target="tflite")
    seconds = time.perf_counter() - t
    wall, cpu = litert_ms(fp32_path, ids)
    row("fp32 (`--target tflite`)", litert.run(fp32_path, [ids])[0][0, start:-1], fp32_path, seconds,
        f"LiteRT {wall:.0f} ms / {n} tokens = {wall / n:.1f} ms per token (CPU {cpu:.0f} ms)")
    for name in recipes:
        scheme, parts, label, options = recipe(name)
        path = os.path.join(tmp, f"smollm2_{name.replace('+', '_')}.tflite")
        t = time.perf_counter()
        report = circleops.convert(model, (seq,), path, target="tflite", quantize=scheme, int16=parts,
                                   calibrate=calibrate, tokenizer=tok, **options)
        seconds = time.perf_counter() - t
        for line in report.quantization.summary_lines():
            print("   ", line, flush=True)
        print("    stages:", ", ".join(f"{k} {v:.0f} s" for k, v in report.timings.items()), flush=True)
        wall, cpu = litert_ms(path, ids)
        row(label + " (`--target tflite`)", litert.run(path, [ids])[0][0, start:-1], path, seconds,
            f"LiteRT {wall:.0f} ms / {n} tokens = {wall / n:.1f} ms per token (CPU {cpu:.0f} ms)")


def tico_ptq(seq: torch.Tensor, fp: np.ndarray, calibrate: int, tmp: str, start: int, row,
             tico_result: str | None = None) -> None:
    """tico's PTQ in its venv (bench/_tico_ptq.py); its file run by the reference
    interpreter, else onert; what fails is a row too."""
    seq_path, out, result_path = (os.path.join(tmp, n) for n in ("seq.pt", "tico_ptq.circle", "tico_ptq.json"))
    if tico_result:  # a finished run of bench/_tico_ptq.py (same sequence and calibration)
        result_path, stderr = tico_result, ""
    else:
        torch.save(seq, seq_path)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        proc = subprocess.run([TICO_PYTHON, os.path.join(HERE, "_tico_ptq.py"), seq_path, out, str(calibrate),
                               result_path], env=env, capture_output=True, text=True)
        stderr = proc.stderr
    with open(result_path) as f:
        result = json.load(f)
    out = result.get("file", out)
    t = result["timings"]
    seconds = sum(v for k, v in t.items() if k not in ("import", "load", "torch logits"))
    label = "tico 0.3.0 PTQ, default PTQConfig(): uint8 activations, uint8 per-channel weights"
    torch_note = ""
    if "torch_logits" in result:  # tico's own fake-quantized torch model, before its export
        fq = torch.load(result["torch_logits"])[0, start:-1].numpy()
        torch_note = (f"; tico's fake-quantized torch model: {sqnr_db(fp, fq):.1f} dB, "
                      f"{int((fq.argmax(-1) == fp.argmax(-1)).sum())}/{NEW_TOKENS}")
    if "error" in result:
        e = result["error"]
        row(label, None, None, "-", f"fails at {e['stage']}: {e['type']}: {e['message']} ({e['where']})"
            + torch_note)
        print(stderr[-3000:], file=sys.stderr)
        return
    logits, runner, errors = None, "", []
    for runtime in ("reference", "onert"):
        try:
            from circleops.runtime import open_session

            logits = open_session(runtime, out).run([seq.numpy()])[0]
            runner = runtime
            if not np.issubdtype(logits.dtype, np.floating):  # tico's output stays uint8: dequantize it
                from circleops.serialize import read_model

                sg = read_model(out).subgraphs[0]
                q = sg.tensors[sg.outputs[0]].quant
                logits = (logits.astype(np.float64) - q.zero_point[0]) * q.scale[0]
                runner += f" (its {sg.tensors[sg.outputs[0]].dtype} logits dequantized)"
            break
        except Exception as err:  # noqa: BLE001 - which runtime runs tico's file is the finding
            errors.append(f"{runtime}: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
    note = f"tico, run by {runner}" if runner else "its file runs nowhere: " + "; ".join(errors)
    if errors and runner:
        note += " (" + "; ".join(errors) + ")"
    row(label, None if logits is None else np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1])[start:-1],
        out, seconds, note + torch_note)


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
    p.add_argument("--recipes", default="int16,uint8,llm", help="comma-separated: int16, uint8, a preset, "
                   "or uint8+PART+PART")
    p.add_argument("--tico", action="store_true", help="also tico 0.3.0's PTQ (its venv: " + TICO_PYTHON + ")")
    p.add_argument("--tico-result", default=None, help="the RESULT.json of a finished bench/_tico_ptq.py run: "
                   "evaluate its file instead of running tico again")
    p.add_argument("--out", default=None, help="directory for the files (default: a temporary one)")
    p.add_argument("--target", choices=("circle", "tflite"), default="circle",
                   help="tflite: full-integer .tflite files run in LiteRT, beside the fp32 .tflite")
    args = p.parse_args()
    if args.what == "smollm2":
        smollm2(args.calibrate, [r for r in args.recipes.split(",") if r], args.tico, args.out, args.tico_result,
                args.target)
    else:
        convnet()
    return 0


if __name__ == "__main__":
    sys.exit(main())
