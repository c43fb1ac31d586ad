"""Benchmark (not a test): perplexity on the shipped text of circleops' tflite files against
litert-torch's own export of SmolLM2, both run by LiteRT (issue 26).

    python bench/litert_perplexity.py --write          # -> bench/results/11-litert-perplexity.yaml
    python bench/litert_perplexity.py --max-windows 2  # a short look

circleops: `circleops check smollm2 --quantize w8 --runtime litert` (circleops.tools.quant_report:
the tflite w8 file with attention inline, as the generation graphs write it, scoring every
window in one forward; fp32 is torch). litert-torch: its `model.tflite` and
`model_quantized.tflite` (--with-fp32; bench/llm_speed.py makes them, --work), run in its own venv
(--litert-python) token by token through its decode signature (its prefill returns no
logits), the same windows of the same token ids (circleops.tools.quant_report.text_ids: the
shipped perplexity text, SmolLM2's tokenizer, windows of 256 from an empty cache).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_FILE = ROOT / "bench" / "results" / "11-litert-perplexity.yaml"


def peer_nll(path: str, windows: list[list[int]]) -> list[float]:
    """Mean NLL per window of litert-torch's file, decode step by step from an empty cache."""
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path, num_threads=int(os.environ.get("NUM_THREADS", "2")))
    run = it.get_signature_runner("decode")
    details = run.get_input_details()
    cache_len = int(details["mask"]["shape"][-1])
    names = [n for n in details if n.startswith("kv_cache")]
    out = []
    for ids in windows:
        caches = {n: np.zeros(details[n]["shape"], np.float32) for n in names}
        nll = []
        for p, (tok, nxt) in enumerate(zip(ids[:-1], ids[1:])):
            mask = np.full((1, 1, 1, cache_len), -np.inf, np.float32)
            mask[..., :p + 1] = 0
            res = run(tokens=np.asarray([[tok]], np.int32), input_pos=np.asarray([p], np.int32), mask=mask, **caches)
            caches = {n: res[n] for n in names}
            x = res["logits"].reshape(-1).astype(np.float64)
            x -= x.max()
            nll.append(math.log(np.exp(x).sum()) - x[nxt])
        out.append(float(np.mean(nll)))
    return out


def executorch_nll(directory: str, windows: list[list[int]]) -> list[float]:
    """Mean NLL per window of ExecuTorch's .pte (optimum-executorch's ExecuTorchModelForCausalLM,
    XNNPACK), token by token from position 0 as the peers are: its custom SDPA attends only to
    slots up to the position, so a window needs no cache reset."""
    import numpy as np
    import torch
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
    from optimum.executorch import ExecuTorchModelForCausalLM

    threads = int(os.environ.get("NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)
    model = ExecuTorchModelForCausalLM.from_pretrained(directory)
    out = []
    for ids in windows:
        nll = []
        for p, (tok, nxt) in enumerate(zip(ids[:-1], ids[1:])):
            logits = model.forward(input_ids=torch.tensor([[tok]], dtype=torch.long),
                                   cache_position=torch.tensor([p], dtype=torch.long))
            x = logits.reshape(-1, logits.shape[-1])[-1].double().numpy()
            x = x - x.max()
            nll.append(math.log(np.exp(x).sum()) - x[nxt])
        out.append(float(np.mean(nll)))
    return out


def generator_nll(directory: str, windows: list[list[int]]) -> list[float]:
    """Mean NLL per window of a `circleops convert --graphs` directory on LiteRT, scored as the
    peers are: token by token through circleops' Generator (the first token's prefill, then a
    decode step per token, each window from an empty cache)."""
    import numpy as np

    from circleops.generation.generator import Generator

    gen = Generator(directory, runtime="litert")
    out = []
    for ids in windows:
        logits, nll = gen.prefill(ids[:1]), []
        for p, nxt in enumerate(ids[1:]):
            x = np.asarray(logits, np.float64).reshape(-1)
            x = x - x.max()
            nll.append(math.log(np.exp(x).sum()) - x[nxt])
            if p + 2 < len(ids):
                logits = gen.decode(nxt)
        out.append(float(np.mean(nll)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/circleops-llm-speed", help="where bench/llm_speed.py keeps litert-torch's export")
    ap.add_argument("--litert-python", default="/work/venvs/anchor-litert/bin/python")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--check-json", default=None, help="an earlier `circleops check --json` of w8 on litert (no rerun)")
    ap.add_argument("--with-fp32", action="store_true", help="litert-torch's fp32 file too")
    ap.add_argument("--quantize", default="w8", help="circleops' format (w8, int4, ...): `circleops check --quantize`")
    ap.add_argument("--peer-files", nargs="*", default=None, metavar="NAME",
                    help="litert-torch's files in --work/litert-torch to score (default: model_quantized.tflite; "
                         "bench/llm_speed.py names its int4 files model_int4-b32.tflite, model_int4-pc.tflite)")
    ap.add_argument("--results", default=str(RESULTS_FILE))
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--fp32", type=float, default=None,
                    help="torch fp32's perplexity on these windows, known already: no `circleops check` run")
    ap.add_argument("--circleops-dirs", nargs="*", default=[], metavar="DIR",
                    help="converted directories (`convert --graphs`) scored token by token on LiteRT, as the peers")
    ap.add_argument("--executorch-python", default="/work/venvs/anchor-executorch/bin/python",
                    help="the Python of the ExecuTorch venv (bench/llm_speed.py's --executorch-python)")
    ap.add_argument("--executorch", action="store_true",
                    help="ExecuTorch's 8da4w export too (--work/executorch-8da4w, made by bench/llm_speed.py)")
    ap.add_argument("--peer", nargs=2, help=argparse.SUPPRESS)  # child: MODEL WINDOWS_JSON
    ap.add_argument("--et", nargs=2, help=argparse.SUPPRESS)  # child: PTE_DIR WINDOWS_JSON
    ap.add_argument("--generator", nargs=2, help=argparse.SUPPRESS)  # child: DIR WINDOWS_JSON
    args = ap.parse_args(argv)
    if args.peer:
        print(json.dumps(peer_nll(args.peer[0], json.loads(Path(args.peer[1]).read_text()))))
        return 0
    if args.et:
        print(json.dumps(executorch_nll(args.et[0], json.loads(Path(args.et[1]).read_text()))))
        return 0
    if args.generator:
        print(json.dumps(generator_nll(args.generator[0], json.loads(Path(args.generator[1]).read_text()))))
        return 0

    from transformers import AutoTokenizer

    from circleops.sources.models import smollm2_dir
    from circleops.tools.quant_report import text_ids

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    ids = text_ids(tok, 49152)
    count = len(ids) // args.window if args.max_windows is None else min(args.max_windows, len(ids) // args.window)
    windows = [ids[k * args.window:(k + 1) * args.window] for k in range(count)]
    spec = Path(args.work) / "perplexity-windows.json"
    spec.write_text(json.dumps(windows))
    load0 = os.getloadavg()[0]
    rows = []
    if args.fp32 is not None:  # no `circleops check` (it scores the whole file per window: slow on a busy machine)
        check = None
    elif args.check_json:
        check = json.loads(Path(args.check_json).read_text())
    else:
        out = Path(args.work) / f"check-{args.quantize}-litert.json"
        cmd = [str(Path(sys.executable).with_name("circleops")), "check", "smollm2", "--quantize", args.quantize,
               "--runtime", "litert", "--window", str(args.window), "--json", str(out)]
        cmd += ["--max-windows", str(args.max_windows)] if args.max_windows else []
        subprocess.run(cmd, check=True)
        check = json.loads(out.read_text())
    if check is None:
        fp32 = args.fp32
        rows.append(["torch fp32 (transformers; --fp32, measured earlier on the same windows)", f"{fp32:.3f}", ""])
    else:
        assert check["perplexity_tokens"] == count * (args.window - 1), "the check scored other windows"
        rows.append(["torch fp32 (transformers)", f"{check['perplexity_fp32']:.3f}", ""])
        rows.append([f"circleops --target tflite --quantize {check.get('format', args.quantize)} (LiteRT)",
                     f"{check['perplexity_quantized']:.3f}", f"{check['perplexity_ratio'] - 1:+.2%}"])
        fp32 = check["perplexity_fp32"]
    labels = {"model_quantized.tflite": "litert-torch 0.10 export_hf dynamic int8 weights (LiteRT)",
              "model_int4-b32.tflite": "litert-torch 0.10 + ai-edge-quantizer dynamic_wi4b32_afp32 (LiteRT)",
              "model_int4-pc.tflite": "litert-torch 0.10 + ai-edge-quantizer dynamic_wi4_afp32, per channel (LiteRT)"}
    peers = [(labels.get(n, n), n) for n in (args.peer_files if args.peer_files is not None
                                             else ["model_quantized.tflite"])]
    if args.with_fp32:  # the same model as torch fp32 (minutes more, token by token)
        peers.insert(0, ("litert-torch 0.10 export_hf fp32 (LiteRT)", "model.tflite"))
    runs = [(label, [args.litert_python, __file__, "--peer", str(Path(args.work) / "litert-torch" / name), str(spec)])
            for label, name in peers]
    if args.executorch:  # optimum-executorch 8da4w + 8-bit embedding, token by token in its venv
        runs.append(("ExecuTorch 1.5.1 8da4w + 8-bit embedding (optimum-executorch, XNNPACK)",
                     [args.executorch_python, __file__, "--et", str(Path(args.work) / "executorch-8da4w"), str(spec)]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    runs += [(f"circleops {Path(d).name} (Generator, token by token, LiteRT)",
              [sys.executable, __file__, "--generator", d, str(spec)]) for d in args.circleops_dirs]
    for label, cmd in runs:
        t = time.perf_counter()
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        nll = json.loads(proc.stdout.strip().splitlines()[-1])
        ppl = math.exp(sum(nll) / len(nll))
        rows.append([label, f"{ppl:.3f}", f"{ppl / fp32 - 1:+.2%}"])
        print(f"{label}: {ppl:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)
    load1 = os.getloadavg()[0]
    table = {"columns": ["", "perplexity", "vs torch fp32"], "align": ["left", "right", "right"], "rows": rows}
    sys.path.insert(0, str(ROOT / "bench"))
    import report

    print(report.render_table(table))
    if args.write:
        import yaml

        text = (f"`python bench/litert_perplexity.py --write` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}): "
                f"SmolLM2-135M's perplexity on circleops' shipped perplexity text ({count * (args.window - 1)} "
                f"tokens scored, {count} windows of {args.window} from an empty cache), each file run by LiteRT "
                f"(XNNPACK); " + (f"circleops' file is `circleops check smollm2 --quantize {args.quantize} --runtime "
                                  f"litert` (every linear of the tflite generation graphs), " if check else "")
                + ("circleops' directories token by token through the Generator (prefill, then decode steps), "
                   if args.circleops_dirs else "")
                + f"litert-torch's files token by token through their decode signature. Load average {load0:.1f} / "
                f"{load1:.1f} (perplexity does not depend on it).\n")
        heading = ("bench/litert_perplexity.py — int8-weight tflite files: perplexity beside litert-torch's"
                   if args.quantize == "w8" else f"bench/litert_perplexity.py --quantize {args.quantize} — perplexity "
                   "beside litert-torch's int4 files (issue 34)")
        Path(args.results).write_text(yaml.safe_dump({"heading": heading,
                                                "blocks": [{"text": text}, {"table": table}]},
                                               sort_keys=False, width=100, allow_unicode=True))
        report.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
