"""Benchmark (not a test): greedy generation tokens/s, circleops on onert vs transformers.

    python bench/generate.py                       # SmolLM2-135M, 16 / 64 / 256 new tokens
    python bench/generate.py --dir out/            # reuse graphs written by convert --graphs
    python bench/generate.py --new 16 64 --rounds 3 --threads 1

Converts SmolLM2-135M-Instruct once (--target onert, prefill --prefill-len, cache
--max-cache-len) unless --dir is given, then for each number of new tokens times, in the
same process and alternating: circleops' Generator on onert (prefill graph once, decode
graph once per token, sessions created once) and transformers' model.generate (greedy,
with its DynamicCache). Both are forced to produce exactly N tokens (EOS ignored).

Columns: total = prompt to N tokens; prefill = the prompt's pass (torch: generate with one
new token); ms/token = (total - prefill) / (N - 1), the decode cost per token, which stays
flat as N grows when generation is linear; tokens/s = N / total. The median of --rounds.

Threads: --threads (default 2) for both: torch.set_num_threads with OMP_WAIT_POLICY=PASSIVE
(spinning OpenMP workers make 2-thread torch many times slower on a loaded machine), and
onert's NUM_THREADS (read from the environment when its session is created).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = "Once upon a time,"


def _median_run(fn, rounds: int) -> tuple[float, float]:
    """(median total seconds, median prefill seconds) of fn() -> (total, prefill)."""
    runs = [fn() for _ in range(rounds)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="graphs already written by `circleops convert smollm2 --graphs ...`")
    ap.add_argument("--new", type=int, nargs="+", default=[16, 64, 256], help="new-token counts (default 16 64 256)")
    ap.add_argument("--prefill-len", type=int, default=32)
    ap.add_argument("--max-cache-len", type=int, default=320)
    ap.add_argument("--rounds", type=int, default=1, help="runs per cell; the median is reported (default 1)")
    ap.add_argument("--threads", type=int, default=2, help="threads for torch and onert (default 2)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported
    os.environ["NUM_THREADS"] = str(args.threads)  # onert's cpu backend

    import torch

    from circleops.generation.generator import Generator, encode_prompt, load_tokenizer
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest
    from circleops.sources.models import load_smollm2

    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.eval()
    work = None
    if args.dir is None:
        work = tempfile.TemporaryDirectory(prefix="circleops-bench-")
        args.dir = Path(work.name) / "smollm2"
        t = time.perf_counter()
        import copy

        convert_graphs(copy.deepcopy(model), args.dir, target="onert", prefill_len=args.prefill_len,
                       max_cache_len=args.max_cache_len, tokenizer=tokenizer, source="smollm2")
        print(f"converted SmolLM2-135M to {args.dir} in {time.perf_counter() - t:.1f} s")
    manifest = read_manifest(args.dir)
    ids = encode_prompt(load_tokenizer(manifest), PROMPT)
    need = len(ids) + max(args.new)
    if need > manifest.max_cache_len:
        raise SystemExit(f"the cache of {args.dir} has {manifest.max_cache_len} slots; {need} are needed: "
                         f"convert with --max-cache-len {need} or more")
    t = time.perf_counter()
    gen = Generator(manifest, runtime="onert")
    print(f"onert sessions created in {time.perf_counter() - t:.1f} s (once; not in the timings below)")
    prompt = torch.tensor([ids])
    mask = torch.ones_like(prompt)

    def onert_run(n: int):
        def run():
            t = time.perf_counter()
            r = gen.generate(ids, n, stop_at_eos=False)
            assert len(r.tokens) == n
            return time.perf_counter() - t, r.prefill_seconds
        return run

    def torch_generate(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 use_cache=True)
        assert out.shape[1] == len(ids) + n
        return time.perf_counter() - t

    def torch_run(n: int):
        return lambda: (torch_generate(n), torch_generate(1))

    torch_generate(2)  # warm-up (first-call overheads)
    gen.generate(ids, 2)
    rows = []
    for n in args.new:
        o_total, o_pre = _median_run(onert_run(n), args.rounds)
        t_total, t_pre = _median_run(torch_run(n), args.rounds)
        rows.append((n, o_total, o_pre, t_total, t_pre))

    def per_token(total: float, pre: float, n: int) -> float:
        return 1000 * (total - pre) / max(1, n - 1)

    print(f"\nSmolLM2-135M-Instruct fp32, greedy, prompt {len(ids)} tokens ({PROMPT!r}); onert 0.1.0 (prefill graph "
          f"{manifest.prefill_len}, cache {manifest.max_cache_len}) vs transformers generate with its cache "
          f"({args.threads} threads each); median of {args.rounds}\n")
    print("| new tokens | onert total s | onert prefill s | onert ms/token | onert tokens/s | torch total s "
          "| torch prefill s | torch ms/token | torch tokens/s | tokens/s onert/torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, o_total, o_pre, t_total, t_pre in rows:
        print(f"| {n} | {o_total:.2f} | {o_pre:.3f} | {per_token(o_total, o_pre, n):.1f} | {n / o_total:.1f} "
              f"| {t_total:.2f} | {t_pre:.3f} | {per_token(t_total, t_pre, n):.1f} | {n / t_total:.1f} "
              f"| {(n / o_total) / (n / t_total):.2f} |")
    first, last = rows[0], rows[-1]
    ratio_o = per_token(last[1], last[2], last[0]) / per_token(first[1], first[2], first[0])
    ratio_t = per_token(last[3], last[4], last[0]) / per_token(first[3], first[4], first[0])
    print(f"\nms/token at {last[0]} new tokens / at {first[0]}: onert {ratio_o:.2f}, torch {ratio_t:.2f} "
          f"(1.0 = perfectly linear total cost)")
    if work is not None:
        work.cleanup()


if __name__ == "__main__":
    main()
