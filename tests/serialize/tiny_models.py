"""Small hand-built ir.Models shared by tests/serialize and tests/inspect.

Each builder returns (model, reference) where reference(*inputs) computes the expected
outputs with numpy, so a test can run the written file and compare.
"""
from __future__ import annotations

import numpy as np
import torch

from circleops import ir


def fc_add(weight: torch.Tensor | None = None, *, dtype_inputs: int = 4) -> tuple[ir.Model, callable]:
    """z = x @ W.T + b + c: FULLY_CONNECTED then ADD, W a torch parameter, b and c numpy."""
    g = torch.Generator().manual_seed(0)
    W = weight if weight is not None else torch.randn(3, dtype_inputs, generator=g)
    b = np.arange(3, dtype=np.float32)
    c = np.full((1, 3), 0.5, np.float32)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, W.shape[1]), "FLOAT32"))
    w = sg.add_tensor(ir.Tensor("fc.weight", tuple(W.shape), "FLOAT32", W))
    bi = sg.add_tensor(ir.Tensor("fc.bias", (3,), "FLOAT32", b))
    y = sg.add_tensor(ir.Tensor("y", (1, 3), "FLOAT32"))
    ci = sg.add_tensor(ir.Tensor("c", (1, 3), "FLOAT32", c))
    z = sg.add_tensor(ir.Tensor("z", (1, 3), "FLOAT32"))
    sg.operators += [
        ir.Operator("FULLY_CONNECTED", [x, w, bi], [y], "FullyConnectedOptions",
                    {"fusedActivationFunction": "NONE"}),
        ir.Operator("ADD", [y, ci], [z], "AddOptions", {}),
    ]
    sg.inputs, sg.outputs = [x], [z]
    model = ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"z": z})])
    Wn = W.detach().numpy()
    return model, lambda xv: [xv @ Wn.T + b + c]


def rms_norm_circle(eps: float = 1e-5) -> tuple[ir.Model, callable]:
    """A single Circle RMS_NORM (extended op, code -6) on a rank-3 input."""
    gamma = torch.linspace(0.5, 1.5, 8)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, 2, 8), "FLOAT32"))
    g = sg.add_tensor(ir.Tensor("norm.weight", (8,), "FLOAT32", gamma))
    y = sg.add_tensor(ir.Tensor("y", (1, 2, 8), "FLOAT32"))
    sg.operators.append(ir.Operator("RMS_NORM", [x, g], [y], "RmsNormOptions", {"epsilon": eps}))
    sg.inputs, sg.outputs = [x], [y]
    model = ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})])

    def reference(xv):
        return [xv / np.sqrt((xv * xv).mean(-1, keepdims=True) + eps) * gamma.numpy()]

    return model, reference


def rms_norm_composite(eps: float = 1e-6) -> tuple[ir.Model, callable]:
    """STABLEHLO_COMPOSITE "odml.rms_norm" whose decomposition subgraph computes RMSNorm."""
    gamma = np.linspace(0.5, 1.5, 8).astype(np.float32)
    main = ir.Subgraph("main")
    x = main.add_tensor(ir.Tensor("x", (2, 8), "FLOAT32"))
    g = main.add_tensor(ir.Tensor("norm.weight", (8,), "FLOAT32", gamma))
    y = main.add_tensor(ir.Tensor("y", (2, 8), "FLOAT32"))
    main.operators.append(ir.Operator(
        "STABLEHLO_COMPOSITE", [x, g], [y], "StableHLOCompositeOptions",
        {"name": "odml.rms_norm", "decompositionSubgraphIndex": 1,
         "compositeAttributes": {"epsilon": eps}, "version": 0}))
    main.inputs, main.outputs = [x], [y]

    dec = ir.Subgraph("odml.rms_norm.decomposition")
    t = lambda name, shape, data=None: dec.add_tensor(ir.Tensor(name, shape, "FLOAT32", data))  # noqa: E731
    a, w = t("x", (2, 8)), t("w", (8,))
    sq, ms, mse, r, n, o = (t("sq", (2, 8)), t("ms", (2, 1)), t("mse", (2, 1)), t("r", (2, 1)),
                            t("n", (2, 8)), t("o", (2, 8)))
    axis = dec.add_tensor(ir.Tensor("axis", (1,), "INT32", np.array([-1], np.int32)))
    epst = t("eps", (1,), np.array([eps], np.float32))
    dec.operators += [
        ir.Operator("MUL", [a, a], [sq], "MulOptions", {}),
        ir.Operator("MEAN", [sq, axis], [ms], "ReducerOptions", {"keepDims": True}),
        ir.Operator("ADD", [ms, epst], [mse], "AddOptions", {}),
        ir.Operator("RSQRT", [mse], [r]),
        ir.Operator("MUL", [a, r], [n], "MulOptions", {}),
        ir.Operator("MUL", [n, w], [o], "MulOptions", {}),
    ]
    dec.inputs, dec.outputs = [a, w], [o]
    model = ir.Model([main, dec], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})])

    def reference(xv):
        return [xv / np.sqrt((xv * xv).mean(-1, keepdims=True) + eps) * gamma]

    return model, reference


def broadcast_to() -> tuple[ir.Model, callable]:
    """BROADCAST_TO, which LiteRT accepts only from op version 2."""
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, 4), "FLOAT32"))
    s = sg.add_tensor(ir.Tensor("shape", (2,), "INT32", np.array([3, 4], np.int32)))
    y = sg.add_tensor(ir.Tensor("y", (3, 4), "FLOAT32"))
    sg.operators.append(ir.Operator("BROADCAST_TO", [x, s], [y], "BroadcastToOptions", {}))
    sg.inputs, sg.outputs = [x], [y]
    model = ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})])
    return model, lambda xv: [np.broadcast_to(xv, (3, 4))]


def mixed_constants() -> ir.Model:
    """Constants of many dtypes (bf16 from torch, raw-bit bf16 numpy, int64, bool, scalar)."""
    sg = ir.Subgraph("consts")
    g = torch.Generator().manual_seed(1)
    consts = {
        "f32": ("FLOAT32", torch.randn(4, 3, generator=g)),
        "f16": ("FLOAT16", torch.randn(5, generator=g).half()),
        "bf16_torch": ("BFLOAT16", torch.randn(2, 3, generator=g).bfloat16()),
        "bf16_bits": ("BFLOAT16", np.array([0x3F80, 0xC000], np.uint16)),
        "i64": ("INT64", np.arange(6, dtype=np.int64).reshape(2, 3)),
        "i32_t": ("INT32", torch.arange(4, dtype=torch.int32)[::2]),  # non-contiguous view
        "bool": ("BOOL", np.array([True, False, True])),
        "scalar": ("FLOAT32", np.array(2.5, np.float32)),
    }
    for name, (dtype, data) in consts.items():
        sg.add_tensor(ir.Tensor(name, tuple(data.shape), dtype, data))
    inp = sg.add_tensor(ir.Tensor("in", (-1, 3), "FLOAT32"))
    sg.inputs = [inp]
    sg.outputs = [inp]
    return ir.Model([sg], [], metadata={"note": b"circleops test"})
