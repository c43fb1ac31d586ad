"""Benchmark (not a test): how long `circleops convert` takes to refuse what a 1B model's sizes
decide, and what a split Gemma 3's tied table costs (issue 32).

    python bench/size_refusals.py [--rounds 3] [--before /work/main]

Refusals: the CLI run as a user runs it (a fresh process each time) on a Llama-3.2-1B-shaped
directory whose model.safetensors is its header and a hole (a sparse file: sizes only),
for each refusal tests/cli/test_size_refusals.py checks: one onert file past 2 GiB, a cache
longer than the model's positions, a layer too large for --max-file-bytes, integer graphs past
it. Wall and CPU (user + sys of the child, os.wait4) and peak RSS, medians over --rounds;
``--before TREE`` runs the same commands with PYTHONPATH=TREE too, interleaved (another
checkout of circleops: the figures before a change). The load average is printed: compare CPU.

Gemma 3: the bytes of the weights of a Gemma-3-1B-shaped model (its config's sizes, built on
the meta device: no memory) split for onert's 2 GiB in fp32, the tied [262144, 1152] table
in the first file and as the last file's lm_head (before) or once (after: the first part takes
the rows and scales them, circleops.adapters.decode.scale_rows).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from header_only import header_only_dir  # noqa: E402 - tests/header_only.py, shared with the refusal tests

LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5)
GEMMA3_1B = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=1152,
                 intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, max_position_embeddings=32768, sliding_window=512, tie_word_embeddings=True)
CASES = {
    "onert file > 2 GiB": ["--target", "onert"],
    "cache > max positions": ["--graphs", "prefill,decode", "--max-cache-len", "200000"],
    "layer > --max-file-bytes": ["--graphs", "prefill,decode", "--target", "onert", "--max-file-bytes", "100000000"],
    "integer graphs > limit": ["--graphs", "prefill,decode", "--target", "circle", "--quantize", "uint8",
                               "--max-file-bytes", str(3 * 10**9)],
}


def run(tree: Path, model: Path, argv: list[str], out: Path) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS GB, the last stderr line) of one CLI run with PYTHONPATH=tree."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "circleops.cli", "convert", str(model), "-o", str(out), *argv],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    last = err.strip().splitlines()[-1] if err.strip() else f"exit {status}"
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1e6, last


def gemma3_split_bytes() -> dict:
    """The split plan's bytes of the Gemma-3-1B shape in fp32 for onert, table twice and once."""
    import dataclasses

    import torch
    import transformers

    from circleops.package import split
    from circleops.targets import FLATBUFFER_LIMIT

    config = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(config)
    once = split.part_bytes(model)
    twice = dataclasses.replace(once, host_table=False)
    out = {}
    for name, sizes in (("table twice (before)", twice), ("table once (after)", once)):
        parts = split.plan_parts(sizes, FLATBUFFER_LIMIT)
        total = (0 if sizes.host_table else sizes.embedding) + sum(sizes.layers) + sizes.head
        out[name] = {"parts": parts, "weight bytes": total}
    out["table bytes"] = once.embedding
    out["model weight bytes"] = sum(once.layers) + once.head  # the tied head holds the table
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", type=Path, help="another circleops checkout, run interleaved")
    args = ap.parse_args(argv)
    trees = {"after": ROOT, **({"before": args.before} if args.before else {})}
    with tempfile.TemporaryDirectory() as tmp:
        model = header_only_dir(Path(tmp) / "llama-1b", LLAMA_1B)
        print(f"load average at the start: {os.getloadavg()}")
        times: dict = {}
        for r in range(args.rounds):
            for case, extra in CASES.items():
                for name, tree in trees.items():
                    out = Path(tmp) / f"out-{r}" / ("m.circle" if "--graphs" not in extra else "dir")
                    out.parent.mkdir(exist_ok=True)
                    wall, cpu, rss, last = run(tree, model, extra, out)
                    times.setdefault((case, name), []).append((wall, cpu, rss))
                    if r == 0:
                        print(f"{case} [{name}]: {last[:160]}")
        print(f"load average at the end: {os.getloadavg()}")
        for (case, name), runs in times.items():
            wall, cpu, rss = (statistics.median(x[i] for x in runs) for i in range(3))
            print(f"{case:28s} {name:7s} wall {wall:6.2f} s  CPU {cpu:6.2f} s  peak RSS {rss:.3f} GB")
    print(json.dumps(gemma3_split_bytes(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
