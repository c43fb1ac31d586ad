"""Every format's file against fp32 torch, end to end (issue 25).

verify compares a quantized file with torch running the same quantized weights (the
fake-quantized module, the dequantized GGML/int8 weights), so a lost bit, a wrong observer or
a wrong scale, which both sides share, passes verify. Here the file's logits are compared with
the fp32 model's on an input that neither calibration nor verify saw, as a signal-to-noise
ratio, SQNR = 10 log10(sum logits^2 / sum error^2), on the sharp tiny Llama of
tests/families.py (whose logits move by 5-9 when RoPE, the attention scale, an epsilon or the
causal mask is wrong).

SQNR_FLOOR is today's measurement less 0.5 dB (the error's RMS may grow by 6% at most):
measured (reference interpreter, the file as written): fp16 50.9 dB, uint8 23.0, int16 30.6,
q4_0 10.3, q8_0 33.8, w8 33.2. One bit fewer in the int8 weights (CircleQuantizer's range
[-63, 63]) gives uint8 21.6 and int16 25.5; the interpreter's ATTENTION without RoPE puts every
format below 5 dB. A better quantizer raises the SQNR and still passes: raise the floor then.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import circleops
from circleops.pipeline.convert import format_tolerance
from families import BY_NAME, example_ids

SQNR_FLOOR = {"fp16": 50.4, "uint8": 22.5, "int16": 30.0, "q4_0": 9.8, "q8_0": 33.2, "w8": 32.7}


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


@pytest.fixture(scope="module")
def unseen():
    """An input neither calibration nor verify runs (they use example_ids(8), seed 0)."""
    return example_ids(8, seed=1)


def sqnr_db(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(10 * np.log10((want ** 2).sum() / max(((got - want) ** 2).sum(), 1e-300)))


def convert_format(model: torch.nn.Module, fmt: str, path, **kw):
    """``model`` written as ``fmt`` for target circle, verified with the format's default
    tolerance (the reference interpreter)."""
    args = dict(target="circle", verify=True, **kw)
    if fmt == "fp16":
        args["dtype"] = "fp16"
    else:
        args["quantize"] = fmt
    if fmt in ("uint8", "int16"):
        # the format's own rounding, measured without the Hadamard rotation integer LLM
        # conversions fold in by default (rotate="auto": tests/quantize/test_integer_llm.py)
        args.update(calibrate=4, rotate="off")
    return circleops.convert(copy.deepcopy(model), (example_ids(8),), path, **args)


@pytest.mark.parametrize("fmt", list(SQNR_FLOOR))
def test_file_logits_against_fp32(llama, unseen, tmp_path, fmt):
    from circleops.runtime import reference

    path = tmp_path / f"{fmt}.circle"
    report = convert_format(llama, fmt, path)
    # verify ran with the format's own tolerance, not a flat one
    v = report.verify
    quantize = None if fmt == "fp16" else fmt
    assert v.passed and v.tolerance == pytest.approx(
        format_tolerance(quantize, torch.float16 if fmt == "fp16" else torch.float32) * max(1.0, v.reference_max_abs))
    with torch.no_grad():
        want = llama(unseen).logits.numpy()
    got = reference.Session(str(path)).run([unseen.numpy()])[0]
    snr = sqnr_db(got, want)
    assert snr >= SQNR_FLOOR[fmt], (f"{fmt}: logits against fp32 at {snr:.2f} dB SQNR, below the {SQNR_FLOOR[fmt]} dB "
                                    f"measured (max error {np.abs(got - want).max():.3g})")
    # most of fp32's next tokens survive every format
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert agree >= (0.7 if fmt == "q4_0" else 1.0), f"{fmt}: {agree:.2f} of fp32's argmax tokens"


def test_format_tolerances_follow_the_format():
    """16 rounding steps of each format: tighter for finer formats, never one flat bound."""
    fp16, int16, uint8 = format_tolerance(None, torch.float16), format_tolerance("int16"), format_tolerance("uint8")
    assert format_tolerance(None) == 1e-3 and int16 < fp16 < uint8
    assert int16 == pytest.approx(16 / 32768) and fp16 == pytest.approx(16 / 1024)
    assert {format_tolerance(f) for f in ("q4_0", "q8_0", "w8")} == {uint8}
