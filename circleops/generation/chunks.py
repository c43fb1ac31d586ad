"""The chunk plan: which prefill graphs write a prompt into the cache, and where
(:func:`plan_chunks`), from what one prefill run costs on each runtime and weight format."""
from __future__ import annotations

from typing import Sequence

# What one prefill run costs beyond its rows, in rows: the chunk plan (plan_chunks)
# minimises sum(length + this) over the runs. onert on SmolLM2-135M (fp32, 2 threads, idle,
# bench/README.md "bench/ttft.py"): a run of L = 8, 16, 64 positions took about
# (L + 24) x 4.6 ms: every run reads all the weights, whatever its length.
PREFILL_RUN_OVERHEAD = 24
# The same for GGML weights on onert, whose GGML FULLY_CONNECTED costs the same per row at 8
# rows as at 64 (bench/onert_matmul.py --ggml): SmolLM2 q4_0, 1 thread, CPU of a run of L
# rows about (L + 1.5) x 8.9 ms; planned so, a 20-token prompt took 0.38x the CPU of one
# 64-row run, 100 tokens 0.80x, 300 tokens 0.90x, the same first token (bench/results/09-llm-speed.yaml).
GGML_RUN_OVERHEAD = 2
# fp32 files whose prefill graphs all run one thread (the 8-row one with FULLY_CONNECTED
# linears, the 64-row one a 1x1 CONV_2D): a 20-token prompt as three runs of 8 took 0.5-0.6x
# the CPU of one run of 64; 100 and 300 tokens tied with any plan (SmolLM2, loaded). With 2
# threads the 64-row graph gets a core more, so PREFILL_RUN_OVERHEAD stays there.
ONE_THREAD_RUN_OVERHEAD = 8



def plan_chunks(start: int, end: int, lengths: Sequence[int],
                overhead: int = PREFILL_RUN_OVERHEAD) -> list[tuple[int, int]]:
    """The prefill runs that write tokens ``start..end-1`` into the cache: (graph length,
    position) pairs, in order, computing the fewest positions when each run counts
    ``overhead`` more (a dynamic program over ``lengths``; ties go to the longer graph).

    Every run but the last covers new tokens only. The last one is aligned to end at the
    last token: it re-runs tokens already in the cache (their keys and values come out the
    same) instead of padding, so nothing is written past the last real token and a prompt
    may fill the cache exactly. Only when fewer tokens than its length exist in all does it
    start at 0, right-padded (the padding's slots are overwritten before any query sees them).
    """
    longest_first = sorted(set(lengths), reverse=True)
    left = end - start
    cost, pick = [0] * (left + 1), [0] * (left + 1)
    for x in range(1, left + 1):
        cost[x], pick[x] = min((n + overhead + cost[max(0, x - n)], -n) for n in longest_first)
        pick[x] = -pick[x]
    runs, s, x = [], start, left
    while x > pick[x]:
        runs.append((pick[x], s))
        s, x = s + pick[x], x - pick[x]
    if x:
        runs.append((pick[x], max(0, end - pick[x])))
    return runs


