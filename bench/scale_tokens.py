"""Greedy tokens of a converted directory against transformers' own greedy generate (issue 32).

    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --new 16 --save /tmp/1b-hf.json
    python bench/scale_tokens.py --dir /out/1b-tflite --runtime litert --new 16 --against /tmp/1b-hf.json
    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --round-weights fp16 --save /tmp/1b-hf16.json
    python bench/scale_tokens.py --quantized /work/models/qwen2.5-1.5b-shape --target tflite --quantize int4 \
        --out /tmp/1.5b-int4 --save /tmp/1.5b-int4.json
    python bench/scale_tokens.py --quantized /work/models/llama-3.2-1b-shape --target circle --quantize int16 \
        --weight-bits 4 --seq-len 8 --max-cache-len 64 --calibrate 2 --verify --new 8 --out /tmp/1b-16a4w

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

An integer format (``--quantize int16 | uint8``, target circle; ``--verify``) compares the
directory on the reference interpreter with torch running the same quantized computation:
the converted (fake-quantized) graphs verify compares the files with, in the same generation
loop (circleops.recipes.llm_integer.torch_generator), taken when the files are written and
before the convert's verify restores the model's weights (those graphs compute with the
rounded weights they share with it). Each step's noise there: how far the logits move when
every activation rounds stochastically (the noise floor verify admits). The convert's
figures leave the compare out (its CPU and wall; the peak before and after it is reported).
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


def peak_rss_gb() -> float:
    """This process's peak RSS: VmHWM (its own memory since exec; ru_maxrss keeps the larger
    parent's peak across fork and exec, so a child of the third form would report the parent's)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6  # kB, as ru_maxrss and /usr/bin/time count
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


@contextlib.contextmanager
def decoded_once() -> Iterator[None]:
    """dequantized_sources decodes each weight every forward (no second copy of the model's
    weights: issue 32), 20 forwards here; inside, a decoded weight whose values fp16 holds
    exactly (int4: a bf16 scale times an integer of 4 bits fits fp16's 11 bits) is kept as
    fp16 and widened per use: the same values bit for bit, half the bytes, no repeated unpack
    (135M int4, loaded: a 24-token forward in 2.3 s of CPU against 4.0-6.7 s decoding each
    time). Others (w8's fp32 scales) decode as before."""
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
    """The model's own HF forwards while inside, the fused ones back after (the package step
    fused it in place for export: circle ops' reference kernels, the same numerics). The HF
    forward is what verify's references run and what ``generate``'s KV cache is written for;
    it is also cheaper (a 24-token forward at 135M, loaded: 1.6-3.5 s of CPU against 3.0-3.7 fused)."""
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


def forced(model, quant, runtime: str, ids: list[int], tokens: list[int]) -> tuple:
    """torch's logits at each new token's step, teacher-forced on ``tokens`` in one forward,
    on the file's weights with the runtime's rounding, then with every rounded input nudged
    (perturb=0); (the logits [new, V], each step's noise: the largest logit the nudge moved)."""
    import torch

    from circleops.quantize.weights import dequantized_sources

    seq = torch.tensor([ids + tokens[:-1]])
    with dequantized_sources(quant, model, runtime):
        logits = model(input_ids=seq, use_cache=False).logits[0, len(ids) - 1:].float()
    with dequantized_sources(quant, model, runtime, perturb=0):
        nudged = model(input_ids=seq, use_cache=False).logits[0, len(ids) - 1:].float()
    return logits, [float(n) for n in (nudged - logits).abs().max(dim=-1).values]


def torch_greedy(model, quant, runtime: str, ids: list[int], new: int) -> dict:
    """transformers' greedy tokens on the file's own weights and the runtime's input rounding;
    per step: the top-2 margin of the logits it picked from, the logits and the noise."""
    import torch

    from circleops.quantize.weights import dequantized_sources

    with dequantized_sources(quant, model, runtime):
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = [int(t) for t in out.sequences[0, len(ids):]]
    generated = torch.stack(out.logits)[:, 0].float()  # the logits each greedy token was picked from
    logits, noise = forced(model, quant, runtime, ids, tokens)
    top = torch.topk(generated, 2, dim=-1)
    return {"tokens": tokens,
            # the same steps in one forward of another length: another summation order, moved as the nudge moves it
            "generate_vs_forced": float((generated - logits).abs().max()),
            "margin": [float(m) for m in top.values[:, 0] - top.values[:, 1]], "noise": noise,
            "logits": generated.numpy()}


def directory_tokens(out: Path, runtime: str, ids: list[int], new: int) -> dict:
    """The second form on ``out`` in a child (its own LiteRT / onert copy of the weights)."""
    import subprocess

    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = subprocess.run([sys.executable, __file__, "--dir", str(out), "--runtime", runtime, "--new", str(new),
                            "--ids", ",".join(map(str, ids))], capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit(f"scale_tokens: generate on {out} failed:\n{child.stderr[-3000:]}")
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = json.loads(child.stdout.strip().splitlines()[-1])
    got["child_cpu_s"] = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    return got


def compare(model, quant, runtime: str, ids: list[int], new: int, out: Path) -> dict:
    """Once the package step wrote ``out`` (its staging directory, the model still holding the
    weights the files were written from): torch's greedy tokens, the directory's, and torch
    teacher-forced on the directory's tokens: at each step the gap between torch's best logit
    and the directory's token (0 where it is torch's argmax) beside that step's noise."""
    import torch

    c = time.process_time()
    model.eval()
    with torch.no_grad(), decoded_once(), unfused(model):
        mine = torch_greedy(model, quant, runtime, ids, new)
        torch_cpu = time.process_time() - c
        got = directory_tokens(out, runtime, ids, new)
        c = time.process_time()
        logits, noise = forced(model, quant, runtime, ids, got["tokens"])
        torch_cpu += time.process_time() - c
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, got["tokens"])]
    want, tokens = mine["tokens"], got["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    info = {"torch_tokens": want, "tokens": tokens, "agree": sum(a == b for a, b in zip(tokens, want)),
            "of": len(want), "first_difference": first, "generate_vs_forced": mine["generate_vs_forced"],
            "torch_min_margin": min(mine["margin"]), "torch_noise": mine["noise"],
            "directory_gaps": gaps, "directory_noise": noise, "directory_argmax_steps": sum(g == 0 for g in gaps),
            "directory_gap_over_noise": max(g / n for g, n in zip(gaps, noise)),
            "directory": {k: got[k] for k in ("decode_ms", "wall_s", "cpu_s", "child_cpu_s", "peak_rss_gb")},
            "torch_cpu_s": torch_cpu}
    if first is not None:
        row = mine["logits"][first]
        info.update(margin_at_first=mine["margin"][first], noise_at_first=mine["noise"][first],
                    gap_to_directory_token=float(row[want[first]] - row[tokens[first]]))
    return info


def integer_compare(converted: dict, ids: list[int], new: int, out: Path) -> dict:
    """An integer (PT2E) directory against torch running the same quantized computation: the
    converted (fake-quantized) graphs the files were verified against, run by the same
    generation loop (circleops.recipes.llm_integer.torch_generator); the directory's tokens on
    the reference interpreter (a child); torch teacher-forced on them, and again with every
    activation rounded stochastically (the noise floor verify admits: how far the last-step
    rounding integer kernels and float fake-quant differ by moves each step's logits)."""
    import numpy as np

    from circleops.quantize.blocked_dequantize import float32_dequantize
    from circleops.recipes.llm_integer import stochastic_rounding, torch_generator

    def run(forced: list[int] | None) -> tuple[list[int], list]:
        gen, seen = torch_generator(out, converted), []

        def sampler(scores, history):
            seen.append(np.asarray(scores, dtype=np.float64).copy())
            return int(np.argmax(scores)) if forced is None else int(forced[len(seen) - 1])

        # each weight dequantized in float32 by blocks, as verify's torch runs do (the same floats): through
        # PT2E's int64 (q - zero_point) every step made 2.1 GB of int64 beside each 1.05 GB table of the 1B
        # shape, and this compare's torch side peaked at 16.4 GB, 5.7 GB over the convert's own peak
        with float32_dequantize(converted.values()):
            result = gen.generate(ids, new, stop_at_eos=False, sampler=sampler)
        return list(result.tokens), seen

    c = time.process_time()
    want, generated = run(None)
    torch_cpu = time.process_time() - c
    got = directory_tokens(out, "reference", ids, new)
    c = time.process_time()
    tokens = got["tokens"]
    _, logits = run(tokens)
    with stochastic_rounding(converted):
        _, nudged = run(tokens)
    torch_cpu += time.process_time() - c
    noise = [float(np.abs(a - b).max()) for a, b in zip(nudged, logits)]
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, tokens)]
    margins = [float(np.sort(row)[-1] - np.sort(row)[-2]) for row in generated]
    first = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    info = {"torch_tokens": want, "tokens": tokens, "agree": sum(a == b for a, b in zip(tokens, want)),
            "of": len(want), "first_difference": first, "torch_min_margin": min(margins), "torch_margins": margins,
            "directory_gaps": gaps, "directory_noise": noise, "directory_argmax_steps": sum(g == 0 for g in gaps),
            "directory_gap_over_noise": max(g / n if n > 0 else (0.0 if g == 0 else float("inf"))
                                            for g, n in zip(gaps, noise)),
            "directory": {k: got[k] for k in ("decode_ms", "wall_s", "cpu_s", "child_cpu_s", "peak_rss_gb")},
            "torch_cpu_s": torch_cpu}
    if first is not None:
        row = generated[first]
        info.update(margin_at_first=margins[first], gap_to_directory_token=float(row[want[first]] - row[tokens[first]]))
    return info


@contextlib.contextmanager
def stage_memory(every: float = 0.5) -> Iterator["StageMemory"]:
    """Per stage of the convert (its progress lines), the largest resident memory of this process
    and of its children (the compare's generate child, the verify runtime's) at one sample:
    bench/convert_memory.py's sampler on this process, every ``every`` seconds."""
    import os
    import threading

    from convert_memory import Sampler  # bench/, beside this script

    memory = StageMemory(Sampler(os.getpid()))
    done = threading.Event()

    def loop() -> None:
        while not done.is_set():
            memory.sampler.sample()
            done.wait(every)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield memory
    finally:
        done.set()
        thread.join()


class StageMemory:
    """The progress callback that names the stage, and the per-stage table (GB)."""

    def __init__(self, sampler):
        self.sampler = sampler

    def enter(self, stage: str) -> None:
        print(f"{time.strftime('%H:%M:%S', time.gmtime())} circleops: {stage}", file=sys.stderr, flush=True)
        self.sampler.enter(stage[:70])

    def table(self) -> list[dict]:
        """[{stage, rss (this process), anon, child (largest child), sum (at once)}], in order."""
        rows = []
        for stage in self.sampler.order:
            p = self.sampler.peaks[stage]
            if p:
                rows.append({"stage": stage, **{k: round(p.get(k, 0) / 1e9, 2)
                                                for k in ("rss", "anon", "child", "sum")}})
        return rows


INTEGER = ("uint8", "int16")  # PT2E integer graphs: target circle, the reference interpreter


def quantized(args: argparse.Namespace, ids: list[int]) -> dict:
    """The third form (module docstring): ``circleops convert SRC --graphs prefill,decode
    --target T --quantize Q -o OUT`` in this process, :func:`compare` run where the package
    step has written the directory and still holds the weights it wrote it from."""
    from circleops.options import ConvertOptions, int16_parts
    from circleops.package import step
    from circleops.recipes.llm import LLMRecipe

    vocab = json.loads((Path(args.quantized) / "config.json").read_text())["vocab_size"]
    if max(ids) >= vocab:
        sys.exit(f"scale_tokens: id {max(ids)} is past {args.quantized}'s vocabulary ({vocab}); pass --ids below it")
    integer = args.quantize in INTEGER
    if integer and not args.verify:
        sys.exit("scale_tokens: an integer directory's compare runs inside its convert's verify: pass --verify")
    runtime = "reference" if integer else RUNTIMES[args.target]
    seen, package, check, at = {}, step._package, step._compare, {}

    def hooked(recipe, pkg, weights, references):
        report = package(recipe, pkg, weights, references)  # the manifest is written: the directory runs
        seen.update(compare(recipe.weights_module(), report.quantization, runtime, ids, args.new, pkg.staging))
        return report

    def checked(recipe, manifest, references, report, pkg):
        # an integer directory: its files are written, and torch's quantized graphs (report.converted) still
        # compute with the rounded weights they share with the model, until this step restores them before its
        # verify: torch's tokens and the directory's are taken here, first (the manifest written early)
        manifest.write()
        progress = pkg.tracker.progress
        if progress is not None:
            progress("compare with torch (its quantized graphs; the directory in a child)")
        r, c = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        at.update(peak_before=peak_rss_gb())
        seen.update(integer_compare(report.converted, ids, args.new, pkg.staging))
        u = resource.getrusage(resource.RUSAGE_SELF)
        at.update(peak_after=peak_rss_gb(), wall=time.perf_counter() - c,
                  cpu=u.ru_utime + u.ru_stime - r.ru_utime - r.ru_stime)
        return check(recipe, manifest, references, report, pkg)

    if integer:
        step._compare = checked
    else:
        step._package = hooked
    r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    lengths = None if args.seq_len is None else tuple(int(n) for n in str(args.seq_len).split(","))
    int16 = None if args.int16 is None else int16_parts(args.int16)
    extra = {k: v for k, v in (("weight_bits", args.weight_bits),
                               ("seq_len", lengths[0] if lengths and len(lengths) == 1 else lengths),
                               ("max_cache_len", args.max_cache_len), ("calibrate", args.calibrate),
                               ("gptq", args.gptq), ("int8_weights", args.int8_weights), ("int16", int16),
                               ("rotate", args.rotate)) if v is not None}
    options = ConvertOptions(target=args.target, quantize=args.quantize, graphs="prefill,decode", verify=args.verify,
                             **extra)
    with stage_memory() as memory:
        report = step.run(LLMRecipe.from_source(args.quantized, options), args.out, progress=memory.enter)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    step._package, step._compare = package, check
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime  # self only: the verify child's is apart
    if integer:  # the convert (load, export, calibration, write, verify) without the compare inside it
        convert = {"convert_wall_s": time.perf_counter() - t - at["wall"], "convert_cpu_s": cpu - at["cpu"],
                   "convert_peak_rss_gb": r1.ru_maxrss / 1e6, "peak_rss_gb_before_compare": at["peak_before"],
                   "peak_rss_gb_after_compare": at["peak_after"]}
    else:
        convert = {"convert_wall_s": time.perf_counter() - t - seen["directory"]["wall_s"],
                   "convert_cpu_s": cpu - seen["torch_cpu_s"], "convert_peak_rss_gb": r1.ru_maxrss / 1e6}
    quality = getattr(report, "quality", None)
    return {"source": f"{args.quantized} {args.target} {args.quantize} on {runtime}", **seen, **convert,
            "quality_vs_fp32": None if quality is None else quality.to_dict(),
            "noise_floor": report.noise_floor, "tolerance": report.tolerance,
            "verify_errors": {g: i.max_abs_error for g, i in report.graphs.items() if i.max_abs_error is not None},
            "files": {i.file: i.file_size for i in report.graphs.values()}, "summary": report.summary(),
            "stages_rss_gb": memory.table()}


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
    ap.add_argument("--target", choices=sorted(RUNTIMES) + ["circle"], default="tflite")
    ap.add_argument("--quantize", default="int4")
    ap.add_argument("--out", help="the directory the third form writes")
    ap.add_argument("--verify", action="store_true", help="the third form's convert with --verify")
    ap.add_argument("--weight-bits", type=int, default=None, help="the third form's convert --weight-bits")
    ap.add_argument("--seq-len", default=None, help="the third form's convert --seq-len (prefill lengths)")
    ap.add_argument("--max-cache-len", type=int, default=None, help="the third form's convert --max-cache-len")
    ap.add_argument("--calibrate", type=int, default=None, help="the third form's convert --calibrate")
    # the integer recipe's own options, as circleops convert spells them (left out: the recipe's defaults)
    ap.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                    help="the third form's convert --gptq / --no-gptq")
    ap.add_argument("--int8-weights", choices=["auto", "none"], default=None,
                    help="the third form's convert --int8-weights")
    ap.add_argument("--int16", default=None, metavar="PARTS", help="the third form's convert --int16 (uint8)")
    ap.add_argument("--rotate", default=None, help="the third form's convert --rotate")
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
    info.update(wall_s=time.perf_counter() - t, cpu_s=time.process_time() - c, peak_rss_gb=peak_rss_gb())
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
