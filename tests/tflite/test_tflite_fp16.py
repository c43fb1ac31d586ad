"""fp16 for LiteRT: weights stored fp16, torch's fp16 dataflow kept, ops without an fp16
LiteRT CPU kernel computed in fp32 (circleops.lowering.tflite_fp16), norms' fp32 islands
kept inside the composites' decompositions. Outputs are checked against torch fp16 with
the XNNPACK delegate and with the builtin kernels alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.lowering.tflite_fp16 import FP16_KERNELS
from circleops.serialize import write_model
from families import BY_NAME, FAMILIES, example_ids
from tflite_util import (NATIVE_FP16, RESOLVERS, composites, constant, convert, dtype, fp16_bound, litert, max_error,
                         one_op, opname, read, scale)

# fp16 output vs torch fp16: one fp16 step per rounding on the file's deepest path
# (tflite_util.fp16_bound); which XNNPACK path runs depends on the CPU's AVX512-FP16
NAMES = [f.name for f in FAMILIES]

# ----------------------------------------------------------------------------- the kernel list

rng = np.random.default_rng(0)
S = (2, 4, 8)


def _h(*shape):
    return rng.standard_normal(shape).astype(np.float16)


def _i32(*v):
    return np.array(v, np.int32)


# opcode -> (operands as (array, is_constant), output like, options type, options)
_PROBES = {
    **{op: lambda: ([(_h(*S), False), (_h(*S), False)], _h(*S), None, None) for op in ("ADD", "MUL", "MAXIMUM", "MINIMUM")},
    **{op: lambda: ([(_h(*S), False)], _h(*S), None, None)
       for op in ("NEG", "LOGISTIC", "TANH", "SIN", "COS", "FLOOR", "ROUND")},
    **{op: lambda: ([(_h(*S), False), (_h(*S), False)], np.zeros(S, bool), None, None)
       for op in ("LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL")},
    "GELU": lambda: ([(_h(*S), False)], _h(*S), "GeluOptions", {"approximate": False}),
    "SOFTMAX": lambda: ([(_h(*S), False)], _h(*S), "SoftmaxOptions", {"beta": 1.0}),
    "SELECT_V2": lambda: ([(rng.random(S) > 0.5, False), (_h(*S), False), (_h(*S), False)], _h(*S), None, None),
    "RESHAPE": lambda: ([(_h(*S), False), (_i32(8, 8), True)], _h(8, 8), None, None),
    "TRANSPOSE": lambda: ([(_h(*S), False), (_i32(0, 2, 1), True)], _h(2, 8, 4), None, None),
    "CONCATENATION": lambda: ([(_h(*S), False), (_h(*S), False)], _h(2, 4, 16), "ConcatenationOptions", {"axis": 2}),
    "STRIDED_SLICE": lambda: ([(_h(*S), False), (_i32(0, 1, 0), True), (_i32(2, 4, 8), True), (_i32(1, 1, 2), True)],
                              _h(2, 3, 4), "StridedSliceOptions", {}),
    "GATHER": lambda: ([(_h(16, 8), True), (np.array([[1, 3, 5]], np.int64), False)], _h(1, 3, 8),
                       "GatherOptions", {"axis": 0}),
    "BROADCAST_TO": lambda: ([(_h(1, 4, 8), False), (_i32(2, 4, 8), True)], _h(2, 4, 8), None, None),
    "TILE": lambda: ([(_h(1, 4, 8), False), (_i32(2, 1, 1), True)], _h(2, 4, 8), None, None),
    "PAD": lambda: ([(_h(*S), False), (np.array([[0, 0], [1, 1], [0, 0]], np.int32), True)], _h(2, 6, 8), None, None),
    "PADV2": lambda: ([(_h(*S), False), (np.array([[0, 0], [1, 1], [0, 0]], np.int32), True),
                      (np.array(0.5, np.float16), True)], _h(2, 6, 8), None, None),
    "MIRROR_PAD": lambda: ([(_h(*S), False), (np.array([[0, 0], [1, 1], [0, 0]], np.int32), True)], _h(2, 6, 8),
                           "MirrorPadOptions", {"mode": 0}),
    "REVERSE_V2": lambda: ([(_h(*S), False), (_i32(1), True)], _h(*S), None, None),
    "RESIZE_NEAREST_NEIGHBOR": lambda: ([(_h(1, 4, 4, 3), False), (_i32(8, 8), True)], _h(1, 8, 8, 3), None, None),
    "CAST": lambda: ([(_h(*S), False)], _h(*S).astype(np.float32), None, None),
    "DEQUANTIZE": lambda: ([(_h(16, 8), True)], _h(16, 8).astype(np.float32), None, None),
}
# composites run their decomposition subgraph: covered by every fp16 model below
_COVERED_ELSEWHERE = {"STABLEHLO_COMPOSITE"}

# ops the legalization widens to fp32: LiteRT 2.3.0's builtin kernels refuse them in fp16
_REFUSED = {
    "FULLY_CONNECTED": lambda: ([(_h(2, 4, 8), False), (_h(16, 8), True)], _h(2, 4, 16),
                                "FullyConnectedOptions", {"keepNumDims": True}),
    "BATCH_MATMUL": lambda: ([(_h(2, 4, 8), False), (_h(2, 8, 3), False)], _h(2, 4, 3), None, None),
    "MEAN": lambda: ([(_h(*S), False), (_i32(2), True)], _h(2, 4, 1), "ReducerOptions", {"keepDims": True}),
    "RSQRT": lambda: ([(np.abs(_h(*S)) + np.float16(0.5), False)], _h(*S), None, None),
    "SUB": lambda: ([(_h(*S), False), (_h(*S), False)], _h(*S), None, None),
    "DIV": lambda: ([(_h(*S), False), (np.abs(_h(*S)) + np.float16(0.5), False)], _h(*S), None, None),
    "EXP": lambda: ([(_h(*S), False)], _h(*S), None, None),
    "CONV_2D": lambda: ([(_h(1, 8, 8, 4), False), (_h(6, 3, 3, 4), True), (_h(6), True)], _h(1, 6, 6, 6),
                        "Conv2DOptions", {"padding": 1, "strideW": 1, "strideH": 1,
                                          "dilationWFactor": 1, "dilationHFactor": 1}),
}


def _as_fp32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32) if a.dtype == np.float16 else a


def _run_one(tmp_path, opcode, operands, out, options_type, options, fp32: bool) -> np.ndarray:
    if fp32:
        operands = [(_as_fp32(a), c) for a, c in operands]
        out = _as_fp32(out)
    model, feeds = one_op(opcode, operands, out, options_type, options)
    path = tmp_path / f"{opcode}_{'fp32' if fp32 else 'fp16'}.tflite"
    write_model(model, path, "tflite")
    return litert(path, feeds, "builtin")[0]


def test_probes_cover_the_kernel_list():
    assert set(_PROBES) | _COVERED_ELSEWHERE == FP16_KERNELS
    assert not set(_REFUSED) & FP16_KERNELS


@pytest.mark.parametrize("opcode", sorted(_PROBES))
def test_listed_op_runs_fp16_on_builtin_kernels(tmp_path, opcode):
    operands, out, options_type, options = _PROBES[opcode]()
    got = _run_one(tmp_path, opcode, operands, out, options_type, options, fp32=False)
    if opcode == "DEQUANTIZE":  # fp16 -> fp32 has no fp32 -> fp32 twin: exact widening
        want = operands[0][0].astype(np.float32)
    else:
        want = _run_one(tmp_path, opcode, operands, out, options_type, options, fp32=True)
    assert got.dtype == out.dtype
    if want.dtype == np.float32:
        assert max_error(got, want) <= 2e-3 * scale(want)
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("opcode", sorted(_REFUSED))
def test_widened_op_has_no_fp16_builtin_kernel(tmp_path, opcode):
    """If this starts to run, LiteRT gained the kernel: add the op to FP16_KERNELS."""
    operands, out, options_type, options = _REFUSED[opcode]()
    assert _run_one(tmp_path, opcode, operands, out, options_type, options, fp32=True) is not None
    with pytest.raises((RuntimeError, ValueError)):
        _run_one(tmp_path, opcode, operands, out, options_type, options, fp32=False)


# ----------------------------------------------------------------------------- fp16 models

@pytest.mark.parametrize("resolver", RESOLVERS)
@pytest.mark.parametrize("name", NAMES + ["convnet"])
def test_fp16_runs_in_litert_like_torch_fp16(converted, name, resolver):
    """builtin: LiteRT's fp16 kernels (fp32 compute, one rounding per op) everywhere. xnnpack:
    on a CPU with AVX512-FP16, XNNPACK's native fp16 arithmetic (more roundings per
    transcendental and reduction: the bound counts them); elsewhere its F16C path (one
    rounding per op, like builtin)."""
    c = converted(name, "fp16")
    (got,) = litert(c.path, c.inputs, resolver)
    (want,) = c.expected
    assert got.dtype == np.float16 and got.shape == want.shape
    assert np.isfinite(got).all()
    bound = fp16_bound(c.path, resolver, want)
    assert max_error(got, want) <= bound, (max_error(got, want), bound, "native fp16" if NATIVE_FP16 else "F16C")


@pytest.mark.parametrize("name", NAMES + ["convnet"])
def test_every_fp16_op_has_a_litert_kernel(converted, name):
    m = read(converted(name, "fp16").path)
    for sg in m.subgraphs:
        for op in sg.operators:
            if any(i >= 0 and dtype(sg, i) == "FLOAT16" for i in [*op.inputs, *op.outputs]):
                assert opname(m, op) in FP16_KERNELS, (sg.name, opname(m, op))


def _float_constant_bytes(m) -> dict[str, int]:
    seen, nbytes = set(), {"FLOAT16": 0, "FLOAT32": 0}
    for sg in m.subgraphs:
        for i, t in enumerate(sg.tensors):
            data = constant(m, sg, i)
            if data is not None and dtype(sg, i) in nbytes and t.buffer not in seen:
                seen.add(t.buffer)
                nbytes[dtype(sg, i)] += data.nbytes
    return nbytes


@pytest.mark.parametrize("name", ["llama", "qwen2", "convnet"])
def test_fp16_weights_are_stored_fp16(converted, name):
    fp16, fp32 = converted(name, "fp16"), converted(name, "fp32")
    m = read(fp16.path)
    nbytes = _float_constant_bytes(m)
    assert nbytes["FLOAT32"] <= 0.01 * nbytes["FLOAT16"], nbytes
    # half the weight bytes of the fp32 file (buffers are shared, not duplicated)
    assert nbytes["FLOAT16"] <= 0.51 * _float_constant_bytes(read(fp32.path))["FLOAT32"]
    # the heavy ops compute in fp32 from fp16 weights: DEQUANTIZE, no fp32 copy in the file
    ops = {opname(m, op) for op in m.subgraphs[0].operators}
    assert "DEQUANTIZE" in ops


def _check_fp32_island(m, comp) -> None:
    """The decomposition takes and returns fp16, upcasts x, reduces and rsqrts in fp32."""
    dec = m.subgraphs[comp.subgraph]
    x = dec.inputs[0]
    assert dtype(dec, x) == "FLOAT16" and all(dtype(dec, o) == "FLOAT16" for o in dec.outputs)
    names = [(opname(m, op), op) for op in dec.operators]
    assert any(n == "CAST" and op.inputs[0] == x and dtype(dec, op.outputs[0]) == "FLOAT32" for n, op in names)
    assert any(n == "CAST" and dtype(dec, op.inputs[0]) == "FLOAT32" and dtype(dec, op.outputs[0]) == "FLOAT16"
               for n, op in names)
    reductions = [op for n, op in names if n in ("MEAN", "RSQRT")]
    assert {n for n, _ in names} >= {"MEAN", "RSQRT"}
    assert all(dtype(dec, i) == "FLOAT32" for op in reductions for i in [op.inputs[0], *op.outputs])


@pytest.mark.parametrize("name", NAMES)
def test_rms_norm_decomposition_keeps_the_fp32_island(converted, name):
    m = read(converted(name, "fp16").path)
    norms = [c for c in composites(m) if c.name == "odml.rms_norm"]
    assert norms
    for comp in norms:
        _check_fp32_island(m, comp)


def test_instance_norm_decomposition_keeps_the_fp32_island(converted):
    m = read(converted("convnet", "fp16").path)
    norms = [c for c in composites(m) if c.name == "circle.instance_norm"]
    assert len(norms) == 9
    for comp in norms:
        _check_fp32_island(m, comp)


def test_norm_inputs_past_fp16_square_range(tmp_path):
    """Residual streams with |x| in the hundreds (SmolLM2 has RMS > 900): x² passes fp16's
    65504, so only the fp32 island keeps the norms finite and right."""
    def build():
        model = BY_NAME["llama"].build()
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(400.0 / model.model.embed_tokens.weight.std())
        return model

    c = convert(build, lambda: example_ids(seq_len=8), tmp_path / "loud.tflite", torch.float16)
    assert c.model.model.embed_tokens.weight.abs().max() > 256  # x² overflows fp16
    (want,) = c.expected
    assert np.isfinite(want).all()
    for resolver in RESOLVERS:
        (got,) = litert(c.path, c.inputs, resolver)
        assert np.isfinite(got).all()
        assert max_error(got, want) <= fp16_bound(c.path, resolver, want)


def test_fp16_interface_is_torchs(converted):
    """Inputs and outputs keep the torch model's dtypes (fp16 image in, fp16 image out)."""
    main = read(converted("convnet", "fp16").path).subgraphs[0]
    assert [dtype(main, i) for i in main.inputs] == ["FLOAT16"]
    assert [dtype(main, i) for i in main.outputs] == ["FLOAT16"]
