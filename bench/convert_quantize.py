"""Benchmark (not a test): ``circleops convert smollm2`` with and without ``--quantize``, end to
end as a user runs it (a fresh process each: imports, load, calibrate, export, lower,
quantize, write), interleaved so that load from other processes falls on every format alike.

    python bench/convert_quantize.py                           # fp32, q8_0, q4_0; both forms; 2 rounds
    python bench/convert_quantize.py --forms graphs --rounds 3 --formats fp32,q4_0
    python bench/convert_quantize.py --importance cold         # q4_0 calibrates every time
    python bench/convert_quantize.py --tree before=/tmp/old-checkout --tree after=.   # A/B, interleaved
    python bench/convert_quantize.py --kernels                 # the packers alone, one thread

Forms: ``plain`` is ``convert smollm2 -o F.circle`` (target circle, one 64-token graph);
``graphs`` is ``convert smollm2 --graphs prefill,decode --target onert -o DIR`` (what
``generate`` runs). ``--importance warm`` (default) lets q4_0 read the calibration
importances circleops keeps in its cache (a first run computes them: one is made before the
timed rounds); ``cold`` gives every run an empty importance cache (a CIRCLEOPS_CACHE of its
own that links the cached smollm2 directory), so q4_0 pays the calibration forward.
Reports the median wall time per form and format, its ratio to fp32 of the same form, each
round, and circleops' own stage times (the ``time:`` line) of the last round.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMS = {"plain": [], "graphs": ["--graphs", "prefill,decode", "--target", "onert"]}


def run(cmd: list[str], env: dict, cwd: str) -> dict:
    t0 = time.perf_counter()
    # cwd: ``python -m`` puts it first on sys.path, before PYTHONPATH
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out = proc.stdout.read().decode() + proc.stderr.read().decode()
    proc.stdout.close()
    proc.stderr.close()
    stages = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("time:")), "")
    return {"seconds": wall, "ok": os.waitstatus_to_exitcode(status) == 0, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "stages": stages, "tail": out.strip().splitlines()[-3:]}


def kernels(rounds: int) -> None:
    """One thread, every SmolLM2 linear weight (and the embedding): circleops' packers against
    gguf's numpy quantizer (same bytes, checked), the weighted Q4_0 search, and the
    calibration importances computed against read from the cache; best of ``rounds``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from circleops.sources.models import load_smollm2
    from circleops.quantize import ggml, importance
    from circleops.quantize.weights import source_key

    torch.set_num_threads(1)
    model, tokenizer = load_smollm2()
    linears = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)][:-1]  # tied head
    table = model.get_input_embeddings().weight.detach()
    cache = Path(tempfile.mkdtemp(prefix="importance-cache-"))
    os.environ["CIRCLEOPS_CACHE"] = str(cache)  # the model is loaded: only the importances go here
    cases = {
        "importance: calibration forward": lambda: importance.input_importance(model, (), tokenizer),
        "importance: read from the cache": lambda: importance.input_importance(model, (), tokenizer),
    }
    imp = importance.input_importance(model, (), tokenizer)
    types = {"GGML_Q8_0": GGMLQuantizationType.Q8_0, "GGML_Q4_0": GGMLQuantizationType.Q4_0}
    for dtype, qtype in types.items():
        ours = [ggml.quantize(w, dtype) for w in linears]
        assert all(np.array_equal(a, quants.quantize(w.numpy(), qtype).reshape(-1)) for a, w in zip(ours, linears))
        cases[f"{dtype[5:]} reference, gguf numpy"] = lambda qtype=qtype: [quants.quantize(w.numpy(), qtype) for w in linears]
        cases[f"{dtype[5:]} reference, circleops"] = lambda dtype=dtype: [ggml.quantize(w, dtype) for w in linears]
    cases["Q4_0 embedding table, circleops"] = lambda: ggml.quantize(table, "GGML_Q4_0")
    cases["Q4_0 importance-weighted, circleops"] = lambda: [ggml.quantize(w, "GGML_Q4_0", imp[source_key(w)])
                                                            for w in linears]
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in cases.items():
            if name.endswith("forward"):
                shutil.rmtree(cache / "importance", ignore_errors=True)
            t = time.perf_counter()
            fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    shutil.rmtree(cache, ignore_errors=True)
    n = sum(w.numel() for w in linears)
    print(f"{len(linears)} linear weights, {n / 1e6:.1f}M values; load average {os.getloadavg()[0]:.1f}; 1 thread")
    for name, sec in best.items():
        print(f"| {name} | {sec:.3f} s |")


def cold_env(base: dict, work: Path) -> dict:
    """A CIRCLEOPS_CACHE with no importances that reuses the cached smollm2 directory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from circleops.sources.models import cache_dir

    root = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    (root / "smollm2").symlink_to(cache_dir() / "smollm2")
    return {**base, "CIRCLEOPS_CACHE": str(root)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--formats", default="fp32,q8_0,q4_0")
    ap.add_argument("--forms", default="plain,graphs", help=f"comma-separated of {', '.join(FORMS)}")
    ap.add_argument("--importance", choices=["warm", "cold"], default="warm")
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                    help="run the circleops in DIR (repeat: each tree interleaved with the others); default: this one")
    ap.add_argument("--kernels", action="store_true", help="time the packers and the calibration alone, then exit")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.kernels:
        kernels(max(args.rounds, 3))
        return 0
    formats, forms = args.formats.split(","), args.forms.split(",")
    work = Path(args.work or tempfile.mkdtemp(prefix="circleops-qbench-"))
    work.mkdir(parents=True, exist_ok=True)
    trees = {name: str(Path(d).resolve()) for name, d in (t.split("=", 1) for t in args.tree)} or \
        {"circleops": str(Path(__file__).resolve().parents[1])}
    envs = {name: {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [d, os.environ.get("PYTHONPATH")]))}
            for name, d in trees.items()}

    def command(form: str, fmt: str) -> tuple[list[str], Path]:
        out = work / (f"{form}-{fmt}" + (".circle" if form == "plain" else ""))
        quant = [] if fmt == "fp32" else ["--quantize", fmt]
        return [sys.executable, "-m", "circleops.cli", "convert", "smollm2", *quant, *FORMS[form], "-o", str(out)], out

    if args.importance == "warm" and "q4_0" in formats:  # the importances a first q4_0 convert caches
        for tree, env in envs.items():
            run(command("plain", "q4_0")[0], env, trees[tree])
    results: dict = {}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for form in forms:
            for fmt in formats:
                for tree, env in envs.items():
                    cmd, out = command(form, fmt)
                    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                    one = run(cmd, cold_env(env, work) if args.importance == "cold" else env, trees[tree])
                    key = f"{form} {tree}" if len(envs) > 1 else form
                    results.setdefault(key, {}).setdefault(fmt, []).append(one)
                    print(f"round {r + 1} {key:12} {fmt:5} {one['seconds']:6.1f} s"
                          f"{'' if one['ok'] else ' FAILED ' + str(one['tail'])}", flush=True)
        load.append(os.getloadavg()[0])
    import torch

    print(f"\ntrees: {trees}")
    print(f"load average {' -> '.join(f'{x:.1f}' for x in load)} (before, after each round); "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; importance cache {args.importance}")
    print("| form | format | median s | vs fp32 | rounds | stages (last round) |\n|---|---|---|---|---|---|")
    summary = []
    for form, by_fmt in results.items():
        base = statistics.median(x["seconds"] for x in by_fmt["fp32"]) if "fp32" in by_fmt else None
        for fmt, runs in by_fmt.items():
            med = statistics.median(x["seconds"] for x in runs)
            ratio = f"{med / base:.2f}x" if base else ""
            stages = re.sub(r"\s+", " ", runs[-1]["stages"])
            each = ", ".join(f"{x['seconds']:.1f}" for x in runs)
            print(f"| {form} | {fmt} | {med:.1f} | {ratio} | {each} | {stages} |")
            summary.append({"form": form, "format": fmt, "median_seconds": med, "runs": runs})
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "results": summary}, indent=2) + "\n")
    if args.work is None:  # the written files (hundreds of MB) and the cold caches
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(x["ok"] for s in summary for x in s["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
