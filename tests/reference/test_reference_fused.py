"""The fused Circle ops in the interpreter, against the torch ops (circleops.ops.REGISTRY).

Each op's operands are laid out by its Circle contract (schema/ops.yaml: input order,
NHWC for INSTANCE_NORM) and the result must equal torch.ops.circle.<op> on the torch
layout. Where onert runs the op (RMS_NORM, ROPE for one position) the written Circle file
is run there too; STABLEHLO_COMPOSITE is checked against LiteRT.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops import ir
from circleops.ops import BUILTINS, REGISTRY
from circleops.runtime.kernels import KERNELS
from circleops.runtime.reference import Interpreter
from refbuild import Const, Feed, one_op, write_and_run


def _rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 16, generator=g) * 40).to(dtype)
    w = (torch.rand(16, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    named = {"x": Feed(x), "weight": Const(w)}
    return named, {"epsilon": eps}, [torch.ops.circle.rms_norm(x, w, eps)]


def _rope(dtype, mode="gpt_neox", seq=5, table_rank=2):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, seq, 8, generator=g).to(dtype)
    ang = torch.randn(seq, 4, generator=g)
    half = torch.cat([ang, ang], -1) if mode == "gpt_neox" else ang.repeat_interleave(2, -1)
    cos, sin = half.cos().to(dtype), half.sin().to(dtype)
    if table_rank == 4:  # [1, 1, S, D]: the table layout onert's ROPE requires
        cos, sin = cos[None, None], sin[None, None]
    named = {"x": Feed(x), "cos": Const(cos), "sin": Const(sin)}
    return named, {"mode": 0 if mode == "gpt_neox" else 1}, [torch.ops.circle.rope(x, cos, sin, mode)]


def _attention(dtype):
    g = torch.Generator().manual_seed(3)
    e, d, hq, hkv, c, s = 16, 4, 4, 2, 8, 3
    t = lambda *shape: (torch.randn(*shape, generator=g) * 0.5).to(dtype)  # noqa: E731
    x, wq, wk, wv, wo = t(1, s, e), t(hq * d, e), t(hkv * d, e), t(hkv * d, e), t(e, hq * d)
    ang = torch.randn(s, d // 2, generator=g)
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    pos = torch.tensor([2], dtype=torch.int64)
    slots = torch.arange(c)
    # causal over the cache: token i (at slot pos+i) sees slots <= pos+i
    mask = torch.where(slots[None, :] <= (pos + torch.arange(s))[:, None], 0.0, float("-inf")).to(dtype)
    kc, vc = t(1, c, hkv, d), t(1, c, hkv, d)
    named = {"x": Feed(x), "wq": Const(wq), "wk": Const(wk), "wv": Const(wv), "wo": Const(wo),
             "cos": Const(cos), "sin": Const(sin), "mask": Const(mask), "k_cache": Feed(kc),
             "v_cache": Feed(vc), "pos": Feed(pos)}
    return named, {}, list(torch.ops.circle.attention(x, wq, wk, wv, wo, cos, sin, mask, kc, vc, pos))


def _instance_norm(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 3, 4, 5, generator=g) * 3 + 1).to(dtype)
    w, b = torch.rand(3, generator=g).to(dtype), torch.randn(3, generator=g).to(dtype)
    eps = 1e-5
    y = torch.ops.circle.instance_norm(x, w, b, eps)
    # Circle's INSTANCE_NORM is NHWC: feed and expect channels-last.
    named = {"x": Feed(x.permute(0, 2, 3, 1).contiguous()), "weight": Const(w), "bias": Const(b)}
    return named, {"epsilon": eps}, [y.permute(0, 2, 3, 1).contiguous()]


CASES = {"rms_norm": _rms_norm, "rope": _rope, "attention": _attention, "instance_norm": _instance_norm}


def circle_model(name, named, options, expected):
    """One Circle builtin operator with operands in the contract's Circle input order."""
    spec = REGISTRY[name]
    operands = [named[n] for n in spec.circle["inputs"]]
    return one_op(spec.circle["builtin"], operands, expected, options, spec.circle["options"])


def test_every_registry_op_has_a_kernel():
    for spec in map(REGISTRY.get, BUILTINS):
        assert spec.circle["builtin"] in KERNELS, f"no interpreter kernel for {spec.circle['builtin']}"


def _circle_sample(spec, args: tuple, kwargs: dict):
    """The op's torch sample as (operands in Circle order, options, NHWC?), or None when
    the sample sets an attribute the Circle builtin cannot express (the lowering then
    decomposes the op instead of writing the builtin)."""
    bound, options = {}, {}
    for i, arg in enumerate(spec.overload._schema.arguments):
        bound[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
        if not isinstance(bound[arg.name], torch.Tensor) and bound[arg.name] is not None:
            if arg.name not in spec.circle["option_fields"].values() and bound[arg.name] != arg.default_value:
                return None
    values = spec.circle.get("option_values", {})
    for field, arg in spec.circle["option_fields"].items():
        options[field] = values.get(arg, {}).get(bound[arg], bound[arg])
    nhwc = spec.circle.get("layout") == "NHWC"
    operands = []
    for k, name in enumerate(spec.circle["inputs"]):
        t = bound[name]
        if t is not None and nhwc and name == spec.circle["inputs"][0]:
            t = t.movedim(1, -1).contiguous()
        operands.append(None if t is None else (Feed(t) if k == 0 else Const(t)))
    return operands, options, nhwc


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_fused_op_matches_torch_op_on_its_samples(name, dtype):
    """Every sample of every registry op that the Circle builtin can express, in the
    contract's input order and layout, against torch.ops.circle.<op>."""
    spec = REGISTRY[name]
    ran = 0
    for args, kwargs in spec.sample_inputs(dtype):
        sample = _circle_sample(spec, args, kwargs)
        if sample is None:
            continue
        operands, options, nhwc = sample
        expected = spec.op(*args, **kwargs)
        expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        if nhwc:
            expected = [e.movedim(1, -1).contiguous() for e in expected]
        model, feeds = one_op(spec.circle["builtin"], operands, expected, options, spec.circle["options"])
        got = Interpreter(model).run_torch(feeds)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape
            torch.testing.assert_close(g, e)  # same kernel: equal up to summation order
        ran += 1
    assert ran >= 2, f"only {ran} samples of {name} are expressible as the Circle builtin"


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_op_is_bit_exact_in_fp16(name):
    named, options, expected = CASES[name](torch.float16)
    model, feeds = circle_model(name, named, options, expected)
    for g, e in zip(Interpreter(model).run_torch(feeds), expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_fused_ops_fp32_match_fp64_torch_within_1e4():
    """The ATTENTION and INSTANCE_NORM Circle layouts against an fp64 torch computation."""
    for name in ("attention", "instance_norm"):
        named, options, expected = CASES[name](torch.float32)
        model, feeds = circle_model(name, named, options, expected)
        got = Interpreter(model).run_torch(feeds)
        named64, _, expected64 = CASES[name](torch.float64)
        for g, e in zip(got, expected64):
            assert (g.double() - e).abs().max().item() < 1e-4


def test_rope_gpt_j_mode():
    named, options, expected = _rope(torch.float32, mode="gpt_j")
    model, feeds = circle_model("rope", named, options, expected)
    torch.testing.assert_close(Interpreter(model).run_torch(feeds)[0], expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("name,case", [("rms_norm", lambda: _rms_norm(torch.float32)),
                                       ("rope", lambda: _rope(torch.float32, seq=1, table_rank=4))])
def test_fused_op_matches_onert(tmp_path, name, case):
    """onert runs RMS_NORM and ROPE (one position): the interpreter agrees within 1e-5."""
    named, options, expected = case()
    model, feeds = circle_model(name, named, options, expected)
    ours = Interpreter(model).run(feeds)
    real = write_and_run(model, [f.numpy() for f in feeds], "circle", tmp_path / f"{name}.circle")
    for o, r in zip(ours, real):
        np.testing.assert_allclose(o, r, atol=1e-5, rtol=0)


def _composite_rms_norm(eps: float) -> tuple[ir.Model, np.ndarray, np.ndarray]:
    """STABLEHLO_COMPOSITE odml.rms_norm whose decomposition subgraph is MUL/MEAN/ADD/RSQRT/MUL/MUL."""
    gamma = np.linspace(0.5, 1.5, 8).astype(np.float32)
    main = ir.Subgraph("main")
    x = main.add_tensor(ir.Tensor("x", (2, 8), "FLOAT32"))
    g = main.add_tensor(ir.Tensor("gamma", (8,), "FLOAT32", gamma))
    y = main.add_tensor(ir.Tensor("y", (2, 8), "FLOAT32"))
    main.operators.append(ir.Operator("STABLEHLO_COMPOSITE", [x, g], [y], "StableHLOCompositeOptions",
                                      {"name": "odml.rms_norm", "decompositionSubgraphIndex": 1,
                                       "compositeAttributes": {"epsilon": eps}, "version": 0}))
    main.inputs, main.outputs = [x], [y]
    dec = ir.Subgraph("decomposition")
    t = lambda n, shape, data=None, dt="FLOAT32": dec.add_tensor(ir.Tensor(n, shape, dt, data))  # noqa: E731
    a, w = t("x", (2, 8)), t("w", (8,))
    sq, ms, mse, r, n, o = t("sq", (2, 8)), t("ms", (2, 1)), t("mse", (2, 1)), t("r", (2, 1)), t("n", (2, 8)), t("o", (2, 8))
    axis, e = t("axis", (1,), np.array([-1], np.int32), "INT32"), t("eps", (1,), np.array([eps], np.float32))
    dec.operators += [
        ir.Operator("MUL", [a, a], [sq], "MulOptions", {}),
        ir.Operator("MEAN", [sq, axis], [ms], "ReducerOptions", {"keepDims": True}),
        ir.Operator("ADD", [ms, e], [mse], "AddOptions", {}),
        ir.Operator("RSQRT", [mse], [r]),
        ir.Operator("MUL", [a, r], [n], "MulOptions", {}),
        ir.Operator("MUL", [n, w], [o], "MulOptions", {}),
    ]
    dec.inputs, dec.outputs = [a, w], [o]
    xv = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32) * 10
    return ir.Model([main, dec]), xv, gamma


def test_composite_runs_its_decomposition_like_litert(tmp_path):
    model, xv, gamma = _composite_rms_norm(1e-6)
    (ours,) = Interpreter(model).run([xv])
    want = xv / np.sqrt((xv * xv).mean(-1, keepdims=True) + 1e-6) * gamma
    np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-6)
    (real,) = write_and_run(model, [xv], "tflite", tmp_path / "composite.tflite")
    np.testing.assert_allclose(ours, real, rtol=0, atol=1e-5)


def test_attention_with_one_output_updates_the_caches_in_place():
    """ONE's ATTENTION declares one output and writes k/v into the cache tensors: graph
    outputs that name the cache tensors see the updated caches, the caller's arrays do not change."""
    named, options, expected = _attention(torch.float32)
    model, feeds = circle_model("attention", named, options, expected[:1])
    sg = model.subgraphs[0]
    op = sg.operators[0]
    sg.outputs = [op.outputs[0], op.inputs[8], op.inputs[9]]
    before = [f.clone() for f in feeds]
    got = Interpreter(model).run_torch(feeds)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    for f, b in zip(feeds, before):
        assert torch.equal(f, b)
