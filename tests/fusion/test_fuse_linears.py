"""Sibling linears (circleops.passes.fuse_linears): FULLY_CONNECTED ops reading one input
with GGML weights become one FULLY_CONNECTED + a split, bit for bit the same outputs on onert
and the reference interpreter; what must stay apart stays apart; convert and convert_graphs
write the fused form for target onert (q/k/v and gate/up: 7 GGML calls per layer -> 4)."""
from __future__ import annotations

import copy

import numpy as np
import pytest

import circleops
from circleops import ir
from circleops.passes import fuse_linears
from circleops.passes.fuse_linears import fuse_for_target, fuse_sibling_linears, fused_name
from circleops.quantize import ggml
from circleops.runtime import onert, reference
from onert_host import ONERT_RUNS_GGML, assert_onert_refuses
from circleops.serialize import read_model, write_model
from families import BY_NAME, example_ids

rng = np.random.default_rng(0)


def _weight(dtype: str, n: int, k: int) -> np.ndarray:
    w = rng.standard_normal((n, k)).astype(np.float32)
    return w if dtype == "FLOAT32" else ggml.quantize(w, dtype)


def _siblings() -> tuple[ir.Model, dict[str, int]]:
    """x [3, 64] read by: q4 a [64], b [32], c [32] (fusable, unequal sizes); q8 d, e [48]
    (fusable, equal); f fp32; g with a RELU; h with a bias; t whose weight a GATHER also
    reads (tied). y [3, 64] read by one more q4 linear (another input)."""
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (3, 64), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("y", (3, 64), "FLOAT32"))
    ids = sg.add_tensor(ir.Tensor("ids", (2,), "INT32", np.array([0, 5], np.int32)))
    outs: dict[str, int] = {}

    def fc(name, src, dtype, n, act=0, bias=False):
        w = sg.add_tensor(ir.Tensor(f"layer.{name}_proj.weight", (n, 64), dtype, _weight(dtype, n, 64)))
        b = sg.add_tensor(ir.Tensor(f"{name}.bias", (n,), "FLOAT32", rng.standard_normal(n).astype(np.float32))) \
            if bias else -1
        out = outs[name] = sg.add_tensor(ir.Tensor(name, (3, n), "FLOAT32"))
        sg.operators.append(ir.Operator("FULLY_CONNECTED", [src, w, b], [out], "FullyConnectedOptions",
                                        {"fusedActivationFunction": act, "keepNumDims": False}))
        return w

    for name, dtype, n in [("a", "GGML_Q4_0", 64), ("d", "GGML_Q8_0", 48), ("b", "GGML_Q4_0", 32),
                           ("c", "GGML_Q4_0", 32), ("e", "GGML_Q8_0", 48)]:
        fc(name, x, dtype, n)
    fc("f", x, "FLOAT32", 16)
    fc("g", x, "FLOAT32", 16, act=1)
    fc("h", x, "FLOAT32", 16, bias=True)
    tied = fc("t", x, "FLOAT32", 16)
    outs["rows"] = sg.add_tensor(ir.Tensor("rows", (2, 64), "FLOAT32"))
    sg.operators.append(ir.Operator("GATHER", [tied, ids], [outs["rows"]], "GatherOptions", {"axis": 0}))
    fc("other", y, "GGML_Q4_0", 32)
    sg.inputs, sg.outputs = [x, y], list(outs.values())
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x, "y": y},
                                        {k: v for k, v in outs.items()})]), outs


def _fc_weights(model: ir.Model) -> list[str]:
    sg = model.subgraphs[0]
    return sorted(sg.tensors[op.inputs[1]].name for op in sg.operators if op.opcode == "FULLY_CONNECTED")


def _run_both(path, inputs):
    """(onert's outputs, or None where this CPU cannot run GGML and onert refuses the file), the interpreter's."""
    if not ONERT_RUNS_GGML:
        assert_onert_refuses(path)
    return (onert.run(path, inputs) if ONERT_RUNS_GGML else None), reference.run(path, inputs)


def test_fuses_ggml_siblings_only(tmp_path):
    model, _ = _siblings()
    inputs = [rng.standard_normal((3, 64)).astype(np.float32) * 2 for _ in range(2)]
    write_model(model, tmp_path / "before.circle", "circle")
    report = fuse_sibling_linears(model)
    assert sorted(parts for _, parts in report.groups) == [
        ["layer.a_proj.weight", "layer.b_proj.weight", "layer.c_proj.weight"],
        ["layer.d_proj.weight", "layer.e_proj.weight"]]
    assert report.removed == 3
    assert _fc_weights(model) == sorted(["layer.{a,b,c}_proj.weight", "layer.{d,e}_proj.weight", "layer.f_proj.weight",
                                         "layer.g_proj.weight", "layer.h_proj.weight", "layer.t_proj.weight",
                                         "layer.other_proj.weight"])
    sg = model.subgraphs[0]
    ops = [op.opcode for op in sg.operators]
    assert ops.count("SPLIT") == 1 and ops.count("STRIDED_SLICE") == 3 and "SPLIT_V" not in ops
    fused = {sg.tensors[op.inputs[1]].name: sg.tensors[op.inputs[1]] for op in sg.operators
             if op.opcode == "FULLY_CONNECTED"}
    assert fused["layer.{a,b,c}_proj.weight"].shape == (128, 64)
    assert fused["layer.{d,e}_proj.weight"].shape == (96, 64) and fused["layer.{d,e}_proj.weight"].dtype == "GGML_Q8_0"
    assert not any(t.name in ("layer.a_proj.weight", "layer.d_proj.weight") for t in sg.tensors)  # pruned
    write_model(model, tmp_path / "after.circle", "circle")
    (before_onert, before_ref), (after_onert, after_ref) = (
        _run_both(tmp_path / f"{n}.circle", inputs) for n in ("before", "after"))
    for want, got in zip(before_onert or [], after_onert or []):
        np.testing.assert_array_equal(got, want)  # GGML rows are independent: bit for bit
    for want, got in zip(before_ref, after_ref):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, float(np.abs(want).max())))


def test_float_siblings_when_asked():
    model, _ = _siblings()
    report = fuse_sibling_linears(model, {"FLOAT32"})
    # f and the tied t read x with fp32 weights; g (activation), h (bias) and t (a GATHER
    # reads its weight) stay: nothing left to pair f with
    assert report.groups == []
    model, _ = _siblings()
    sg = model.subgraphs[0]
    sg.operators = [op for op in sg.operators if op.opcode != "GATHER"]
    sg.outputs = [o for o in sg.outputs if sg.tensors[o].name != "rows"]
    model.signatures = []
    report = fuse_sibling_linears(model, {"FLOAT32"})
    assert [parts for _, parts in report.groups] == [["layer.f_proj.weight", "layer.t_proj.weight"]]


def test_float_1x1_convs_with_biases(tmp_path):
    """Target onert's multi-row linear form (1x1 CONV_2D, a bias always present: one zero
    bias shared, one real): filters and biases concatenated, outputs as before."""
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, 1, 5, 64), "FLOAT32"))
    zero = sg.add_tensor(ir.Tensor("zero", (32,), "FLOAT32", np.zeros(32, np.float32)))
    outs = []
    for name, n, bias in [("a", 32, zero), ("b", 32, zero), ("c", 32, None), ("s", 32, zero)]:
        w = sg.add_tensor(ir.Tensor(f"{name}.weight", (n, 1, 1, 64), "FLOAT32",
                                    rng.standard_normal((n, 1, 1, 64)).astype(np.float32)))
        if bias is None:
            bias = sg.add_tensor(ir.Tensor("c.bias", (n,), "FLOAT32", rng.standard_normal(n).astype(np.float32)))
        stride = 2 if name == "s" else 1  # not a linear: stays
        outs.append(sg.add_tensor(ir.Tensor(name, (1, 1, 5 if stride == 1 else 3, n), "FLOAT32")))
        sg.operators.append(ir.Operator("CONV_2D", [x, w, bias], [outs[-1]], "Conv2DOptions", {
            "padding": "VALID", "strideW": stride, "strideH": 1, "dilationWFactor": 1, "dilationHFactor": 1}))
    sg.inputs, sg.outputs = [x], outs
    model = ir.Model([sg])
    write_model(model, tmp_path / "before.circle", "circle")
    assert fuse_sibling_linears(model).removed == 0  # fp32: only when asked
    report = fuse_sibling_linears(model, {"FLOAT32"})
    assert [parts for _, parts in report.groups] == [["a.weight", "b.weight", "c.weight"]]
    convs = [op for op in model.subgraphs[0].operators if op.opcode == "CONV_2D"]
    assert len(convs) == 2 and model.subgraphs[0].tensors[convs[0].inputs[1]].shape == (96, 1, 1, 64)
    write_model(model, tmp_path / "after.circle", "circle")
    v = [rng.standard_normal((1, 1, 5, 64)).astype(np.float32)]
    for runtime in (onert, reference):
        for want, got in zip(runtime.run(tmp_path / "before.circle", v), runtime.run(tmp_path / "after.circle", v)):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))


def test_split_v_where_the_runtime_runs_it(tmp_path):
    model, _ = _siblings()
    inputs = [rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2)]
    write_model(model, tmp_path / "before.circle", "circle")
    fuse_sibling_linears(model, split_v=True)
    ops = [op.opcode for op in model.subgraphs[0].operators]
    assert ops.count("SPLIT_V") == 1 and "STRIDED_SLICE" not in ops
    write_model(model, tmp_path / "after.circle", "circle")
    before, after = (reference.run(tmp_path / f"{n}.circle", inputs) for n in ("before", "after"))
    for want, got in zip(before, after):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, float(np.abs(want).max())))


def test_targets_choose():
    for target, removed in [("onert", 3), ("circle", 0), ("tflite", 0)]:
        model, _ = _siblings()
        assert fuse_for_target(model, target).removed == removed


def test_fused_names():
    assert fused_name(["m.layers.0.self_attn.q_proj.weight", "m.layers.0.self_attn.k_proj.weight",
                       "m.layers.0.self_attn.v_proj.weight"]) == "m.layers.0.self_attn.{q,k,v}_proj.weight"
    assert fused_name(["w", "w"]) == "w+w"


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


def _unfused(monkeypatch):
    monkeypatch.setattr(fuse_linears, "fuse_for_target", lambda model, target, cache=None: fuse_linears.FusedLinears())


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_convert_writes_fused_linears_with_the_same_logits(tmp_path, llama, fmt, monkeypatch):
    ids = example_ids(8)
    fused = circleops.convert(llama, (ids,), tmp_path / "fused.circle", target="onert", quantize=fmt, verify=True)
    with monkeypatch.context() as m:
        _unfused(m)
        plain = circleops.convert(llama, (ids,), tmp_path / "plain.circle", target="onert", quantize=fmt)
    layers = llama.config.num_hidden_layers
    assert plain.ops["FULLY_CONNECTED"] == 7 * layers + 1
    assert fused.ops["FULLY_CONNECTED"] == 4 * layers + 1  # q/k/v -> 1, gate/up -> 1
    assert fused.ops["SPLIT"] == layers  # gate/up: equal halves; q/k/v (GQA) three STRIDED_SLICEs
    assert fused.verify.passed
    # the report still names every quantized weight
    assert [w.name for w in fused.quantization.weights] == [w.name for w in plain.quantization.weights]
    names = {t.name for t in read_model(tmp_path / "fused.circle").subgraphs[0].tensors}
    assert "model.model.layers.0.mlp.{gate,up}_proj.weight" in names
    x = [ids.numpy()]
    (want_onert, want_ref), (got_onert, got_ref) = (
        _run_both(tmp_path / f"{n}.circle", x) for n in ("plain", "fused"))
    if ONERT_RUNS_GGML:
        np.testing.assert_array_equal(got_onert[0], want_onert[0])
    np.testing.assert_allclose(got_ref[0], want_ref[0], rtol=0, atol=1e-5 * float(np.abs(want_ref[0]).max()))


def test_graphs_generate_the_same_tokens(tmp_path, llama, monkeypatch):
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest

    kw = dict(target="onert", prefill_len=8, max_cache_len=32, quantize="q4_0")
    convert_graphs(copy.deepcopy(llama), tmp_path / "fused", **kw)
    with monkeypatch.context() as m:
        _unfused(m)
        convert_graphs(copy.deepcopy(llama), tmp_path / "plain", **kw)
    tokens = {}
    for name in ("fused", "plain"):
        manifest = read_manifest(tmp_path / name)
        fcs = [sum(op.opcode == "FULLY_CONNECTED" for op in read_model(manifest.path(g)).subgraphs[0].operators)
               for g in ("prefill", "decode")]
        assert fcs == [(4 if name == "fused" else 7) * llama.config.num_hidden_layers + 1] * 2
        tokens[name] = Generator(manifest).generate([5, 17, 42], 8).tokens
    assert tokens["fused"] == tokens["plain"]


def test_shared_fused_weight_between_graphs(tmp_path, llama):
    """prefill and decode share their GGML blocks, so they share each fused weight too."""
    import circleops.recipes.llm as graphs

    seen = []
    real = fuse_linears.fuse_sibling_linears

    def spy(model, dtypes, *, split_v=False, cache=None):
        out = real(model, dtypes, split_v=split_v, cache=cache)
        seen.append({t.name: t.data for t in model.subgraphs[0].tensors if "{" in t.name})
        return out

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(fuse_linears, "fuse_sibling_linears", spy)
        graphs.convert_graphs(copy.deepcopy(llama), tmp_path / "g", target="onert", prefill_len=8, max_cache_len=16,
                              quantize="q8_0")
    finally:
        mp.undo()
    prefill, decode = seen
    assert prefill.keys() == decode.keys() and prefill
    assert all(prefill[k] is decode[k] for k in prefill)


# ----------------------------------------------------------------------------- LiteRT's hybrid linears
def _hybrid_siblings() -> ir.Model:
    """x [3, 64] read by INT4 blockwise (blocks of 32) linears q [64], k [32], v [32] (unequal:
    STRIDED_SLICE), INT8 per-channel g, u [48] (equal: SPLIT), an INT4 one in blocks of 64 (its
    own group) and one INT4 linear of another input: what `--target tflite --quantize int4|w8`
    writes for a Llama block's q/k/v and gate/up."""
    from circleops.quantize import int4, int8
    from circleops.quantize.int4_tflite import weight_tensor

    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (3, 64), "FLOAT32"))
    y = sg.add_tensor(ir.Tensor("y", (3, 64), "FLOAT32"))
    outs = []
    for name, src, n, form in [("q", x, 64, 32), ("g", x, 48, "int8"), ("k", x, 32, 32), ("v", x, 32, 32),
                               ("u", x, 48, "int8"), ("b64", x, 16, 64), ("other", y, 32, 32)]:
        w = rng.standard_normal((n, 64)).astype(np.float32) * rng.uniform(0.3, 3.0, (n, 1)).astype(np.float32)
        packed = int8.quantize_per_channel(w) if form == "int8" else int4.quantize(w, form)
        wi = sg.add_tensor(weight_tensor(f"layer.{name}_proj.weight", (n, 64), packed))
        outs.append(sg.add_tensor(ir.Tensor(name, (3, n), "FLOAT32")))
        sg.operators.append(ir.Operator("FULLY_CONNECTED", [src, wi, -1], [outs[-1]], "FullyConnectedOptions",
                                        {"fusedActivationFunction": 0, "keepNumDims": False},
                                        5 if form == "int8" else 13))
    sg.inputs, sg.outputs = [x, y], outs
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x, "y": y},
                                        {sg.tensors[o].name: o for o in outs})])


def test_fuses_litert_hybrid_siblings(tmp_path):
    """INT4 blockwise and INT8 per-channel weights of linears reading one float input become
    one FULLY_CONNECTED each (rows, per-row scales and block scales concatenated) for target
    tflite, and LiteRT (XNNPACK) and the reference interpreter compute the same outputs as
    before: each output row reads its own weight row and scales, and the input's dynamic int8
    rounding is per input row, the same for every part."""
    from circleops.runtime import litert

    model = _hybrid_siblings()
    inputs = [rng.standard_normal((3, 64)).astype(np.float32) * 2 for _ in range(2)]
    write_model(model, tmp_path / "before.tflite", "tflite")
    report = fuse_for_target(model, "tflite")
    assert sorted(parts for _, parts in report.groups) == [
        ["layer.g_proj.weight", "layer.u_proj.weight"],
        ["layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight"]]
    sg = model.subgraphs[0]
    ops = [op.opcode for op in sg.operators]
    assert ops.count("FULLY_CONNECTED") == 4 and ops.count("SPLIT") == 1 and ops.count("STRIDED_SLICE") == 3
    fused = {sg.tensors[op.inputs[1]].name: sg.tensors[op.inputs[1]] for op in sg.operators
             if op.opcode == "FULLY_CONNECTED"}
    qkv = fused["layer.{q,k,v}_proj.weight"]
    assert qkv.dtype == "INT4" and qkv.shape == (128, 64)
    assert qkv.quant.blockwise.block_size == 32 and qkv.quant.blockwise.scales.shape == (128, 2)
    assert fused["layer.{g,u}_proj.weight"].quant.scale.shape == (96,)
    write_model(model, tmp_path / "after.tflite", "tflite")
    for runtime in (litert, reference):
        before, after = (runtime.run(tmp_path / f"{n}.tflite", inputs) for n in ("before", "after"))
        for want, got in zip(before, after):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, float(np.abs(want).max())))


def test_integer_linears_stay_apart():
    """An integer FULLY_CONNECTED (quantized input and output: its output parameters are its
    own) is not a hybrid linear: two reading one input stay two."""
    model = _hybrid_siblings()
    sg = model.subgraphs[0]
    x = sg.tensors[sg.inputs[0]]
    x.dtype, x.quant = "INT8", ir.QuantParams(np.array([0.05], np.float32), np.array([0]), 0)
    for op in sg.operators:
        if op.inputs[0] == sg.inputs[0]:
            out = sg.tensors[op.outputs[0]]
            out.dtype, out.quant = "INT8", ir.QuantParams(np.array([0.1], np.float32), np.array([0]), 0)
    assert fuse_for_target(model, "tflite").removed == 0
