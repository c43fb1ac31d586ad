"""Every reference kernel that sizes its result from values in the file (shape tensors,
multiples, paddings, depths, sizes, options) or from a product of input shapes checks the
allocation limit (kernels.check_alloc) before torch allocates: a tiny hostile file gets a
RuntimeRunError naming the op, at once, with no MemoryError and no big allocation.

Two tables: values asking for about 2^40 elements under the default 4 GiB limit, and
products of small inputs (a row per index, [N, 1] x [1, N], one tensor concatenated 128
times) under a 1 MiB limit, so that the inputs stay small while the result is 4x over.
"""
from __future__ import annotations

import numpy as np
import pytest

from circleops import ir
from circleops.errors import RuntimeRunError
from circleops.runtime import reference
from bounds import address_space_limit


def _model(opcode, feeds, consts, options=None, repeat=1, out_dtype="FLOAT32"):
    """One ``opcode`` operator over graph inputs ``feeds`` then constants ``consts`` (numpy
    arrays); the feeds' list is repeated ``repeat`` times in the operator's inputs."""
    sg = ir.Subgraph("main")
    fed = [sg.add_tensor(ir.Tensor(f"in{k}", a.shape, ir.TORCH_TO_TYPE[_torch_dtype(a)])) for k, a in enumerate(feeds)]
    const = [sg.add_tensor(ir.Tensor(f"c{k}", a.shape, ir.TORCH_TO_TYPE[_torch_dtype(a)], data=a))
             for k, a in enumerate(consts)]
    out = sg.add_tensor(ir.Tensor("out", (1,), out_dtype))  # the kernel's own shape is what is checked
    sg.operators.append(ir.Operator(opcode, fed * repeat + const, [out], None, dict(options or {})))
    sg.inputs, sg.outputs = fed, [out]
    return ir.Model([sg])


def _torch_dtype(a):
    import torch

    return torch.from_numpy(np.zeros(0, a.dtype)).dtype


f32, i32 = np.float32, np.int32
BIG = 1 << 20  # two of these: 2^40 elements

# opcode -> (feeds, constants, options): values from the file asking for ~2^40 elements
VALUES = {
    "RESHAPE": ([np.zeros((2, 3), f32)], [np.array([BIG, BIG], i32)], {}),
    "TILE": ([np.zeros((2, 3), f32)], [np.array([BIG, BIG], i32)], {}),
    "BROADCAST_TO": ([np.zeros((1, 1), f32)], [np.array([BIG, BIG], i32)], {}),
    "FILL": ([], [np.array([BIG, BIG], i32), np.array(1.0, f32)], {}),
    "PAD": ([np.zeros((2, 3), f32)], [np.array([[0, BIG], [0, BIG]], i32)], {}),
    "MIRROR_PAD": ([np.zeros((2, 3), f32)], [np.array([[0, BIG], [0, BIG]], i32)], {"mode": 0}),
    "RANGE": ([], [np.array(0, i32), np.array(2**31 - 1, i32), np.array(1, i32)], {}),
    "ONE_HOT": ([np.zeros((BIG,), i32)], [np.array(BIG, i32), np.array(1.0, f32), np.array(0.0, f32)], {"axis": -1}),
    "SCATTER_ND": ([np.zeros((1, 2), i32), np.zeros((1,), f32)], [np.array([BIG, BIG], i32)], {}),
    "RESIZE_BILINEAR": ([np.zeros((1, 2, 2, 1), f32)], [np.array([BIG, BIG], i32)], {}),
    "RESIZE_NEAREST_NEIGHBOR": ([np.zeros((1, 2, 2, 1), f32)], [np.array([BIG, BIG], i32)], {}),
    "TRANSPOSE_CONV": ([], [np.array([1, BIG, BIG, 1], i32), np.zeros((1, 1, 1, 1), f32), np.zeros((1, 2, 2, 1), f32)],
                       {"padding": 1, "strideH": 1, "strideW": 1}),
    # a pooling window of 2^20 x 2^20 with SAME padding pads the input to ~2^40 elements
    "MAX_POOL_2D": ([np.zeros((1, 4, 4, 1), f32)], [],
                    {"padding": 0, "filterHeight": BIG, "filterWidth": BIG, "strideH": 1, "strideW": 1}),
    "CONV_2D": ([np.zeros((1, 4, 4, 1), f32)], [np.zeros((1, 3, 3, 1), f32)],
                {"padding": 0, "strideH": 1, "strideW": 1, "dilationHFactor": BIG, "dilationWFactor": BIG}),
}

N = 1024  # under a 1 MiB limit: [N, N] float32 is 4 MiB, every input at most 64 KiB
# opcode -> (feeds, constants, options, repeat, output dtype): shapes of small inputs
# multiplying into a big result
PRODUCTS = {
    "GATHER": ([np.zeros((1, N), f32)], [np.zeros((N,), i32)], {"axis": 0}, 1, "FLOAT32"),
    "GATHER_ND": ([np.zeros((1, N), f32)], [np.zeros((N, 1), i32)], {}, 1, "FLOAT32"),
    "EMBEDDING_LOOKUP": ([np.zeros((N,), i32)], [np.zeros((1, N), f32)], {}, 1, "FLOAT32"),
    "FULLY_CONNECTED": ([np.zeros((N, 1), f32)], [np.zeros((N, 1), f32)], {}, 1, "FLOAT32"),
    "BATCH_MATMUL": ([np.zeros((N, 1), f32), np.zeros((1, N), f32)], [], {}, 1, "FLOAT32"),
    "CONV_2D": ([np.zeros((1, 64, 64, 1), f32)], [np.zeros((256, 1, 1, 1), f32)],
                {"padding": 1, "strideH": 1, "strideW": 1}, 1, "FLOAT32"),
    "DEPTHWISE_CONV_2D": ([np.zeros((1, 64, 64, 1), f32)], [np.zeros((1, 1, 1, 256), f32)],
                          {"padding": 1, "strideH": 1, "strideW": 1, "depthMultiplier": 256}, 1, "FLOAT32"),
    "CONCATENATION": ([np.zeros((64, 64), f32)], [], {"axis": 0}, 128, "FLOAT32"),
    "PACK": ([np.zeros((64, 64), f32)], [], {"axis": 0, "valuesCount": 128}, 128, "FLOAT32"),
    "WHERE": ([np.ones((512, 512), np.bool_)], [], {}, 1, "INT64"),
}


def _refused_fast(model, feeds, opcode, match):
    # refused before allocating: with at most 200 MB more address space a big allocation
    # would fail as a MemoryError (or torch's RuntimeError), not this RuntimeRunError
    with address_space_limit(200 << 20), pytest.raises(RuntimeRunError, match=match) as err:
        reference.run(model, feeds)
    assert opcode in str(err.value)


@pytest.mark.parametrize("opcode", VALUES)
def test_values_from_the_file_asking_for_2_40_elements_are_refused(opcode, monkeypatch):
    monkeypatch.delenv("CIRCLEOPS_MAX_TENSOR_BYTES", raising=False)
    feeds, consts, options = VALUES[opcode]
    # RESHAPE never allocates: torch refuses another element count, which is the message
    match = "invalid for input of size 6" if opcode == "RESHAPE" else "over the interpreter's limit"
    _refused_fast(_model(opcode, feeds, consts, options), feeds, opcode, match)


@pytest.mark.parametrize("opcode", PRODUCTS)
def test_products_of_small_inputs_are_checked_before_allocating(opcode, monkeypatch):
    monkeypatch.setenv("CIRCLEOPS_MAX_TENSOR_BYTES", str(1 << 20))
    feeds, consts, options, repeat, out_dtype = PRODUCTS[opcode]
    model = _model(opcode, feeds, consts, options, repeat, out_dtype)
    _refused_fast(model, feeds, opcode, "over the interpreter's limit")


@pytest.mark.parametrize("opcode", PRODUCTS)
def test_the_same_products_under_the_limit_still_run(opcode, monkeypatch):
    # the checks compute the real result shape: at 8x the limit's need the op runs as before
    monkeypatch.setenv("CIRCLEOPS_MAX_TENSOR_BYTES", str(8 << 20))
    feeds, consts, options, repeat, out_dtype = PRODUCTS[opcode]
    with pytest.raises(RuntimeRunError, match=r"computed as .* but declared"):  # out is declared [1]
        reference.run(_model(opcode, feeds, consts, options, repeat, out_dtype), feeds)
