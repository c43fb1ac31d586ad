"""Logits past a sliding window: a converted directory against transformers (issue 32).

    python bench/window_logits.py --hf /work/models/gemma-3-1b-shape --len 600 --steps 8 --save /tmp/w.npz
    python bench/window_logits.py --dir /tmp/g1b/fp32 --runtime litert --against /tmp/w.npz

A prompt of --len seeded random ids, then --steps more: the first form runs transformers
(fp32, eager attention, no cache, one forward) and saves the logits of the prompt's last
token and of each later one; it also saves them with the window taken out
(``config.sliding_window`` past the sequence: every layer attends to the whole prefix), the
scale a wrong window would move them by. The second form feeds the same ids through
circleops' Generator on the directory (``prefill`` of the prompt, then teacher-forced
``decode`` steps) and prints the largest absolute logit error per step against both. With a
prompt longer than the window, the local layers' masks drop the oldest slots at every step
checked: the greedy tokens of a short prompt never reach that. Separate processes: each holds
one copy of a 1B model's weights.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scale_tokens import peak_rss_gb


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).integers(3, min(vocab, 200000), size=n)]


def hf_logits(path: str, length: int, steps: int, save: str) -> dict:
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    window = getattr(model.config, "sliding_window", None)
    ids = prompt_ids(model.config.vocab_size, length + steps)
    keep = steps + 1  # the prompt's last token and each of the steps
    out = {"ids": np.array(ids), "length": length, "window": window or 0}
    with torch.no_grad():
        x = torch.tensor([ids])
        out["logits"] = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits[0].float().numpy()
        if window:
            model.config.sliding_window = len(ids) + 1  # every mask the whole causal prefix
            out["no_window"] = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits[0].float().numpy()
    np.savez(save, **out)
    return {"window": window, "positions": [length - 1, length + steps - 1],
            "no_window_moves": float(np.abs(out["logits"] - out["no_window"]).max()) if window else None}


def dir_logits(directory: str, runtime: str | None, against: str) -> dict:
    import numpy as np

    from circleops.generation.generator import Generator

    ref = np.load(against)
    ids, length = [int(i) for i in ref["ids"]], int(ref["length"])
    gen = Generator(directory, runtime=runtime)
    t = time.perf_counter()
    rows = [np.array(gen.prefill(ids[:length]), dtype=np.float32)]
    for token in ids[length:]:
        rows.append(np.array(gen.decode(token), dtype=np.float32))
    got = np.stack(rows)
    err = np.abs(got - ref["logits"]).max(axis=-1)
    info = {"directory": directory, "positions": [length - 1, len(ids) - 1], "window": int(ref["window"]),
            "max_abs_error_per_step": [float(e) for e in err], "max_abs_error": float(err.max()),
            "max_abs_logit": float(np.abs(ref["logits"]).max()),
            "argmax_agree": int((got.argmax(-1) == ref["logits"].argmax(-1)).sum()), "of": len(rows),
            "wall_s": time.perf_counter() - t}
    if "no_window" in ref:
        info["against_no_window"] = float(np.abs(got - ref["no_window"]).max())
        info["no_window_moves"] = float(np.abs(ref["logits"] - ref["no_window"]).max())
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf")
    ap.add_argument("--len", type=int, default=600)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save")
    ap.add_argument("--dir")
    ap.add_argument("--runtime", default=None)
    ap.add_argument("--against")
    args = ap.parse_args()
    if args.hf:
        if not args.save:
            ap.error("--hf needs --save FILE.npz")
        info = hf_logits(args.hf, args.len, args.steps, args.save)
    elif args.dir and args.against:
        info = dir_logits(args.dir, args.runtime, args.against)
    else:
        ap.error("give --hf MODEL --save F, or --dir DIR --against F")
    info["peak_rss_gb"] = peak_rss_gb()
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
