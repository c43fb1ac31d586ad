"""What a decode calibration step costs an integer LLM convert (issue 32): CPU per sample.

    python bench/integer_calibration.py                 # SmolLM2-135M, cache 512 (the defaults)
    python bench/integer_calibration.py --samples 16 --cache 512 --scheme int16

The integer recipes calibrate the decode graph on CALIBRATION_DECODE_STEPS steps per window
(circleops.recipes.llm_integer): each step is one forward of the PT2E-prepared (observed)
decode graph, and one fp32 step that writes the caches the next sample reads. This measures
both on one torch thread and prints the CPU the steps beyond the former 4 per window cost at
the default 8 windows. ``--held W`` instead builds the whole calibration of the default graphs
(prefill 64 and 8, decode; cache 512) over W windows and prints the bytes its samples hold and
the process's peak RSS (bench/results/51: a clone of every cache per sample, or one set per
window). The quality and verify figures of bench/results/45 come from
``circleops convert smollm2 --graphs prefill,decode --target circle --quantize int16 ...``.
"""
from __future__ import annotations

import argparse
import time

import torch


def measure(samples: int, cache: int, scheme: str, prefill: int = 64) -> tuple[float, float]:
    """(observed decode graph, fp32 step): CPU seconds per decode calibration sample of
    SmolLM2-135M with a cache of ``cache`` slots, decoding after ``prefill`` positions."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    from circleops.pipeline import stages
    from circleops.quantize import pt2e
    from circleops.recipes.llm import decoder_step, example_args
    from circleops.sources.models import load

    model = load("smollm2").module.eval()
    step = decoder_step(model, cache, rope_tables=True)
    args = example_args(step, "decode", prefill)
    options = argparse.Namespace(functionalize=False, fuse="auto")
    with torch.no_grad():
        ep = stages.export(step, args, adapters=False, warn_list=[])
        ep, _ = stages.fuse(ep, options, model=step)
    prepared = prepare_pt2e(ep.module(), pt2e.make_quantizer(scheme))
    caches = step.empty_caches()
    ids = torch.randint(0, int(model.config.vocab_size), (1, samples), generator=torch.Generator().manual_seed(0))
    observed = fp32 = 0.0
    with torch.no_grad():
        for k in range(samples):
            token, at = ids[:, k:k + 1], torch.tensor([prefill + k])
            t = time.process_time()
            prepared(token, at, *caches)
            observed += time.process_time() - t
            t = time.process_time()
            caches = list(step(token, at, *caches)[1:])
            fp32 += time.process_time() - t
    return observed / samples, fp32 / samples


def held(windows: int, cache: int = 512) -> tuple[float, float, int]:
    """(GB the calibration's samples hold, GB of peak RSS after it, samples) of SmolLM2-135M's
    default graphs (prefill 64 and 8, decode) calibrated over ``windows`` windows."""
    import resource
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from held_memory import held_bytes  # tests/held_memory.py, shared with the calibration test

    from circleops.recipes import llm_integer
    from circleops.recipes.llm import decoder_step, io_names
    from circleops.sources.models import load_smollm2

    model, tok = load_smollm2()
    step = decoder_step(model.eval(), cache, rope_tables=True)
    named = {"prefill": ("prefill", 64), "prefill_8": ("prefill", 8), "decode": ("decode", 1)}
    ids = llm_integer.calibration_windows(model, tok, windows, min(cache, 128 + llm_integer.CALIBRATION_DECODE_STEPS))
    cal = llm_integer.calibrate(step, named, ids, io_names(step.num_layers)[0][2:], cache)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return held_bytes(cal) / 1e9, peak / 1e9, sum(len(v) for v in cal.samples.values())


def main() -> None:
    from circleops.recipes.llm_integer import CALIBRATION_DECODE_STEPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--scheme", default="int16", choices=["int16", "uint8"])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--held", type=int, default=0, metavar="W",
                        help="the memory the calibration over W windows holds instead")
    a = parser.parse_args()
    torch.set_num_threads(1)
    if a.held:
        gb, peak, n = held(a.held, a.cache)
        print(f"{a.held} windows, {n} samples: the samples hold {gb:.2f} GB; peak RSS {peak:.2f} GB")
        return
    observed, fp32 = measure(a.samples, a.cache, a.scheme)
    more = a.windows * (CALIBRATION_DECODE_STEPS - 4)
    print(f"per decode sample: observed graph {observed:.3f} s CPU, fp32 step {fp32:.3f} s CPU; "
          f"{more} more samples ({a.windows} windows x {CALIBRATION_DECODE_STEPS - 4}): "
          f"{more * (observed + fp32):.0f} s CPU")


if __name__ == "__main__":
    main()
