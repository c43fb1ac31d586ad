"""4-bit weight rounding for the NPU recipe, in torch: which rounding loses least.

    python bench/npu_weights.py --methods rtn,gptq,gptq-mse [--groups 32] [--calib 8x32] [--norot]

SmolLM2-135M, fp32 activations: only the decoder linears' weights are rounded to the per-group
int4 grid of circleops.quantize.grouped (s_r · m · q, m uint8), the lm_head left as it is;
the rotated model (circleops.quantize.rotate) unless --norot. Scored on the hold-out windows
of bench/npu_holdout.py (perplexity.txt, never calibrated on): logits SQNR and top-1
agreement against the unrounded fp32 model, per window and over all. This isolates the
weights' share of a file's error (the file adds int16 activations, bench/npu_holdout.py).

Methods: rtn (min-max group scales), rtn-mse (each group's scale by a clipping search),
gptq (circleops.quantize.gptq.gptq_grouped, GPTQ's group rule), gptq-act (act order, static
groups), gptq-mse (the group rule with a clipping search of each group's scale), "+seq"
(sequential: each layer's Hessians from the inputs the already rounded layers give).
--calib NxL[+G]: N windows of L tokens of the calibration text for the Hessians (and G
sequences of L tokens sampled from the fp32 model).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WINDOWS = 24


def holdout_batch(tok, tokens: int = 32, windows: int = WINDOWS) -> torch.Tensor:
    """The first ``windows`` windows of ``tokens`` tokens of the hold-out text (perplexity.txt),
    the first being bench/npu_holdout.py's."""
    from circleops.tools.quant_report import PERPLEXITY_TEXT

    ids = tok(PERPLEXITY_TEXT.read_text())["input_ids"]
    return torch.tensor([ids[o:o + tokens] for o in range(0, len(ids) - tokens + 1, tokens)][:windows])


def smollm2_reference() -> tuple:
    """(SmolLM2 in eval mode, its tokenizer, the hold-out batch, fp32's logits on it)."""
    from circleops.sources import models

    model, tok = models.load_smollm2()
    model.eval()
    batch = holdout_batch(tok)
    with torch.no_grad():
        ref = logits(model, batch)
    return model, tok, batch, ref


def logits(model, batch: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(batch[k:k + 8]).logits for k in range(0, batch.shape[0], 8)])


def score(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """The first window's SQNR and agreement (bench/npu_holdout.py's text), and over all
    windows: SQNR, agreement, mean KL(fp32 || rounded) per token."""
    import math

    def db(r, g):
        return 10 * math.log10(float(r.double().pow(2).sum()) / float((r.double() - g).pow(2).sum()))

    agree = (ref.argmax(-1) == got.argmax(-1))
    kl = 0.0
    for r, g in zip(ref, got):
        lp, lq = r.double().log_softmax(-1), g.double().log_softmax(-1)
        kl += float((lp.exp() * (lp - lq)).sum(-1).sum())
    kl /= ref.shape[0] * ref.shape[1]
    return {"db0": db(ref[0], got[0]), "agree0": int(agree[0].sum()), "db": db(ref, got),
            "agree": float(agree.double().mean()), "kl": kl}


def calib_samples(tok, n: int, length: int, model=None, generated: int = 0) -> list[tuple]:
    """``n`` windows of ``length`` tokens of the calibration text, and ``generated`` sequences
    of ``length`` tokens the fp32 model samples (seeded; each begins with a window's first token)."""
    from circleops.quantize import pt2e

    samples = pt2e.calibration_samples((torch.zeros(1, length, dtype=torch.long),), n, tokenizer=tok)
    if generated:
        torch.manual_seed(0)
        starts = torch.cat([samples[k % n][0][:, :1] for k in range(generated)])
        with torch.no_grad():
            out = model.generate(starts, attention_mask=torch.ones_like(starts), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                                 pad_token_id=0)
        samples += [(row[None, :length],) for row in out]
    return samples


def int16_logits(model, batch: torch.Tensor, samples: list[tuple], head_int8: bool = True) -> torch.Tensor:
    """The logits of the int16 fake-quantized module (PT2E with CircleQuantizer, as
    circleops.convert --quantize int16 builds it, calibrated on ``samples``) on each window:
    the model's linear weights as they are (rounded before: the "int4-grouped" scheme leaves
    them unobserved), the lm_head int8 per channel."""
    import dataclasses

    from circleops.pipeline import stages as pipeline
    from circleops.quantize.recipe import IntegerRecipe

    module = pipeline.CausalLMLogits(model).eval()
    example = (batch[:1],)
    opts = pipeline.Options("circle", torch.float32, "auto", "int16", functionalize=False)
    with pipeline.hf_export_settings(model), torch.no_grad():
        ep = pipeline.export(module, example, adapters=True, warn_list=[])
        ep, _ = pipeline.fuse(ep, opts, module)
        head = tuple(n for n, m in module.named_modules() if m is model.get_output_embeddings())
        recipe = IntegerRecipe("int16", weight_bits=4, group_size=32) if head_int8 else None
        converted, _ = pipeline.quantize_program(ep, module, dataclasses.replace(opts, fuse="none"), pipeline.Calibration(
            example, len(samples), recipe=recipe, head=head, vocab_size=model.config.vocab_size,
            data=_samples_file(samples)))
        return torch.cat([converted(batch[k:k + 1]) for k in range(batch.shape[0])])


def _samples_file(samples: list[tuple]) -> str:
    import tempfile

    path = tempfile.mkstemp(suffix=".pt")[1]
    torch.save([s[0] for s in samples], path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="rtn,gptq")
    p.add_argument("--groups", default="32")
    p.add_argument("--calib", default="8x32")
    p.add_argument("--norot", action="store_true")
    p.add_argument("--cap", type=float, default=0.0, help="Hessians: each token's squared norm capped at CAP x the "
                   "median token's (0: as is)")
    p.add_argument("--int8", default="", help="BUDGET[:gain|rtn],...: keep int8 the linears measured to gain most, "
                   "within BUDGET (a fraction) of the decoder linears' weights (each spec scored in turn)")
    p.add_argument("--int16", action="store_true", help="score the int16 fake-quantized module (PT2E), not fp32 "
                   "activations; calibrated on 8 windows of 32 tokens as convert does")
    args = p.parse_args()

    import contextlib

    from circleops.quantize.ggml import one_thread
    from circleops.quantize.rotate import rotated

    import npu_rounding as rounding

    model, tok, batch, ref = smollm2_reference()
    rounding.CAP[0] = args.cap
    n, length, *gen = (int(x) for x in args.calib.replace("+", "x").split("x"))
    samples = calib_samples(tok, n, length, model, gen[0] if gen else 0)
    pt2e_samples = calib_samples(tok, 8, 32)
    sens_samples = calib_samples(tok, 4, 64)
    with torch.no_grad():
        rounding.REF[:] = [model(*a).logits.double() for a in sens_samples]
    print(f"hold-out: {batch.shape[0]} windows of 32 tokens of perplexity.txt; calibration {n} windows of {length}; "
          f"rotated {not args.norot}; load {os.getloadavg()[0]:.1f}")
    print("| method | group | first window SQNR | first window agreement | all SQNR | all agreement | KL | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    with contextlib.ExitStack() as stack, one_thread(), torch.no_grad():
        if not args.norot:
            stack.enter_context(rotated(model, tok))
        for group in (int(g) for g in args.groups.split(",")):
            for method in args.methods.split(","):
                t = time.process_time()
                with rounding.rounded(model, samples, method, group):
                    for spec in args.int8.split(",") if args.int8 else [""]:
                        with contextlib.ExitStack() as i8:
                            label = method
                            if spec:
                                budget, how = (spec.split(":") + ["gain"])[:2]
                                chosen = i8.enter_context(rounding.with_int8(model, sens_samples, float(budget), how))
                                label += f" + int8 {how} {budget}"
                                print(f"    int8 ({how}, {budget}): {len(chosen)} linears: {', '.join(chosen)}",
                                      flush=True)
                            got = int16_logits(model, batch, pt2e_samples) if args.int16 else logits(model, batch)
                        r = score(ref, got)
                        print(f"| {label} | {group} | {r['db0']:.1f} dB | {r['agree0']}/32 | {r['db']:.2f} dB | "
                              f"{r['agree']:.1%} | {r['kl']:.4f} | {time.process_time() - t:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
