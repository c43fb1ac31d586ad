"""Benchmark (not a test): where a prompt's time goes in circleops' tflite generation graphs on
LiteRT, chunk by chunk, against litert-torch's prefill_64 (issue 26).

    python bench/litert_chunks.py DIR [--peer /path/model_quantized.tflite] [--threads 1] [--rounds 6]

DIR: `circleops convert smollm2 --graphs prefill,decode --target tflite [--quantize w8]`. In one
process, interleaved, CPU time (time.process_time) of:

* each 64-row prefill graph's bare Invoke (inputs already set: only LiteRT's work), over all C
  cache slots (``prefill``) and over its windows (``prefill_cW``), and litert-torch's
  ``prefill_64`` the same way: what a chunk costs by the cache slots its attention reads;
* the Generator's prefill of a 300-token prompt against the bare Invokes of the same chunks
  through the same graphs: the difference is circleops' side of each run (the caches copied
  into LiteRT's input buffers, the new rows written back, the input checks).

For the kernels inside a chunk, `perf record -p PID` on a process invoking one graph in a loop,
then `perf report --sort symbol`: LiteRT's library has XNNPACK's kernel names
(bench/results/18-w8-tflite.yaml).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _peer(path: str, threads: int, ids: list[int]):
    """litert-torch's prefill_64 with inputs set once: (wrapper, subgraph index)."""
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=path, num_threads=threads)
    runner = it.get_signature_runner(next(s for s in it.get_signature_list() if s.startswith("prefill")))
    feeds = {n: np.zeros(d["shape"], d["dtype"]) for n, d in runner.get_input_details().items()}
    rows = feeds["tokens"].shape[1]
    feeds["tokens"][0, :] = ids[:rows]
    feeds["input_pos"][:] = np.arange(rows)
    mask = np.full(feeds["mask"].shape, -np.inf, np.float32)
    for i in range(rows):
        mask[0, 0, i, :i + 1] = 0
    feeds["mask"] = mask
    runner(**feeds)
    return it, runner._interpreter_wrapper, runner._subgraph_index


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--peer", default=None, help="litert-torch's model_quantized.tflite (or model.tflite)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    os.environ["NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(ROOT / "bench"))
    import llm_speed

    from circleops.generation.generator import Generator

    ids = llm_speed.prompt_ids([300])["300"]
    gen = Generator(args.directory, threads=args.threads)
    gen.prefill(ids)  # every graph the prompt uses has its inputs set
    longest = max(gen.prefill_sessions)
    graphs = {f"prefill over {gen.manifest.max_cache_len} slots": gen.prefill_sessions[longest]}
    graphs.update({f"prefill over {w} slots": s for w, s in gen.window_sessions.get(longest, [])})
    for s in graphs.values():
        s.run(_zeros(s))
    invokes = {name: (s._it._interpreter, s._sub) for name, s in graphs.items()}
    keep = None
    if args.peer:
        keep, w, sub = _peer(args.peer, args.threads, ids)
        invokes["litert-torch prefill_64 (512 slots)"] = (w, sub)
    plan = []
    for n, pos in gen.plan(0, len(ids)):
        s = next((s for w, s in gen.window_sessions.get(n, ()) if pos <= w), gen.prefill_sessions[n])
        plan.append((s._it._interpreter, s._sub))
    chunk: dict[str, list[float]] = {k: [] for k in invokes}
    whole, bare = [], []
    for _ in range(args.rounds):
        for name, (w, sub) in invokes.items():
            t = time.process_time()
            w.Invoke(sub)
            chunk[name].append(time.process_time() - t)
        t = time.process_time()
        gen.prefill(ids)
        whole.append(time.process_time() - t)
        t = time.process_time()
        for w, sub in plan:
            w.Invoke(sub)
        bare.append(time.process_time() - t)
    print(f"{args.directory}, {args.threads} thread(s), CPU ms (medians of {args.rounds}), load {os.getloadavg()[0]:.1f}")
    for name, v in chunk.items():
        print(f"  64-row chunk, {name:40s} {1000 * statistics.median(v):7.1f}")
    print(f"  300-token prompt: Generator.prefill {1000 * statistics.median(whole):.1f}, the bare Invokes of its "
          f"{len(plan)} chunks {1000 * statistics.median(bare):.1f}")
    del keep
    return 0


def _zeros(session):
    """Zero inputs of a session's shapes (ids, pos 0, row 0, caches)."""
    import numpy as np

    return [np.zeros(s.shape, s.dtype) for s in session.inputs]


if __name__ == "__main__":
    sys.exit(main())
