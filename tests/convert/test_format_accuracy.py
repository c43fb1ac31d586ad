"""Every format's file against fp32 torch, end to end (issue 25).

verify compares a quantized file with torch running the same quantized weights (the
fake-quantized module, the dequantized GGML/int8 weights), so a lost bit, a wrong observer or
a wrong scale, which both sides share, passes verify. Here the file's logits are compared with
the fp32 model's on an input that neither calibration nor verify saw, as a signal-to-noise
ratio, SQNR = 10 log10(sum logits^2 / sum error^2), on the sharp tiny Llama of
tests/families.py (whose logits move by 5-9 when RoPE, the attention scale, an epsilon or the
causal mask is wrong).

The floor of each format is derived, not measured (tests/convert/format_noise.py): the SQNR
an independent emulation of the format's roundings gives on the same model and input, less
FLOOR_MARGIN_DB: fp16 is the model run in torch fp16 (the same CPU kernels as the
interpreter's fp16 ops, so the floor follows the CPU); q4_0 and q8_0 round the weights the
file stores in those formats with llama.cpp's reference codec (the gguf package) and each
such linear's input to Q8_0; w8 rounds them to int8 per output channel and the inputs per row;
uint8 and int16, whose roundings a PT2E graph places everywhere, are predicted by the additive
noise model (every quantized tensor of the file on the grid the format defines for its values,
relative noise powers summed at unit gain). FLOOR_MARGIN_DB allows the file's noise power to be
four times the emulation's (amplitude x2): it rounds in places the emulation does not (fused
ops decomposed, more quantized tensors), its recipe moves roundings (importance-weighted
Q4_0 scales, SmoothQuant), and noise passes attention's sharp softmax at more than unit gain.
Measured on the AMD EPYC (file / emulation dB): fp16 50.9 / 50.7, q4_0 10.3 / 11.3, q8_0
33.8 / 33.8 (bit-identical), w8 33.2 / 32.1, uint8 23.0 / 26.4, int16 30.6 / 32.6. A wrong
codec, observer or kernel moves the file below its floor: the interpreter's ATTENTION without
RoPE puts every format below 5 dB; one bit fewer in the int8 weights puts int16 at 25.5 dB
(floor 26.6); a 1 % scale error of the logits is 40 dB of SQNR, below fp16's 44.7 floor.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import circleops
from circleops.pipeline.convert import format_tolerance
from families import BY_NAME, example_ids

FORMATS = ("fp16", "uint8", "int16", "q4_0", "q8_0", "w8")
FLOOR_MARGIN_DB = 6.0  # 10 log10(4): the file's noise power up to four times the emulation's


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


def sqnr_floor(model: torch.nn.Module, fmt: str, ids: torch.Tensor, path, want: np.ndarray) -> float:
    """The SQNR the format's own roundings leave on ``model`` (format_noise), less FLOOR_MARGIN_DB."""
    import format_noise

    if fmt in ("uint8", "int16"):
        return format_noise.db(format_noise.integer_noise(path, ids, fmt)) - FLOOR_MARGIN_DB
    return sqnr_db(format_noise.emulated_logits(model, fmt, ids, path), want) - FLOOR_MARGIN_DB


@pytest.mark.parametrize("fmt", FORMATS)
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
    snr, floor = sqnr_db(got, want), sqnr_floor(llama, fmt, unseen, path, want)
    assert snr >= floor, (f"{fmt}: logits against fp32 at {snr:.2f} dB SQNR, below the {floor:.2f} dB the format's "
                          f"roundings leave (max error {np.abs(got - want).max():.3g})")
    # most of fp32's next tokens survive every format
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    assert agree >= (0.7 if fmt == "q4_0" else 1.0), f"{fmt}: {agree:.2f} of fp32's argmax tokens"


def test_format_tolerances_follow_the_format():
    """16 rounding steps of each format: tighter for finer formats, never one flat bound."""
    fp16, int16, uint8 = format_tolerance(None, torch.float16), format_tolerance("int16"), format_tolerance("uint8")
    assert format_tolerance(None) == 1e-3 and int16 < fp16 < uint8
    assert int16 == pytest.approx(16 / 32768) and fp16 == pytest.approx(16 / 1024)
    assert {format_tolerance(f) for f in ("q4_0", "q8_0", "w8")} == {uint8}


@pytest.mark.parametrize("fmt", ["q8_0", "w8"])
def test_weights_hold_the_format_definition(llama, tmp_path, fmt):
    """Where a format fixes each weight's rounding, the file holds exactly that: q8_0 blocks are
    the bytes of llama.cpp's reference codec (the gguf package) for the model's weights; w8's
    int8 rows each span the int8 range (s = max|row| / 127 per output channel). A codec that
    loses a bit costs q8_0 and w8 ~3 dB of SQNR, inside the accuracy test's margin: here it
    is exactly wrong."""
    import gguf
    from format_noise import stored_formats

    from circleops.serialize import read_model

    path = tmp_path / f"{fmt}.circle"
    convert_format(llama, fmt, path)
    params = {name: p.detach().numpy() for name, p in llama.named_parameters()}
    tensors = {t.name: t for sg in read_model(str(path)).subgraphs for t in sg.tensors if t.data is not None}
    checked = 0
    for name in stored_formats(path):
        w = params[name.split(".", 1)[1]]  # the file names weights "model.<parameter name>"
        data = np.asarray(tensors[name].data)
        if fmt == "q8_0":
            want = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(data.reshape(-1), want.reshape(-1)), name
        else:
            scale = np.asarray(tensors[name + "_scale"].data, np.float64).reshape(-1, 1)
            q = data.astype(np.float64)
            # each row spans the int8 range (s = max|row| / 127; the row is SmoothQuant's
            # rescaled weight, not the model's, so only the grid is checked)
            assert np.array_equal(np.abs(q).max(axis=1), np.full(len(q), 127.0)), name
            assert scale.shape == (len(q), 1) and (scale > 0).all(), name
        checked += 1
    assert checked == 7  # gate, up, down of 2 layers and the head
