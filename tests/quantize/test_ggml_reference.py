"""GGML blocks in the reference interpreter: unpacking equals gguf's, and files with a
GGML FULLY_CONNECTED weight or a Q4_0 GATHER table give onert's results (the conftest
cross-checks every onert run against the interpreter within 1e-5 at the output's scale)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from circleops import ir
from circleops.errors import RuntimeRunError
from circleops.quantize import ggml
from circleops.runtime import onert, reference
from circleops.serialize import write_model
from onert_host import ONERT_RUNS_GGML, run_ggml

GGUF = {"GGML_Q4_0": gguf.GGMLQuantizationType.Q4_0, "GGML_Q8_0": gguf.GGMLQuantizationType.Q8_0}
DTYPES = sorted(GGUF)


def _weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_gguf(dtype):
    w = _weight(7, 96)
    w[0, :32] = 0.0  # an all-zero block (d = 0)
    blocks = ggml.quantize(w, dtype)
    np.testing.assert_array_equal(blocks, gguf.quants.quantize(w, GGUF[dtype]).reshape(-1))
    want = gguf.quants.dequantize(blocks.reshape(7, -1), GGUF[dtype])
    got = ggml.dequantize(blocks, dtype, (7, 96)).numpy()
    np.testing.assert_array_equal(got, want)
    rows = ggml.BlockTensor(blocks, dtype, (7, 96)).rows(torch.tensor([6, 0, 6]))
    np.testing.assert_array_equal(rows.numpy(), want[[6, 0, 6]])


def test_q8_0_input_quantization_rounds_half_to_even():
    # amax 127 -> multiplier 1: 0.5 and 2.5 round to 0 and 2 (half to even), not 1 and 3
    x = torch.zeros(32)
    x[:4] = torch.tensor([127.0, 0.5, 2.5, -1.5])
    q = ggml.quantize_q8_0_input(x)
    assert q[:4].tolist() == [127.0, 0.0, 2.0, -2.0]
    assert ggml.quantize_q8_0_input(torch.zeros(64)).abs().max() == 0  # no 0/0


def _fc_model(dtype: str, w: np.ndarray, rows: int) -> ir.Model:
    n, k = w.shape
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, k), "FLOAT32"))
    wi = sg.add_tensor(ir.Tensor("w", (n, k), dtype, ggml.quantize(w, dtype)))
    y = sg.add_tensor(ir.Tensor("y", (rows, n), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, wi, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": "NONE"}))
    sg.inputs, sg.outputs = [x], [y]
    return ir.Model([sg])


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_connected_matches_onert(tmp_path, dtype, rows):
    w = _weight(48, 128)
    x = np.random.default_rng(1).standard_normal((rows, 128)).astype(np.float32) * 3
    path = tmp_path / "fc.circle"
    write_model(_fc_model(dtype, w, rows), path, "circle")
    got = run_ggml(path, [x])[0]  # onert where this CPU runs GGML (cross-checked by conftest)
    ref = reference.run(path, [x])[0]
    # the input's Q8_0 rounding is part of the result: without it the error is far larger
    deq = ggml.dequantize(ggml.quantize(w, dtype), dtype, w.shape).numpy()
    plain = x @ deq.T
    emulated = ggml.quantize_q8_0_input(torch.from_numpy(x)).numpy().astype(np.float64) @ deq.T.astype(np.float64)
    scale = np.abs(got).max()
    assert np.abs(ref - got).max() <= 1e-5 * scale
    assert np.abs(ref - emulated).max() <= 1e-5 * scale  # onert's kernel: Q8_0(x) . dequant(W)
    assert np.abs(plain - ref).max() > 10 * max(np.abs(ref - emulated).max(), 1e-7 * scale)


def test_gather_q4_0_table_matches_onert(tmp_path):
    table = _weight(50, 64)
    sg = ir.Subgraph("main")
    ids = sg.add_tensor(ir.Tensor("ids", (1, 6), "INT32"))
    t = sg.add_tensor(ir.Tensor("table", (50, 64), "GGML_Q4_0", ggml.quantize(table, "GGML_Q4_0")))
    out = sg.add_tensor(ir.Tensor("emb", (1, 6, 64), "FLOAT32"))
    sg.operators.append(ir.Operator("GATHER", [t, ids], [out], "GatherOptions", {"axis": 0}))
    sg.inputs, sg.outputs = [ids], [out]
    path = tmp_path / "gather.circle"
    write_model(ir.Model([sg]), path, "circle")
    idx = np.array([[0, 49, 3, 3, 17, 1]], np.int32)
    got = run_ggml(path, [idx])[0]
    deq = gguf.quants.dequantize(ggml.quantize(table, "GGML_Q4_0").reshape(50, -1), GGUF["GGML_Q4_0"])
    np.testing.assert_array_equal(got[0], deq[idx[0]])
    np.testing.assert_array_equal(reference.run(path, [idx])[0], got)


def test_ggml_tensor_elsewhere_is_a_clear_error(tmp_path):
    w = _weight(4, 32)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (4, 32), "FLOAT32"))
    wi = sg.add_tensor(ir.Tensor("w", (4, 32), "GGML_Q8_0", ggml.quantize(w, "GGML_Q8_0")))
    y = sg.add_tensor(ir.Tensor("y", (4, 32), "FLOAT32"))
    sg.operators.append(ir.Operator("ADD", [x, wi], [y]))
    sg.inputs, sg.outputs = [x], [y]
    with pytest.raises(RuntimeRunError, match="GGML blocks are read only as a FULLY_CONNECTED weight"):
        reference.run(ir.Model([sg]), [np.zeros((4, 32), np.float32)])
