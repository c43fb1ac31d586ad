"""Benchmark (not a test): SmolLM2-135M's MLP down projections at 4 bits in the LiteRT int4 file (issue 34).

    python bench/int4_down.py --out /tmp/m.json                        # the roundings of all 30 downs
    python bench/int4_down.py --out /tmp/s.json --methods rtn --shares 0.05 0.1 0.2   # the proxy's choices
    python bench/int4_down.py --out /tmp/k.json --methods rtn --kl 1024 --ks 8 12 16 20  # ranked by KL
    python bench/int4_down.py --write /tmp/m.json /tmp/s.json /tmp/k.json   # -> bench/results/67-int4-downs.yaml

torch emulating the file's arithmetic (as bench/int4_quality.py: int4 blocks of 32 with
importance-weighted bf16-grid scales, or int8 per channel; one int8 table for the embedding
and tied head; every linear's input rounded to int8 per row, asymmetric, as XNNPACK's qd8
kernels do). Perplexity in windows of 256 on two texts: the SELECTION text
(circleops/quantize/selection.txt), on which choices are made, and the shipped scored text
(perplexity.txt), which is only reported. Variants of the 30 downs' rounding:

* ``rtn``: circleops.quantize.int4.quantize (what every other int4 linear gets);
* ``clip``: the same with wider clipping candidates (the block's largest magnitude onto up to
  -12 levels: clipped) — circleops.quantize.int4's candidate search, extended;
* ``gptq``: GPTQ at those static scales, act order, Hessian of the calibration text
  (circleops.quantize.int4_gptq.gptq_static), damping 0.01 and 0.1;
* ``had32``: an online Hadamard of 32 on each down's input (x·H per block of 32, folded into the
  weight as W·H), the rotation a LiteRT graph could carry as one small product per layer;
* ``b16``: blocks of 16 (XNNPACK does not delegate them: information only);
* ``imp0`` / ``imp0.5`` / ``imp2``: the rounding's importance to that power (0: unweighted);
* choices of which downs go to 4 bits, each made on the selection text and scored on both:
  ``--shares``: a one-pass proxy (each down's 4-bit output noise over the residual stream it
  writes into, :func:`proxy_costs`), the cheapest downs while their summed cost stays within the
  share; ``--kl``: each down alone at 4 bits, its KL divergence from the file with every down
  int8; ``--per-layer``: each down alone, the selection perplexity; then the ``--ks`` cheapest.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from int4_quality import perplexity, scorer, text_windows  # noqa: E402 - the same teacher-forced perplexity as the int4 table's


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def clipped_quantize(w: torch.Tensor, imp: torch.Tensor, extra: tuple[float, ...]):
    from circleops.quantize import int4

    saved = int4._MULTIPLIERS
    int4._MULTIPLIERS = saved + tuple(-(8.0 + s) for s in extra)
    try:
        return int4.quantize(w, 32, imp)
    finally:
        int4._MULTIPLIERS = saved


def proxy_costs(model: torch.nn.Module, ids: list[int], imp: dict[str, torch.Tensor], layer_of: dict[str, int],
                window: int = 256) -> dict[str, float]:
    """Each down's 4-bit output noise over the residual stream it writes into, one forward of the
    float model over ``ids``: sum ‖x (Ŵ4 − W)ᵀ‖² / sum ‖decoder layer output‖² (Ŵ4: the file's
    importance-weighted int4 blocks). A cheap ranking, measured here against the perplexity."""
    from circleops.quantize import int4

    mods = dict(model.named_modules())
    layers = model.model.layers
    noise = {n: 0.0 for n in imp}
    energy = {i: 0.0 for i in range(len(layers))}
    deltas = {n: int4.dequantize(int4.quantize(mods[n].weight.detach(), 32, imp[n])) - mods[n].weight.detach()
              for n in imp}
    handles = []
    for n in imp:
        def pre(_m, a, n=n):
            x = a[0].reshape(-1, a[0].shape[-1])
            noise[n] += float((x @ deltas[n].T).double().pow(2).sum())
        handles.append(mods[n].register_forward_pre_hook(pre))
    for i, layer in enumerate(layers):
        def post(_m, _a, o, i=i):
            h = o[0] if isinstance(o, (tuple, list)) else o
            energy[i] += float(h.double().pow(2).sum())
        handles.append(layer.register_forward_hook(post))
    try:
        with torch.no_grad():
            for k in range(0, len(ids) - 1, window):
                model(input_ids=torch.tensor([ids[k:k + window]]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: noise[n] / energy[layer_of[n]] for n in imp}


def proxy_choice(cost: dict[str, float], share: float) -> set[str]:
    """The downs at 4 bits: cheapest first while their summed cost stays within ``share`` of all."""
    total, spent, four = sum(cost.values()), 0.0, set()
    for n in sorted(cost, key=cost.get):
        if spent + cost[n] > share * total:
            break
        spent += cost[n]
        four.add(n)
    return four


RESULTS_FILE = ROOT / "bench" / "results" / "67-int4-downs.yaml"


def write(paths: list[str], note: str) -> int:
    """The runs' rows (each variant once, the first run that scored it) as the results file."""
    import yaml

    sys.path.insert(0, str(ROOT / "bench"))
    import report

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fp32 = runs[0]["fp32"]
    seen, rows = set(), []
    for run in runs:
        for r in run["rows"]:
            if r["variant"] in seen or "selection" not in r or "shipped" not in r:
                continue
            seen.add(r["variant"])
            rows.append([r["variant"], f"{r['selection']:.3f}", f"{r['selection_pct']:+.2f} %", f"{r['shipped']:.3f}",
                         f"{r['shipped_pct']:+.2f} %"])
    extra = []
    for run in runs:
        if "proxy_costs" in run:
            order = sorted(run["proxy_costs"], key=lambda k: -run["proxy_costs"][k])
            extra.append("One-pass proxy (bench/int4_down.py proxy_costs: ‖x(Ŵ4−W)ᵀ‖² over the layer output's energy, "
                         "1024 selection tokens), costliest first: " + ", ".join(
                             f"L{k} {run['proxy_costs'][k]:.1e}" for k in order[:8]) + ", ... (layers 12-26 below 3e-5).")
        if "kl_selection" in run:
            kl = run["kl_selection"]
            order = sorted(kl, key=lambda k: kl[k])
            extra.append(f"KL of each down alone at 4 bits (first 1024 selection tokens, against every down int8): "
                         f"{min(kl.values()):.4f}-{max(kl.values()):.4f} nats/token, cheapest first "
                         + " ".join(order) + f" ({run.get('kl_cpu_s', '?')} s CPU for the 30).")
        if "per_layer_selection_pct" in run:
            extra.append("Each down alone at 4 bits, selection perplexity against every down int8 (run stopped after "
                         "9 layers): " + ", ".join(f"L{n.split('.')[2]} {v:+.2f} %" for n, v in
                                                   run["per_layer_selection_pct"].items()))
    loads = ", ".join(f"{r.get('load0', 0):.1f}-{r.get('load1', r.get('load0', 0)):.1f}" for r in runs)
    text = (f"`python bench/int4_down.py` ({', '.join(r['started'] for r in runs)}; load average {loads}: perplexity "
            f"does not depend on it). SmolLM2-135M, torch emulating the int4 file's arithmetic (bench/int4_quality.py's: "
            f"every other decoder linear int4 blocks of 32, importance-weighted; the int8 table and tied head; every "
            f"linear's input rounded to int8 per row as XNNPACK does), the 30 MLP down projections as each row says. "
            f"Perplexity on two texts, every window of 256: the SELECTION text (circleops/quantize/selection.txt, "
            f"{runs[0]['windows']['selection']} windows; Python Language Reference prose, PSF license), on which a "
            f"choice is made, and the shipped scored text (perplexity.txt, {runs[0]['windows']['shipped']} windows), "
            f"only reported. torch fp32: selection {fp32['selection']:.3f}, shipped {fp32['shipped']:.3f}. "
            f"{note}").rstrip() + "\n"
    blocks = [{"text": text},
              {"table": {"columns": ["variant (the 30 MLP downs)", "selection", "vs fp32", "shipped text", "vs fp32"],
                         "align": ["left", "right", "right", "right", "right"], "rows": rows}}]
    blocks += [{"text": t + "\n"} for t in extra]
    data = {"heading": "bench/int4_down.py — the int4 file's MLP down projections at 4 bits (issue 34)", "blocks": blocks}
    RESULTS_FILE.write_text(yaml.safe_dump(data, sort_keys=False, width=100, allow_unicode=True))
    report.main([])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the run's JSON (written as it goes)")
    ap.add_argument("--write", nargs="+", metavar="JSON", default=None,
                    help="no run: these runs' JSONs -> bench/results/67-int4-downs.yaml and docs/benchmarks.md")
    ap.add_argument("--note", default="", help="a sentence for the results text (what the runs were)")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--methods", nargs="+", default=["rtn", "clip", "gptq", "gptq-d0.1", "had32", "b16"])
    ap.add_argument("--per-layer", default="", help="the rounding the per-layer ranking uses (empty: none)")
    ap.add_argument("--ks", type=int, nargs="*", default=[10, 15, 20, 25])
    ap.add_argument("--head4", action="store_true",
                    help="the tied head at int4 too (blocks of 32, importance-weighted; the embedding keeps the int8 "
                         "table): scored with the downs int8 and with every --methods rounding")
    ap.add_argument("--kl", type=int, default=0,
                    help="rank the downs by the KL divergence each alone at 4 bits makes on the first N selection "
                         "tokens (against the file with every down int8), then score the --ks cheapest at 4 bits")
    ap.add_argument("--shares", type=float, nargs="*", default=[],
                    help="the one-pass proxy's choice (proxy_costs, proxy_choice) at these shares, each scored on both texts")
    args = ap.parse_args(argv)
    if args.write:
        return write(args.write, args.note)
    if not args.out:
        ap.error("--out is needed for a run")
    torch.set_num_threads(1)

    from circleops.sources.models import load_smollm2
    from circleops.quantize import int4, int8
    from circleops.quantize.importance import input_importance, calibration_ids
    from circleops.quantize.selection import selection_ids

    model, tok = load_smollm2()
    model.eval()
    wins = text_windows(tok, args.window)
    out: dict = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load0": os.getloadavg()[0],
                 "windows": {k: len(v) for k, v in wins.items()}, "rows": []}
    cpu0 = time.process_time()

    score = scorer(model, wins, out, args.out)

    out["fp32"] = {}
    for t, w in wins.items():
        out["fp32"][t] = perplexity(model, w)
    print("fp32", out["fp32"], flush=True)
    importance = input_importance(model, (), tok)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    imp = {n: importance.get(("torch", m.weight.untyped_storage().data_ptr(), m.weight.numel(), str(m.weight.dtype)))
           for n, m in linears.items()}
    downs = [n for n in linears if n.endswith("mlp.down_proj")]
    # GPTQ Hessians (calibration text) and rotated-input importances of the downs, fp32 model
    from circleops.quantize.gptq import hessians
    from circleops.quantize.int4_gptq import gptq_static

    need_h = any(m.startswith("gptq") for m in args.methods)
    samples = [(calibration_ids(model, tok),)]
    if any(m.startswith("gptq-gen") for m in args.methods):
        # data-free calibration: text the fp32 model samples itself (8 x 256 tokens from BOS,
        # temperature 1, seed 0), beside the calibration text: 4x its tokens, neither scored text
        torch.manual_seed(0)
        with torch.no_grad():
            gen = model.generate(torch.full((8, 1), tok.bos_token_id or 1), do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=255, min_new_tokens=255, pad_token_id=0,
                                 use_cache=True)  # the loaded config says False: quadratic without
        samples += [(gen[i:i + 1],) for i in range(gen.shape[0])]
        out["generated_tokens"] = int(gen.numel())
        print("generated", tuple(gen.shape), repr(tok.decode(gen[0, :40])), flush=True)
    hs, tokens = (hessians(model, {n: linears[n] for n in downs}, samples) if need_h else ({}, 0))
    out["gptq_tokens"] = tokens
    H32 = hadamard(32)
    rot_imp: dict[str, torch.Tensor] = {}
    if "had32" in args.methods:
        def rot(x: torch.Tensor) -> torch.Tensor:
            return (x.reshape(*x.shape[:-1], -1, 32) @ H32).reshape(x.shape)

        acc = {n: [torch.zeros(linears[n].in_features, dtype=torch.float64), 0] for n in downs}
        hooks = []
        for n in downs:
            def pre(mod, inputs, n=n):
                x = rot(inputs[0].reshape(-1, inputs[0].shape[-1]))
                acc[n][0] += (x.double() ** 2).sum(0)
                acc[n][1] += x.shape[0]
            hooks.append(linears[n].register_forward_pre_hook(pre))
        with torch.no_grad():
            model(calibration_ids(model, tok))
        for h in hooks:
            h.remove()
        rot_imp = {n: (a / max(c, 1)).float() for n, (a, c) in acc.items()}

    # the one-pass proxy's choice at each share, on the float model
    choices = {}
    if args.shares:
        c0 = time.process_time()
        cost = proxy_costs(model, selection_ids(tok, 49152)[:1024], {n: imp[n] for n in downs},
                           {n: i for i, n in enumerate(downs)})
        cpu = time.process_time() - c0
        out["proxy_costs"] = {n.split(".")[2]: c for n, c in cost.items()}
        for share in args.shares:
            choices[share] = (proxy_choice(cost, share), cpu)
            print(share, sorted(int(n.split(".")[2]) for n in choices[share][0]), flush=True)
    # the file's arithmetic: int8 per-row rounding of every linear's input, the int8 table
    rotate_input: set[str] = set()

    def rounded_input(mod, inputs):
        x = inputs[0]
        if getattr(mod, "_had32", False):
            x = (x.reshape(*x.shape[:-1], -1, 32) @ H32).reshape(x.shape)
        xq, sx, _ = int8.quantize_rows_asymmetric(x.reshape(-1, x.shape[-1]))
        return ((xq.to(torch.float32) * sx).reshape(x.shape),)

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(rounded_input)
    table = model.model.embed_tokens.weight
    original_table = table.detach().clone()
    with torch.no_grad():
        table.copy_(int8.dequantize(int8.quantize_per_channel(table.detach().clone())))
        for n, m in linears.items():
            if n not in downs:
                m.weight.copy_(int4.dequantize(int4.quantize(original[n], 32, imp[n])))
    eight = {n: int8.dequantize(int8.quantize_per_channel(original[n])) for n in downs}

    def down_weights(method: str) -> dict[str, torch.Tensor]:
        res = {}
        for n in downs:
            w = original[n]
            if method == "rtn":
                res[n] = int4.dequantize(int4.quantize(w, 32, imp[n]))
            elif method.startswith("imp"):  # importance to a power (imp0: plain, imp0.5: softened)
                res[n] = int4.dequantize(int4.quantize(w, 32, imp[n] ** float(method[3:])))
            elif method == "clip":
                res[n] = int4.dequantize(clipped_quantize(w, imp[n], (1.5, 2.0, 2.5, 3.0, 4.0)))
            elif method.startswith("gptq"):  # gptq[-gen][-dDAMP]: the Hessian of ``samples``
                damp = float(method.split("-d")[1]) if "-d" in method else 0.01
                packed = int4.quantize(w, 32, imp[n])
                scale = int4.expanded_scales(packed)
                res[n] = gptq_static(w, hs[n], scale, damp=damp) * scale
            elif method == "had32":
                wr = (w.reshape(w.shape[0], -1, 32) @ H32).reshape(w.shape)  # W·H (H symmetric)
                res[n] = int4.dequantize(int4.quantize(wr, 32, rot_imp[n]))
            elif method == "b16":
                res[n] = int4.dequantize(int4.quantize(w, 16, imp[n]))
            else:
                raise ValueError(method)
        return res

    def apply(four: dict[str, torch.Tensor], at4: set[str], had: bool = False) -> None:
        with torch.no_grad():
            for n in downs:
                linears[n]._had32 = had and n in at4
                linears[n].weight.copy_(four[n] if n in at4 else eight[n])

    apply({}, set())
    score("current: downs int8")
    if args.head4:  # an untied head of its own: int4 blocks, weighted by the final norm's output
        head = model.lm_head
        key = ("torch", table.untyped_storage().data_ptr(), table.numel(), str(table.dtype))
        head.weight = torch.nn.Parameter(int4.dequantize(int4.quantize(original_table, 32, importance.get(key))),
                                         requires_grad=False)
        score("current + head int4")
    methods: dict[str, dict] = {}
    for method in args.methods:
        t0 = time.process_time()
        methods[method] = down_weights(method)
        apply(methods[method], set(downs), had=method == "had32")
        row = score(f"all downs int4 {method}")
        row["rounding_cpu_s"] = round(time.process_time() - t0, 1)
    for share, (at4, cpu) in choices.items():
        four = methods.get("rtn") or down_weights("rtn")
        apply(four, at4)
        row = score(f"proxy share {share}: {len(at4)} downs int4, kept int8: "
                    + " ".join(n.split(".")[2] for n in downs if n not in at4))
        row["choose_cpu_s"] = round(cpu, 1)
    if args.kl:
        four = methods.get("rtn") or down_weights("rtn")
        sel = [w for w in wins["selection"]][: max(1, args.kl // args.window)]
        apply(four, set())
        with torch.no_grad():
            ref = [torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1) for w in sel]

        def kl_of() -> float:
            tot, n = 0.0, 0
            with torch.no_grad():
                for w, r in zip(sel, ref):
                    lq = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1)
                    tot += float((r.exp() * (r - lq)).sum())
                    n += len(w)
            return tot / n

        t0 = time.process_time()
        kl = {}
        for n in downs:
            apply(four, {n})
            kl[n] = kl_of()
            print(f"KL {n} {kl[n]:.3e}", flush=True)
        out["kl_selection"] = {n.split(".")[2]: v for n, v in kl.items()}
        out["kl_cpu_s"] = round(time.process_time() - t0, 1)
        order = sorted(downs, key=lambda n: kl[n])
        for k in args.ks:
            apply(four, set(order[:k]))
            score(f"KL: {k} cheapest downs int4, kept int8: " + " ".join(n.split(".")[2] for n in order[k:]))
    if args.per_layer:
        method = args.per_layer
        four = methods.get(method) or down_weights(method)
        base = out["rows"][0]["selection"]
        sens = {}
        for n in downs:
            apply(four, {n}, had=method == "had32")
            sens[n] = perplexity(model, wins["selection"]) / base - 1
            print(f"{n} {100 * sens[n]:+.3f} %", flush=True)
        out["per_layer_selection_pct"] = {n: round(100 * s, 4) for n, s in sens.items()}
        order = sorted(downs, key=lambda n: sens[n])
        for k in args.ks:
            apply(four, set(order[:k]), had=method == "had32")
            score(f"{k} least sensitive downs int4 {method} (chosen on selection)")
    out["cpu_s"] = round(time.process_time() - cpu0, 1)
    out["load1"] = os.getloadavg()[0]
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
