"""Greedy tokens of a converted directory against transformers' own greedy generate (issue 32).

    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --new 16 --save /tmp/1b-hf.json
    python bench/scale_tokens.py --dir /out/1b-tflite --runtime litert --new 16 --against /tmp/1b-hf.json
    python bench/scale_tokens.py --hf /work/models/llama-3.2-1b-shape --round-weights fp16 --save /tmp/1b-hf16.json

The first form runs transformers (fp32, `generate(do_sample=False)`) on the prompt ids and
saves its new tokens (``--round-weights fp16``: on the weights an fp16 file holds, each
rounded to fp16 and computed in fp32: torch running the file's own weights); the second runs circleops' Generator on a converted directory with the
same ids and prints whether its tokens are the same, with decode ms/token, CPU seconds and
peak RSS. Separate processes: each holds one copy of a 1B model's weights.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

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
    args = ap.parse_args()
    ids = [int(i) for i in args.ids.split(",")]
    t, c = time.perf_counter(), time.process_time()
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
