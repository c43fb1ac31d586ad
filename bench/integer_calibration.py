"""What a decode calibration step costs an integer LLM convert (issue 32): CPU per sample.

    python bench/integer_calibration.py                 # SmolLM2-135M, cache 512 (the defaults)
    python bench/integer_calibration.py --samples 16 --cache 512 --scheme int16

The integer recipes calibrate the decode graph on CALIBRATION_DECODE_STEPS steps per window
(circleops.recipes.llm_integer): each step is one forward of the PT2E-prepared (observed)
decode graph, and one fp32 step that writes the caches the next sample reads. This measures
both on one torch thread and prints the CPU the steps beyond the former 4 per window cost at
the default 8 windows. The quality and verify figures of bench/results/45 come from
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


def main() -> None:
    from circleops.recipes.llm_integer import CALIBRATION_DECODE_STEPS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--cache", type=int, default=512)
    parser.add_argument("--scheme", default="int16", choices=["int16", "uint8"])
    parser.add_argument("--windows", type=int, default=8)
    a = parser.parse_args()
    torch.set_num_threads(1)
    observed, fp32 = measure(a.samples, a.cache, a.scheme)
    more = a.windows * (CALIBRATION_DECODE_STEPS - 4)
    print(f"per decode sample: observed graph {observed:.3f} s CPU, fp32 step {fp32:.3f} s CPU; "
          f"{more} more samples ({a.windows} windows x {CALIBRATION_DECODE_STEPS - 4}): "
          f"{more * (observed + fp32):.0f} s CPU")


if __name__ == "__main__":
    main()
