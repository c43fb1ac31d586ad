"""Benchmark (not a test): SmolLM2-135M's int4 file with a two-stage head (issue 34).

    python bench/int4_head.py quality --out /tmp/q.json --ks 16 32 64 128   # torch emulation, both texts
    python bench/int4_head.py ops --out /tmp/o.json                         # the head's ops in LiteRT
    python bench/int4_head.py write --quality /tmp/q.json --ops /tmp/o.json [--extra more.json ...]
                                                      # -> bench/results/76-int4-head.yaml, docs/benchmarks.md

The two-stage head (circleops.quantize.topk_head): every logit from a 4-bit copy of the tied
head (blocks of 32, importance-weighted as the int4 linears), the k largest of those rescored
with the INT8 rows the file holds for its embedding lookup, written over the 4-bit values.

``quality``: torch emulating the file's arithmetic, as bench/int4_quality.py and
bench/int4_down.py do (every decoder linear int4 blocks of 32, importance-weighted; the 30 MLP
downs int8 or, where the row says, int4; the int8 table; every quantized linear's input rounded
to int8 per row as XNNPACK does; the two-stage head's exact rescoring in float on the int8
rows). Perplexity on the SELECTION text (choices) and on the shipped scored text (reported),
every window of 256.

``ops``: one-head files in LiteRT (SmolLM2's tied table, x one row [1, 576]): the INT8 head as
shipped (one dynamic-range FULLY_CONNECTED) against the two-stage head at each k, time per
invoke (medians of interleaved repetitions, 1 and 2 threads, CPU time too), and the two-stage
file's output against torch's emulation (circleops.quantize.topk_head.two_stage).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS_FILE = ROOT / "bench" / "results" / "76-int4-head.yaml"


def _asymmetric(x: torch.Tensor) -> torch.Tensor:
    from circleops.quantize import int8

    xq, sx, _ = int8.quantize_rows_asymmetric(x.reshape(-1, x.shape[-1]))
    return (xq.to(torch.float32) * sx).reshape(x.shape)


def quality(args: argparse.Namespace) -> int:
    from int4_quality import perplexity, scorer, text_windows

    from circleops.quantize import int4, int8, topk_head
    from circleops.quantize.importance import input_importance
    from circleops.sources.models import load_smollm2

    torch.set_num_threads(1)
    model, tok = load_smollm2()
    model.eval()
    wins = text_windows(tok, args.window)
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load0": os.getloadavg()[0],
                 "windows": {k: len(v) for k, v in wins.items()}, "rows": [], "fp32": {}}
    cpu0 = time.process_time()
    for t, w in wins.items():
        out["fp32"][t] = perplexity(model, w)
    print("fp32", out["fp32"], flush=True)

    score = scorer(model, wins, out, args.out)

    importance = input_importance(model, (), tok)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    imp = {n: importance.get(("torch", m.weight.untyped_storage().data_ptr(), m.weight.numel(), str(m.weight.dtype)))
           for n, m in linears.items()}
    table = model.model.embed_tokens.weight  # tied: the head's int8 rows too
    head_imp = importance.get(("torch", table.untyped_storage().data_ptr(), table.numel(), str(table.dtype)))
    assert head_imp is not None, "no importance for the tied head"
    head4 = int4.dequantize(int4.quantize(table.detach().clone(), 32, head_imp))
    downs = [n for n in linears if n.endswith("mlp.down_proj")]
    four = {n: int4.dequantize(int4.quantize(w, 32, imp[n])) for n, w in original.items()}
    eight = {n: int8.dequantize(int8.quantize_per_channel(original[n])) for n in downs}

    head_hook = None

    def rounded_input(mod, inputs):
        return (_asymmetric(inputs[0]),)

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            h = m.register_forward_pre_hook(rounded_input)
            if m is model.lm_head:
                head_hook = h
    with torch.no_grad():
        table.copy_(int8.dequantize(int8.quantize_per_channel(table.detach().clone())))

    def set_downs(at4: bool) -> None:
        with torch.no_grad():
            for n, m in linears.items():
                m.weight.copy_(four[n] if (at4 or n not in downs) else eight[n])

    for downs4 in args.downs:
        set_downs(downs4 == "int4")
        tag = f"downs {downs4}"
        score(f"{tag}, head int8 (as shipped)" if downs4 == "int8" else f"{tag}, head int8", k=-1, downs=downs4)
        # the head at 4 bits alone (every logit approximate): what the rescoring wins back from
        head_hook.remove()
        saved = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(head4, requires_grad=False)
        head_hook = model.lm_head.register_forward_pre_hook(rounded_input)
        score(f"{tag}, head int4 (every logit 4-bit)", k=0, downs=downs4)
        head_hook.remove()
        model.lm_head.weight = saved
        for k in args.ks:
            t0 = time.process_time()
            with topk_head.install(model.lm_head, head4, k, _asymmetric):
                row = score(f"{tag}, two-stage head k={k}", k=k, downs=downs4)
            row["cpu_s"] = round(time.process_time() - t0, 1)
        head_hook = model.lm_head.register_forward_pre_hook(rounded_input)
    out["cpu_s"] = round(time.process_time() - cpu0, 1)
    out["load1"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


# --------------------------------------------------------------------------- ops in LiteRT

def _head_file(path: str, p8, p4, k: int) -> None:
    """x [1, H] -> logits [1, V]: the INT8 head (k = 0), the INT4 copy alone (k < 0) or the
    two-stage head with ``k``."""
    from circleops.quantize import int4_tflite
    from circleops.serialize import write_model

    if k < 0:  # the INT4 copy alone (every logit 4-bit): the floor the rescoring's ops add to
        from circleops import ir

        v, h = p4.q.shape
        sg = ir.Subgraph("main")
        x = sg.add_tensor(ir.Tensor("x", (1, h), "FLOAT32"))
        y = sg.add_tensor(ir.Tensor("logits", (1, v), "FLOAT32"))
        w4 = sg.add_tensor(int4_tflite.weight_tensor("table_int4", (v, h), p4))
        sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w4, -1], [y], "FullyConnectedOptions",
                                        {"fusedActivationFunction": 0, "keepNumDims": False}, 13))
        sg.inputs, sg.outputs = [x], [y]
        write_model(ir.Model([sg]), path, "tflite")
        return
    write_model(int4_tflite.head_model(p8, p4 if k else None, k), path, "tflite")


def ops(args: argparse.Namespace) -> int:
    from ai_edge_litert.interpreter import Interpreter

    from circleops.quantize import int4, int8, topk_head
    from circleops.sources.models import load_smollm2

    model, _ = load_smollm2()
    table = model.model.embed_tokens.weight.detach().clone()
    del model
    p8 = int8.quantize_per_channel(table)
    p4 = int4.quantize(table, 32)  # the cost does not depend on the rounding; unweighted here
    rng = np.random.default_rng(0)
    # random rows: the cost does not depend on the values; the check compares like with like
    xs = [rng.standard_normal((1, table.shape[1])).astype(np.float32) * 3 for _ in range(4)]
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load0": os.getloadavg()[0],
                 "cpu": _cpu(), "rows": []}
    work = tempfile.mkdtemp(prefix="int4head-ops-")
    variants = [0, -1, *args.ks]
    paths = {}
    for k in variants:
        paths[k] = os.path.join(work, f"head_k{k}.tflite")
        _head_file(paths[k], p8, p4, k)
    # correctness: LiteRT's two-stage logits against torch's emulation on the same weights
    w8 = int8.dequantize(p8)
    w4 = int4.dequantize(p4)
    for k in args.ks:
        it = Interpreter(model_path=paths[k], num_threads=1)
        it.allocate_tensors()
        errs, exact_errs = [], []
        for x in xs:
            it.set_tensor(it.get_input_details()[0]["index"], x)
            it.invoke()
            got = it.get_tensor(it.get_output_details()[0]["index"])[0]
            logits, approx, exact = topk_head.two_stage(torch.from_numpy(x), w4, w8, k, _asymmetric)
            errs.append(topk_head.head_error(got, approx[0].numpy(), exact[0].numpy(), k))
            top = approx[0].topk(k).indices.numpy()
            exact_errs.append(float(np.abs(got[top] - exact[0].numpy()[top]).max()))
        delegated = sorted({o["op_name"] for o in it._get_ops_details()})
        out[f"check_k{k}"] = {"max_err": max(errs), "exact_err": max(exact_errs), "ops": delegated}
        print(k, out[f"check_k{k}"], flush=True)
    for threads in args.threads:
        its = {}
        for k in variants:
            it = Interpreter(model_path=paths[k], num_threads=threads)
            it.allocate_tensors()
            it.set_tensor(it.get_input_details()[0]["index"], xs[0])
            for _ in range(20):
                it.invoke()
            its[k] = it
        walls = {k: [] for k in variants}
        cpus = {k: [] for k in variants}
        for _ in range(args.reps):
            for k in variants:
                t, c = time.perf_counter(), time.process_time()
                for _ in range(args.inner):
                    its[k].invoke()
                walls[k].append((time.perf_counter() - t) / args.inner * 1e6)
                cpus[k].append((time.process_time() - c) / args.inner * 1e6)
        for k in variants:
            row = {"k": k, "threads": threads, "wall_us": statistics.median(walls[k]),
                   "cpu_us": statistics.median(cpus[k]),
                   "ratio_wall": statistics.median(w / b for w, b in zip(walls[k], walls[0])),
                   "ratio_cpu": statistics.median(w / b for w, b in zip(cpus[k], cpus[0]))}
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
        del its
    out["bytes"] = {"int8_head": int(p8.q.nbytes + p8.scale.nbytes), "int4_head": int(p4.nbytes)}
    out["load1"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--out", required=True)
    q.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64, 128])
    q.add_argument("--downs", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    q.add_argument("--window", type=int, default=256)
    o = sub.add_parser("ops")
    o.add_argument("--out", required=True)
    o.add_argument("--ks", type=int, nargs="+", default=[16, 32, 64, 128])
    o.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    o.add_argument("--reps", type=int, default=15)
    o.add_argument("--inner", type=int, default=20)
    w = sub.add_parser("write")
    w.add_argument("--quality")
    w.add_argument("--ops")
    w.add_argument("--extra", nargs="*", default=[], help="results files (YAML) whose blocks follow")
    w.add_argument("--note", action="append", default=[], help="a paragraph (repeatable)")
    args = ap.parse_args(argv)
    return {"quality": quality, "ops": ops, "write": write}[args.cmd](args)


def write(args: argparse.Namespace) -> int:
    """The runs' JSONs (and other benchmarks' results files of the same work, their blocks
    appended) as bench/results/76-int4-head.yaml, then docs/benchmarks.md."""
    import yaml

    import report

    blocks: list[dict] = []
    if args.quality:
        q = json.loads(Path(args.quality).read_text())
        fp32 = q["fp32"]
        blocks.append({"text": (
            f"`python bench/int4_head.py quality` ({q['started']}; load average {q['load0']:.1f}-{q.get('load1', 0):.1f}: "
            "perplexity does not depend on it). SmolLM2-135M, torch emulating the int4 file's arithmetic (as "
            "bench/int4_quality.py and bench/int4_down.py: every decoder linear int4 blocks of 32, importance-weighted; "
            "the 30 MLP downs int8 or int4 as the row says; the INT8 table; every quantized linear's input rounded to "
            "int8 per row as XNNPACK does). The head: the INT8 table as one product (as int4 shipped before), its 4-bit "
            "copy alone (blocks of 32, importance-weighted by the final norm's output), or two-stage (the 4-bit copy "
            "for every logit, the k largest rescored in float with the INT8 rows: circleops.quantize.topk_head). "
            f"Perplexity on the SELECTION text ({q['windows']['selection']} windows of 256; the choice of k is made "
            f"there) and on the shipped scored text ({q['windows']['shipped']} windows, reported). torch fp32: "
            f"selection {fp32['selection']:.3f}, shipped {fp32['shipped']:.3f}.\n")})
        rows = [[r["variant"], f"{r['selection']:.3f}", f"{r['selection_pct']:+.2f} %", f"{r['shipped']:.3f}",
                 f"{r['shipped_pct']:+.2f} %"] for r in q["rows"]]
        blocks.append({"table": {"columns": ["variant", "selection", "vs fp32", "shipped text", "vs fp32"],
                                 "align": ["left", "right", "right", "right", "right"], "rows": rows}})
    if args.ops:
        o = json.loads(Path(args.ops).read_text())
        checks = "; ".join(f"k={k[7:]}: max error {v['max_err']:.1e}, rescored values {v['exact_err']:.1e} off torch's "
                           f"int8 rows" for k, v in o.items() if k.startswith("check_k"))
        blocks.append({"text": (
            f"`python bench/int4_head.py ops` ({o['started']}; {o['cpu']}; load average {o['load0']:.1f}-"
            f"{o['load1']:.1f}). One-head files in LiteRT 2.3.0 (x [1, 576] -> logits [1, 49152], SmolLM2's tied "
            f"table): the INT8 head as one dynamic-range FULLY_CONNECTED ({o['bytes']['int8_head'] / 1e6:.1f} MB) "
            f"against the two-stage head (the INT4 copy, {o['bytes']['int4_head'] / 1e6:.1f} MB, then the two-level "
            "top-k: REDUCE_MAX over groups of 64 and two TOPK_V2; EMBEDDING_LOOKUP of k INT8 rows, a FULLY_CONNECTED "
            "with them as its filter, SUB, SCATTER_ND, ADD), microseconds per invoke, medians "
            "of interleaved repetitions, and each one's median ratio to the INT8 head in the same repetition. Its "
            f"output against torch's emulation: {checks}.\n")})
        blocks.append({"table": {"columns": ["head", "threads", "wall us", "CPU us", "wall vs INT8 head",
                                             "CPU vs INT8 head"],
                                 "align": ["left", "right", "right", "right", "right", "right"],
                                 "rows": [[{0: "INT8 (one product)", -1: "INT4 copy alone (no rescoring)"}.get(
                                     r["k"], f"two-stage k={r['k']}"),
                                           str(r["threads"]), f"{r['wall_us']:.0f}", f"{r['cpu_us']:.0f}",
                                           f"{r['ratio_wall']:.2f}x", f"{r['ratio_cpu']:.2f}x"] for r in o["rows"]]}})
    for note in args.note:
        blocks.append({"text": note.rstrip() + "\n"})
    for extra in args.extra:
        data = yaml.safe_load(Path(extra).read_text())
        blocks.append({"heading": f"### {data['heading']}"})
        blocks.extend(data["blocks"])
    data = {"heading": "bench/int4_head.py — the int4 file's two-stage head (issue 34)", "blocks": blocks}
    RESULTS_FILE.write_text(yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True))
    report.main([])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
