"""Greedy tokens of a converted directory against transformers' own greedy generate (issue 32).

    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --new 16 --save /tmp/1b-hf.json
    python bench/scale_tokens.py --dir /out/1b-tflite --runtime litert --new 16 --against /tmp/1b-hf.json
    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --round-weights fp16 --save /tmp/1b-hf16.json
    python bench/scale_tokens.py --quantized /work/models/qwen2.5-1.5b-shape --target tflite --quantize int4 \
        --out /tmp/1.5b-int4 --save /tmp/1.5b-int4.json

The first form runs transformers (fp32, `generate(do_sample=False)`) on the prompt ids and
saves its new tokens (``--round-weights fp16``: on the weights an fp16 file holds, each
rounded to fp16 and computed in fp32: torch running the file's own weights); the second runs circleops' Generator on a converted directory with the
same ids and prints whether its tokens are the same, with decode ms/token, CPU seconds and
peak RSS. Separate processes: each holds one copy of a 1B model's weights.

The third form (issue 32: a quantized directory against torch running the file's own
weights) converts the model with ``--graphs prefill,decode`` and ``--quantize``; once the
graphs are built, while the model holds the weights the files are written from (w8's
SmoothQuant folded in), it runs transformers' greedy ``generate`` (fp32, no cache: the
forward verify uses) inside ``circleops.quantize.weights.dequantized_sources(report, model,
runtime)``: the file's dequantized weights with the runtime's rounding of each quantized
linear's input. The same teacher-forced forward with every rounded input nudged 16 fp32 ulps
(``perturb=0``) gives each step's noise: how far a rounding another summation order flips
moves the logits. The model is freed, then a child runs the second form on the written
directory. It prints both token lists, how many agree, the first step that differs and there
torch's top-2 logit margin, the logit gap to the directory's token and that step's noise: a
flip at a margin within the noise is the runtime's rounding, not an error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Iterator

IDS = [128000, 791, 6864, 315, 9822, 374, 12366, 13]  # any ids below every vocabulary here


def hf_tokens(path: str, ids: list[int], new: int, round_weights: str | None = None) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if round_weights == "fp16":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.float16).to(torch.float32))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


RUNTIMES = {"tflite": "litert", "onert": "onert"}


@contextlib.contextmanager
def decoded_once() -> Iterator[None]:
    """dequantized_sources decodes each weight every forward (no second copy of the model's
    weights: issue 32), 18 forwards here; inside, a decoded weight whose values fp16 holds
    exactly (int4: a bf16 scale times an integer of 4 bits fits fp16's 11 bits) is kept as
    fp16 and widened per use: the same values bit for bit, half the bytes, no repeated unpack
    (the 1.5B shape: ~65 s of CPU per forward otherwise). Others (w8's fp32 scales) decode as before."""
    import torch

    from circleops.quantize import weights

    decoded, memo = weights._decoded, {}

    def once(codec, blocks, dtype, shape2d, like):
        key = (id(blocks), dtype)
        if key in memo:
            return memo[key].to(torch.float32)
        values = decoded(codec, blocks, dtype, shape2d, like)
        half = values.to(torch.float16)
        if values.dtype == torch.float32 and torch.equal(half.to(torch.float32), values):
            memo[key] = half
        return values

    weights._decoded = once
    try:
        yield
    finally:
        weights._decoded = decoded
        memo.clear()


@contextlib.contextmanager
def unfused(model) -> Iterator[None]:
    """The model's own HF forwards while inside (the package step fused it in place for export:
    circle ops' reference kernels, the same numerics at ~30x the CPU: 3.5 s a 24-token forward
    at 135M), the fused ones back after (circleops.adapters.unfuse, reversibly)."""
    from circleops.adapters import _instance

    swapped = {}
    for sub in model.modules():
        if _instance._SAVED in sub.__dict__:
            swapped[sub] = sub.__dict__["forward"]
    _instance.unfuse(model)
    try:
        yield
    finally:
        for sub, forward in swapped.items():
            saved = sub.__dict__.get("forward", _instance._MISSING)
            sub.__dict__[_instance._SAVED] = saved
            sub.__dict__["forward"] = forward


def torch_side(model, quant, runtime: str, ids: list[int], new: int) -> dict:
    """transformers' greedy tokens on the file's own weights and the runtime's input rounding;
    per step: the top-2 margin, the logits (kept for the gap to another token) and the noise."""
    import torch

    from circleops.quantize.weights import dequantized_sources

    c = time.process_time()
    model.eval()
    with torch.no_grad(), decoded_once(), unfused(model):
        with dequantized_sources(quant, model, runtime):
            out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            tokens = [int(t) for t in out.sequences[0, len(ids):]]
            forced = torch.tensor([ids + tokens[:-1]])  # the same steps teacher-forced, in one forward
            logits = model(input_ids=forced, use_cache=False).logits[0, len(ids) - 1:].float()
        with dequantized_sources(quant, model, runtime, perturb=0):
            nudged = model(input_ids=forced, use_cache=False).logits[0, len(ids) - 1:].float()
    generated = torch.stack(out.logits)[:, 0].float()  # the logits each greedy token was picked from
    top = torch.topk(generated, 2, dim=-1)
    return {"tokens": tokens,
            # the same steps in one forward of another length: another summation order, moved as the nudge moves it
            "generate_vs_forced": float((generated - logits).abs().max()),
            "forced_argmax_same": [int(t) for t in logits.argmax(-1)] == tokens,
            "margin": [float(m) for m in top.values[:, 0] - top.values[:, 1]],
            "noise": [float(n) for n in (nudged - logits).abs().max(dim=-1).values],
            "torch_cpu_s": time.process_time() - c, "logits": generated.numpy()}


def convert_with_torch(src: str, out: str, target: str, quantize: str, ids: list[int], new: int,
                       verify: bool) -> tuple[dict, dict]:
    """``circleops convert SRC --graphs prefill,decode --target T --quantize Q -o OUT`` in this
    process, :func:`torch_side` run once the graphs are built; (torch's side, the convert's figures)."""
    from circleops.options import ConvertOptions
    from circleops.package import step
    from circleops.recipes.llm import LLMRecipe

    runtime = RUNTIMES[target]
    seen: dict = {}
    build = step._build

    def hooked(recipe, programs, eps, opts, weights, tracker):
        lowered, quant = build(recipe, programs, eps, opts, weights, tracker)
        seen.update(torch_side(recipe.weights_module(), quant, runtime, ids, new))
        return lowered, quant

    step._build = hooked
    r0, ch0, t = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    options = ConvertOptions(target=target, quantize=quantize, graphs="prefill,decode", verify=verify)
    report = step.run(LLMRecipe.from_source(src, options), out)
    r1, ch1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    step._build = build
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime + ch1.ru_utime + ch1.ru_stime
           - ch0.ru_utime - ch0.ru_stime)
    figures = {"convert_wall_s": time.perf_counter() - t, "convert_cpu_s": cpu - seen["torch_cpu_s"],
               "convert_peak_rss_gb": r1.ru_maxrss / 1e6, "noise_floor": report.noise_floor,
               "verify_errors": {g: i.max_abs_error for g, i in report.graphs.items() if i.max_abs_error is not None},
               "files": {i.file: i.file_size for i in report.graphs.values()}, "summary": report.summary()}
    return seen, figures


def quantized(args: argparse.Namespace, ids: list[int]) -> dict:
    """The third form (module docstring): torch on the file's weights against the directory."""
    import gc
    import subprocess

    vocab = json.loads((Path(args.quantized) / "config.json").read_text())["vocab_size"]
    if max(ids) >= vocab:
        sys.exit(f"scale_tokens: id {max(ids)} is past {args.quantized}'s vocabulary ({vocab}); pass --ids below it")
    seen, figures = convert_with_torch(args.quantized, args.out, args.target, args.quantize, ids, args.new,
                                       args.verify)
    gc.collect()  # the model and its blocks are gone before the child loads the directory
    runtime = RUNTIMES[args.target]
    child = subprocess.run([sys.executable, __file__, "--dir", args.out, "--runtime", runtime, "--new", str(args.new),
                            "--ids", ",".join(map(str, ids))], capture_output=True, text=True, check=True)
    got = json.loads(child.stdout.strip().splitlines()[-1])
    want, tokens = seen["tokens"], got["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    info = {"source": f"{args.quantized} {args.target} {args.quantize} on {runtime}", "torch_tokens": want,
            "tokens": tokens, "agree": sum(a == b for a, b in zip(tokens, want)), "of": len(want),
            "first_difference": first, "directory": {k: got[k] for k in ("decode_ms", "wall_s", "cpu_s", "peak_rss_gb")},
            **{k: seen[k] for k in ("generate_vs_forced", "forced_argmax_same", "torch_cpu_s")},
            "min_margin": min(seen["margin"]), "max_noise": max(seen["noise"]), **figures}
    if first is not None:
        row = seen["logits"][first]
        info.update(margin_at_first=seen["margin"][first], noise_at_first=seen["noise"][first],
                    gap_to_directory_token=float(row[want[first]] - row[tokens[first]]))
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf")
    ap.add_argument("--dir")
    ap.add_argument("--runtime", default=None)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--ids", default=",".join(map(str, IDS)))
    ap.add_argument("--round-weights", choices=["fp16"], default=None)
    ap.add_argument("--save")
    ap.add_argument("--against")
    ap.add_argument("--quantized", metavar="MODEL", help="convert MODEL quantized and compare (third form)")
    ap.add_argument("--target", choices=sorted(RUNTIMES), default="tflite")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--out", help="the directory the third form writes")
    ap.add_argument("--verify", action="store_true", help="the third form's convert with --verify")
    args = ap.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    t, c = time.perf_counter(), time.process_time()
    if args.quantized:
        if not args.out:
            ap.error("--quantized needs --out DIR (the directory it writes)")
        info = quantized(args, ids)
        print(json.dumps(info))
        if args.save:
            Path(args.save).write_text(json.dumps(info))
        return 0
    if args.hf:
        tokens = hf_tokens(args.hf, ids, args.new, args.round_weights)
        info = {"source": "transformers" + (f" on {args.round_weights} weights" if args.round_weights else ""),
                "tokens": tokens}
    else:
        from circleops.generation.generator import Generator

        gen = Generator(args.dir, runtime=args.runtime)
        result = gen.generate(ids, args.new, stop_at_eos=False)
        tokens = result.tokens
        info = {"source": f"{args.dir} on {result.runtime}", "tokens": tokens,
                "decode_ms": 1000 * result.decode_seconds / max(1, result.decode_steps)}
    info.update(wall_s=time.perf_counter() - t, cpu_s=time.process_time() - c,
                peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
    if args.against:
        want = json.loads(Path(args.against).read_text())["tokens"]
        info["same_as_transformers"] = tokens == want
        info["first_difference"] = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    print(json.dumps(info))
    if args.save:
        Path(args.save).write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
