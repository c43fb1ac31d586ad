"""Benchmark (not a test): LiteRT decode with the KV caches read in place against the copying
path, interleaved inside one process (issue 34).

    python bench/int4_decode_inplace.py                       # print the table
    python bench/int4_decode_inplace.py --write               # -> bench/results/44-litert-caches-in-place.yaml
    python bench/int4_decode_inplace.py --outputs --write --results bench/results/49-litert-outputs-in-place.yaml

circleops' Generator on SmolLM2-135M's int4 and w8 files (`circleops convert smollm2 --graphs
prefill,decode --target tflite --quantize int4|w8`, made in --work when missing, as
bench/llm_speed.py makes them). One child process per (file, threads), round-robin over the
files and thread counts, --rounds rounds. A child prefills each --prompts prompt, then measures
blocks of --steps greedy decode steps alternately with ``caches_in_place`` True (each step writes
its new cache rows into LiteRT's own input buffers) and False (every step copies its cache
windows in, as circleops did before), ABBA order, --blocks blocks of each; every block starts
at the same position (the history rewound to the prompt's end: the caches' slots before it
are untouched) after one untimed step (a switch of path copies the window once). A block's
CPU seconds (time.process_time: every thread of the process) over its steps; the ratio per
adjacent pair, so the other jobs on a shared machine hit both paths alike. After a 5-token
prompt the steps run the 32-slot window, after 300 tokens the full 512-slot cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = ROOT / "bench" / "results" / "44-litert-caches-in-place.yaml"
FILES = {"int4": "circleops --target tflite --quantize int4 (blocks of 32)", "w8": "circleops --target tflite --quantize w8"}


def child(artifact: str, threads: int, prompts: dict[str, list[int]], steps: int, blocks: int,
          outputs: bool = False) -> dict:
    """One process's measurements: {prompt length: {"in place": [CPU ms/token per block], "copied": [...],
    "wall in place": [...], "wall copied": [...]}} and the path each mode ran. ``outputs``: both
    paths read their caches in place; "in place" reads the step's outputs in place too (the
    default), "copied" through TensorBuffer.read (a second Generator whose decode sessions
    refuse outputs_in_place: circleops before that change)."""
    from circleops.generation.generator import Generator

    gen = Generator(artifact, runtime="litert", threads=threads)
    gens = {True: gen, False: gen}
    if outputs:
        gens[False] = Generator(artifact, runtime="litert", threads=threads)
        for _, s in [*gens[False].decode_windows, (0, gens[False].decode_session)]:
            s.outputs_in_place = lambda: False
    out: dict = {"threads": gen.threads.get("decode"), "paths": {}}
    for n, ids in prompts.items():
        first = int(gen.prefill(ids).argmax())
        if outputs:
            gens[False].prefill(ids)
        start = len(gen.history)
        res: dict[str, list[float]] = {"in place": [], "copied": [], "wall in place": [], "wall copied": []}
        order = [True, False, False, True] * ((blocks + 1) // 2)
        for warm in (True, False):  # each path's first steps prepare its graphs and buffers
            g = gens[warm]
            g.caches_in_place = warm or outputs
            del g.history[start:]
            g.decode(first)
        for in_place in order[:2 * blocks]:
            g = gens[in_place]
            g.caches_in_place = in_place or outputs
            del g.history[start:]  # rewind: the same positions every block
            token = int(g.decode(first).argmax())  # untimed: a switch of path copies the window once
            t, c = time.perf_counter(), time.process_time()
            for _ in range(steps):
                token = int(g.decode(token).argmax())
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            key = "in place" if in_place else "copied"
            res[key].append(1000 * cpu / steps)
            res["wall " + key].append(1000 * wall / steps)
            shared = any(g._store.outputs_shared(x) for _, x in [*g.decode_windows, (0, g.decode_session)])
            out["paths"][key] = g.cache_io + (f", outputs {'in place' if shared else 'read'}" if outputs else "")
        out[n] = res
    return out


def prepare(work: Path, weights: str) -> str:
    """The converted directory of ``weights`` in ``work`` (made when missing)."""
    d = work / f"tflite-{weights}"
    if not (d / "manifest.json").exists():
        cmd = [sys.executable, "-m", "circleops.cli", "convert", "smollm2", "--graphs", "prefill,decode", "--target",
               "tflite", "--quantize", weights, "-o", str(d)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return str(d)


def summary(runs: list[dict], lengths: list[str]) -> dict:
    """(weights, threads, length) -> medians and ranges over every block pair of every round."""
    out: dict = {}
    for r in runs:
        for n in lengths:
            res = r[n]
            s = out.setdefault((r["weights"], r["threads"], n), {"ratio": [], "wall_ratio": [], "in place": [],
                                                                 "copied": []})
            s["ratio"] += [a / b for a, b in zip(res["in place"], res["copied"])]
            s["wall_ratio"] += [a / b for a, b in zip(res["wall in place"], res["wall copied"])]
            s["in place"] += res["in place"]
            s["copied"] += res["copied"]
    return out


def _window(pos: int) -> int:
    """The cache slots SmolLM2's decode step at ``pos`` reads (its default decode windows, cache 512)."""
    return next(w for w in (32, 64, 128, 256, 512) if pos <= w)


def table(summ: dict, threads: list[int], lengths: list[str], outputs: bool = False) -> dict:
    a, b = ("outputs in place", "outputs read") if outputs else ("in place", "copied")
    columns = ["file", "threads", "prompt tokens (decode window)", f"{b}: CPU ms/token", f"{a}: CPU ms/token",
               f"{a} / {b}: CPU (median, range)", f"{a} / {b}: wall (median)", "block pairs",
               f"int4 / w8 {a}: CPU"]
    rows = []
    for t in threads:
        for w in FILES:
            for n in lengths:
                s = summ.get((w, t, n))
                if not s:
                    continue
                other = summ.get(("w8", t, n))
                vs_w8 = (f"{statistics.median(s['in place']) / statistics.median(other['in place']):.2f}"
                         if w == "int4" and other else "")
                rows.append([FILES[w], str(t), f"{n} ({_window(int(n) + summ['steps'] + 1)} slots)",
                             f"{statistics.median(s['copied']):.1f}", f"{statistics.median(s['in place']):.1f}",
                             f"{statistics.median(s['ratio']):.2f} ({min(s['ratio']):.2f}-{max(s['ratio']):.2f})",
                             f"{statistics.median(s['wall_ratio']):.2f}", str(len(s["ratio"])), vs_w8])
    return {"columns": columns, "align": ["left"] + ["right"] * (len(columns) - 1), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, nargs="+", default=[5, 300])
    ap.add_argument("--steps", type=int, default=24, help="decode steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per path per prompt in each child")
    ap.add_argument("--work", default="/tmp/circleops-llm-speed")
    ap.add_argument("--json", default=None, help="also write the children's raw results here (after every child)")
    ap.add_argument("--from-json", default=None, help="no measuring: the table from a --json file")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--results", default=str(RESULTS_FILE))
    ap.add_argument("--note", default="")
    ap.add_argument("--outputs", action="store_true",
                    help="both paths read their caches in place; compare the step outputs read in place (LiteRT's "
                         "output buffers' memory) against TensorBuffer.read (issue 34; bench/results/49-*)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        print(json.dumps(child(args.child, args.threads[0], spec["prompts"], spec["steps"], spec["blocks"],
                               spec.get("outputs", False))))
        return 0
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from llm_speed import cpu_flags, cpu_model, prompt_ids

        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
        dirs = {w: prepare(work, w) for w in FILES}
        spec_path = work / "inplace-spec.json"
        spec_path.write_text(json.dumps({"prompts": prompt_ids(args.prompts), "steps": args.steps,
                                         "blocks": args.blocks, "outputs": args.outputs}))
        data = {"runs": [], "loads": [], "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "steps": args.steps,
                "blocks": args.blocks, "rounds": args.rounds, "threads": args.threads,
                "prompts": [str(n) for n in args.prompts], "outputs": args.outputs}
        for rnd in range(args.rounds):
            for t in args.threads:
                for w, d in dirs.items():
                    before = os.getloadavg()[0]
                    env = dict(os.environ, NUM_THREADS=str(t), OMP_NUM_THREADS=str(t))
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
                    proc = subprocess.run([sys.executable, __file__, "--child", d, "--threads", str(t), "--spec",
                                           str(spec_path)], env=env, capture_output=True, text=True)
                    after = os.getloadavg()[0]
                    if proc.returncode != 0:
                        print(f"round {rnd} {w} t{t}: FAILED {proc.stderr.strip().splitlines()[-3:]}", flush=True)
                        continue
                    r = json.loads(proc.stdout.strip().splitlines()[-1])
                    r.update(weights=w, threads=t, round=rnd)
                    data["runs"].append(r)
                    data["loads"].append([round(before, 1), round(after, 1)])
                    print(f"round {rnd} {w} t{t} (load {before:.1f}/{after:.1f}): " + "; ".join(
                        f"{n}: in place {statistics.median(r[n]['in place']):.1f} copied "
                        f"{statistics.median(r[n]['copied']):.1f} CPU ms/token" for n in data["prompts"]), flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(data, indent=1))
    summ = summary(data["runs"], data["prompts"])
    summ["steps"] = data["steps"]
    outputs = data.get("outputs", False)
    tab = table(summ, data["threads"], data["prompts"], outputs)
    sys.path.insert(0, str(ROOT / "bench"))
    import report

    print(report.render_table(tab))
    loads = [x for pair in data["loads"] for x in pair]
    print(f"load average (1 min) around the children: {min(loads)}-{max(loads)}")
    if args.write:
        import yaml

        what = ("caches in place both ways; the step's outputs read in place (the output buffers' memory) and "
                "through TensorBuffer.read (a second Generator)" if outputs else "in place and copied")
        text = (f"`python bench/int4_decode_inplace.py{' --outputs' if outputs else ''} --write` ({data['started']}; "
                f"{data['rounds']} rounds, one child "
                f"per (file, threads) per round; in each child blocks of {data['steps']} greedy decode steps, "
                f"{data['blocks']} per path per prompt, {what} alternately (ABBA), every block from the "
                f"same position; ratios per adjacent block pair, medians and ranges over all pairs). CPU: "
                f"{data['cpu']}, {data['cores']} cores, flags {', '.join(data['flags']) or 'no avx512'}. Load average "
                f"(1 min) around the children: {min(loads)}-{max(loads)}. {args.note}").rstrip() + "\n"
        heading = ("bench/int4_decode_inplace.py --outputs — LiteRT decode reading its outputs in place (issue 34)"
                   if outputs else "bench/int4_decode_inplace.py — LiteRT decode with the KV caches read in place (issue 34)")
        results = {"heading": heading,
                   "blocks": [{"text": text}, {"table": tab}]}
        Path(args.results).write_text(yaml.safe_dump(results, sort_keys=False, width=100, allow_unicode=True))
        report.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
