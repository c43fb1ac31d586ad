"""--quantize w8: int8 per-channel linear weights for onert's hybrid FULLY_CONNECTED (float input
and output, INT8 weight with scale [1.0]) followed by a MUL by the channel scales. The packing,
the reference interpreter's hybrid kernel against onert (which runs it on any x86-64, so these
run on a CPU without AVX-512 too), convert / convert_graphs / generate with verify, and what the
files hold."""
from __future__ import annotations

import contextlib
import copy
import os
import sys

import numpy as np
import pytest
import torch

import circleops
from circleops import ir
from circleops.errors import TargetError
from circleops.quantize import int8
from circleops.quantize.weights import dequantized_sources
from circleops.runtime import reference
from circleops.serialize import read_model, write_model
from families import BY_NAME, example_ids

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "convert"))
from convert_fixtures import llama_config, llama_model  # noqa: E402,F401

# Whole models: onert and the interpreter quantize each linear's input per row, so a 1-ulp
# difference upstream (an RMS_NORM's or a softmax's summation order) can move one input value
# across a rounding boundary and that row's outputs by one quantum of the input, about
# max|x_row|/127 x |w| (as for GGML weights: conftest's GGML_CROSS_CHECK_ATOL). Measured on the
# tiny Llama's 64-token logits file of test_cli_check_w8: 1 row of 64 off by 1.5e-3 (of
# max(1, max|y|)), the 63 others equal. Fed the same input, the two agree within 1e-5 at the
# output's scale: test_interpreter_hybrid_fc_equals_onert checks that on its own.
CROSS_CHECK_ATOL = 1e-2


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


def _ops(sg, opcode):
    return [op for op in sg.operators if op.opcode == opcode]


# ----------------------------------------------------------------------------- packing
@pytest.mark.parametrize("shape", [(64, 40), (7, 576), (300, 33)])
def test_packing_round_trip(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    w[0] = 0  # an all-zero row: scale 1, values 0
    w[1, 5] = -w[1].abs().max() * 2  # the row's largest magnitude is negative
    packed = int8.quantize_per_channel(w)
    q, s = packed.q, packed.scale
    assert q.dtype == np.int8 and q.shape == shape and s.dtype == np.float32 and s.shape == (shape[0],)
    assert q.min() >= -127 and q.max() <= 127
    assert s[0] == 1 and not q[0].any() and q[1, 5] == -127
    assert (np.abs(q[1:]).max(1) == 127).all()  # each row's largest magnitude maps to +-127
    deq = int8.dequantize(packed)
    err = (deq - w).abs().max(1).values
    assert (err <= torch.from_numpy(s) * 0.5 * (1 + 1e-5)).all()  # half a step per row
    out = torch.empty(shape)
    assert torch.equal(int8.dequantize_into(packed, out), deq)
    assert packed.nbytes == shape[0] * shape[1] + 4 * shape[0]


def test_rounding_is_half_away_from_zero():
    w = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5, 0.0]])  # scale 1
    assert int8.quantize_per_channel(w).q.tolist() == [[127, 1, -1, 2, -3, 0]]
    xq, sx = int8.quantize_rows(torch.tensor([[254.0, 1.0, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0]]))  # scale 2
    assert xq.tolist() == [[127, 1, -1, 2], [0, 0, 0, 0]] and sx.flatten().tolist() == [2.0, 1.0]


# ----------------------------------------------------------------------------- the kernel vs onert
def _hybrid_fc_file(path, packed: int8.Int8Weight, rows: int, bias: np.ndarray | None = None) -> None:
    """x [rows, K] -> hybrid FULLY_CONNECTED (INT8 weight, scale [1.0]) -> MUL by the scales."""
    n, k = packed.q.shape
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, k), "FLOAT32"))
    w = sg.add_tensor(ir.Tensor("w", (n, k), "INT8", packed.q, ir.QuantParams(np.ones(1, np.float32),
                                                                                np.zeros(1, np.int64))))
    b = -1 if bias is None else sg.add_tensor(ir.Tensor("b", (n,), "FLOAT32", bias.astype(np.float32)))
    y = sg.add_tensor(ir.Tensor("y", (rows, n), "FLOAT32"))
    s = sg.add_tensor(ir.Tensor("s", (n,), "FLOAT32", packed.scale))
    z = sg.add_tensor(ir.Tensor("z", (rows, n), "FLOAT32"))
    opts = {"fusedActivationFunction": 0}
    sg.operators += [ir.Operator("FULLY_CONNECTED", [x, w, b], [y], "FullyConnectedOptions",
                                 {**opts, "keepNumDims": False}),
                     ir.Operator("MUL", [y, s], [z], "MulOptions", opts)]
    sg.inputs, sg.outputs = [x], [z]
    write_model(ir.Model([sg]), str(path), "circle")


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n,k", [(96, 64), (1536, 576), (576, 1536)])
def test_interpreter_hybrid_fc_equals_onert(tmp_path, rows, n, k):
    pytest.importorskip("onert")
    from circleops.runtime import onert

    rng = np.random.default_rng(rows * 7 + n)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.2, 3.0, (n, 1)) / np.sqrt(k)).astype(np.float32)
    packed = int8.quantize_per_channel(w)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    x[:, :3] *= 8  # outlier features, as in an LLM's activations
    path = tmp_path / "fc.circle"
    _hybrid_fc_file(path, packed, rows)
    got = onert.Session(str(path)).run([x])[0]
    ref = reference.run(path, [x])[0]
    scale = float(np.abs(got).max())
    np.testing.assert_allclose(ref, got, atol=1e-5 * scale, rtol=0)
    # and both are the dequantized product up to the input's rounding: half a step
    # (max|x_row| / 127) per input value, times the weight row's absolute sum
    wd = int8.dequantize(packed).double().numpy()
    deq = x.astype(np.float64) @ wd.T
    bound = 0.5 * np.abs(x).max(1, keepdims=True) / 127 * np.abs(wd).sum(1)[None, :]
    assert (np.abs(got - deq) <= bound * (1 + 1e-4) + 1e-6 * scale).all()


def _per_channel_fc_file(path, packed: int8.Int8Weight, rows: int, zero_points: np.ndarray | None = None) -> None:
    """x [rows, K] -> FULLY_CONNECTED with an INT8 weight carrying its per-channel scales
    (TFLite's dynamic-range form, what --quantize w8 --target tflite writes)."""
    n, k = packed.q.shape
    zp = np.zeros(n, np.int64) if zero_points is None else zero_points
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, k), "FLOAT32"))
    w = sg.add_tensor(ir.Tensor("w", (n, k), "INT8", packed.q, ir.QuantParams(packed.scale, zp)))
    y = sg.add_tensor(ir.Tensor("y", (rows, n), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": 0, "keepNumDims": False}, 5))
    sg.inputs, sg.outputs = [x], [y]
    write_model(ir.Model([sg]), str(path), path.suffix[1:])


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n,k", [(96, 64), (1536, 576), (576, 1536)])
def test_interpreter_per_channel_fc_equals_litert(tmp_path, rows, n, k):
    """LiteRT's XNNPACK delegate quantizes each input row asymmetrically (its qd8 products);
    the interpreter computes that (int8.dynamic_range_linear). LiteRT's builtin kernel, without
    XNNPACK, rounds rows symmetrically as onert does (int8.hybrid_linear): pinned here too."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    rng = np.random.default_rng(rows * 7 + n)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.2, 3.0, (n, 1)) / np.sqrt(k)).astype(np.float32)
    packed = int8.quantize_per_channel(w)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    x[:, :3] *= 8  # outlier features, as in an LLM's activations
    x[-1] += 2.0  # a row far from symmetric: the two roundings differ there
    path = tmp_path / "fc.tflite"
    _per_channel_fc_file(path, packed, rows)

    def litert(resolver):
        it = Interpreter(model_path=str(path), num_threads=1, experimental_op_resolver_type=resolver)
        it.allocate_tensors()
        it.set_tensor(it.get_input_details()[0]["index"], x)
        it.invoke()
        return it.get_tensor(it.get_output_details()[0]["index"])

    xnnpack, builtin = litert(OpResolverType.AUTO), litert(OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    ref = reference.run(path, [x])[0]
    scale = float(np.abs(xnnpack).max())
    np.testing.assert_allclose(ref, xnnpack, atol=1e-5 * scale, rtol=0)
    symmetric = int8.hybrid_linear(torch.from_numpy(x), torch.from_numpy(packed.q)).numpy() * packed.scale
    np.testing.assert_allclose(builtin, symmetric, atol=1e-5 * scale, rtol=0)
    assert np.abs(xnnpack - builtin).max() > 1e-4 * scale  # the two really round differently
    # both are the dequantized product up to the input's rounding: half a step per value
    # (symmetric: max|x_row| / 127; asymmetric: the row's range / 255) times |w|'s row sum
    wd = int8.dequantize(packed).double().numpy()
    deq = x.astype(np.float64) @ wd.T
    bound = 0.5 * np.abs(x).max(1, keepdims=True) / 127 * np.abs(wd).sum(1)[None, :]
    assert (np.abs(xnnpack - deq) <= bound * (1 + 1e-4) + 1e-6 * scale).all()


def test_interpreter_refuses_other_hybrid_scales(tmp_path):
    """Neither onert's one scale nor LiteRT's scale per channel with zero points 0: refused,
    not computed one way or another."""
    packed = int8.quantize_per_channel(torch.randn(8, 32))
    _per_channel_fc_file(tmp_path / "pc.circle", packed, 1, zero_points=np.arange(8, dtype=np.int64))
    with pytest.raises(Exception, match="only scale"):
        reference.run(tmp_path / "pc.circle", [np.ones((1, 32), np.float32)])


# ----------------------------------------------------------------------------- convert
def _check_w8_layout(path):
    """Every FULLY_CONNECTED weight is INT8 with scale [1.0] and zero point 0, read by a MUL by
    a FLOAT32 [N] constant; no GGML tensor; the embedding table stays FLOAT32."""
    sg = read_model(str(path)).subgraphs[0]
    fcs = _ops(sg, "FULLY_CONNECTED")
    assert fcs and not _ops(sg, "CONV_2D")
    assert not [t.name for t in sg.tensors if t.dtype in ir.GGML_BLOCKS]
    readers = {i: op for op in sg.operators for i in op.inputs}
    for op in fcs:
        w = sg.tensors[op.inputs[1]]
        assert w.dtype == "INT8" and list(w.quant.scale) == [1.0] and list(w.quant.zero_point) == [0], w.name
        assert len(op.inputs) < 3 or op.inputs[2] == -1
        assert op.options.get("fusedActivationFunction", 0) == 0
        mul = readers[op.outputs[0]]
        assert mul.opcode == "MUL"
        s = sg.tensors[mul.inputs[1]]
        assert s.dtype == "FLOAT32" and tuple(s.shape) == (w.shape[0],) and s.data is not None
    (gather,) = [op for op in _ops(sg, "GATHER") if sg.tensors[op.inputs[0]].data is not None]
    assert sg.tensors[gather.inputs[0]].dtype == "FLOAT32"
    return sg


@pytest.mark.parametrize("target", ["onert", "circle"])
def test_convert_w8_runs_and_verifies(tmp_path, llama, target):
    ids = example_ids(8)
    before = {k: v.clone() for k, v in llama.state_dict().items()}
    path = tmp_path / "m.circle"
    report = circleops.convert(llama, (ids,), path, target=target, quantize="w8", verify=True)
    assert report.verify.passed and report.verify.runtime == ("onert" if target == "onert" else "reference")
    _check_w8_layout(path)
    q = report.quantization
    attention = 4 * 2 if target == "circle" else 0  # Circle's fused ATTENTION keeps its float weights
    assert q.format == "w8" and len(q.weights) == 2 * 7 + 1 - attention and q.embedding is None
    assert all(w.dtype == "INT8" for w in q.weights) and not q.higher_precision
    assert "as INT8 per channel" in report.summary()
    assert all(torch.equal(v, llama.state_dict()[k]) for k, v in before.items())
    fp32 = tmp_path / "fp32.circle"
    circleops.convert(llama, (ids,), fp32, target=target)
    # the tiny model's embedding (256 x 64) stays fp32 and weighs as much as a layer
    assert path.stat().st_size / fp32.stat().st_size < (0.55 if target == "onert" else 0.75)


def test_tied_lm_head_gets_its_own_int8_weight(tmp_path):
    model = BY_NAME["llama"].build(tie_word_embeddings=True)
    path = tmp_path / "m.circle"
    report = circleops.convert(model, (example_ids(8),), path, target="onert", quantize="w8", verify=True)
    sg = _check_w8_layout(path)
    (gather,) = _ops(sg, "GATHER")
    table, head = sg.tensors[gather.inputs[0]], sg.tensors[_ops(sg, "FULLY_CONNECTED")[-1].inputs[1]]
    assert (table.dtype, head.dtype) == ("FLOAT32", "INT8") and head.name.endswith("_int8")
    # verify's torch reference runs the dequantized head and the fp32 table, as the file does
    assert report.verify.passed
    embed, lm = model.model.embed_tokens, model.lm_head
    fp32 = embed.weight.detach().clone()
    seen: dict = {}  # the weights each module runs with (decoded as its parent runs)
    hooks = [embed.register_forward_hook(lambda m, a, o: seen.update({"embed": m.weight.detach().clone()}) if "embed" not in seen else None),
             lm.register_forward_hook(lambda m, a, o: seen.update({"lm": m.weight.detach().clone()}) if "lm" not in seen else None)]
    with dequantized_sources(report.quantization, model), torch.no_grad():
        model(example_ids(8))
    for h in hooks:
        h.remove()
    assert torch.equal(seen["embed"], fp32)
    assert torch.equal(seen["lm"], int8.dequantize(int8.quantize_per_channel(fp32)))
    assert embed.weight is lm.weight and torch.equal(embed.weight, fp32)


@pytest.mark.parametrize("target", ["onert", "circle"])
def test_any_k_and_bias_after_the_scales(tmp_path, target, odd_linears):
    model = odd_linears
    path = tmp_path / "m.circle"
    report = circleops.convert(model, (torch.randn(6, 40),), path, target=target, quantize="w8", verify=True)
    assert not report.quantization.kept_fp32 and len(report.quantization.weights) == 3
    sg = read_model(str(path)).subgraphs[0]
    assert [sg.tensors[op.inputs[1]].dtype for op in _ops(sg, "FULLY_CONNECTED")] == ["INT8"] * 3
    # the bias is added after the MUL by the scales, then the ReLU
    order = [op.opcode for op in sg.operators if op.opcode in ("FULLY_CONNECTED", "MUL", "ADD", "RELU")]
    assert order[:3] == ["FULLY_CONNECTED", "MUL", "FULLY_CONNECTED"] and order[3:6] == ["MUL", "ADD", "RELU"]


@contextlib.contextmanager
def _as_onert_runs_w8(model: torch.nn.Module):
    """Inside: every nn.Linear of ``model`` computes as a w8 file's hybrid FULLY_CONNECTED + MUL:
    its current weight quantized here per output channel (int8.quantize_per_channel), each input
    row rounded to int8 (int8.hybrid_linear), then the scales. Yields {module name: packed}."""
    packed, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            p = packed[name] = int8.quantize_per_channel(mod.weight.detach())
            q, s = torch.from_numpy(p.q), torch.from_numpy(p.scale)

            def hybrid(mod, inputs, output, q=q, s=s):
                x = inputs[0]
                y = (int8.hybrid_linear(x.reshape(-1, x.shape[-1]), q) * s).reshape(*x.shape[:-1], -1)
                return y if mod.bias is None else y + mod.bias

            hooks.append(mod.register_forward_hook(hybrid))
    try:
        yield packed
    finally:
        for h in hooks:
            h.remove()


def _file_w8_weights(path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{weight tensor name: (int8 q, the MUL's scales)} of every FULLY_CONNECTED in a w8 file."""
    sg = _check_w8_layout(path)
    readers = {i: op for op in sg.operators for i in op.inputs}
    found = {}
    for op in _ops(sg, "FULLY_CONNECTED"):
        w, mul = sg.tensors[op.inputs[1]], readers[op.outputs[0]]
        found[w.name] = (np.asarray(w.data), np.asarray(sg.tensors[mul.inputs[1]].data))
    return found


def test_graphs_w8_generate(tmp_path, llama):
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest
    from circleops.quantize.smooth import smoothed

    out = tmp_path / "g"
    report = convert_graphs(copy.deepcopy(llama), out, target="onert", prefill_len=8, max_cache_len=32,
                            verify=True, quantize="w8")
    assert report.quantization.format == "w8" and "quantize:" in report.summary()
    manifest = read_manifest(out)
    assert manifest.quantize == "w8"
    prompt = [5, 17, 42]
    gen = Generator(manifest).generate(prompt, 6)
    assert gen.runtime == "onert" and (len(gen.tokens) == 6 or gen.stopped_at_eos)
    # The reference is torch computing what a w8 file should: the SmoothQuant fold on the
    # original weights (smoothed), every linear quantized here and run as onert's hybrid FC
    # (each input row rounded to int8). Against torch in fp32 with the file's dequantized
    # weights the generated tokens' logits sat up to 0.15 below the top (the input rounding,
    # different on every decode step, against a verify error of 0.18): a loose check. This one
    # equals onert's logits but where a 1-ulp difference upstream moves one input across a
    # rounding boundary: near-ties within CROSS_CHECK_ATOL of the logits' scale.
    ref = copy.deepcopy(llama)
    ids = torch.tensor([[*prompt, *gen.tokens]])
    with smoothed(ref) as fold, _as_onert_runs_w8(ref) as packed, torch.no_grad():
        assert fold.linears, fold.skipped
        logits = ref(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(gen.tokens)]
    # the files hold exactly those weights: the fold and the per-channel rounding, in both graphs
    for g in ("prefill", "decode"):
        held = _file_w8_weights(manifest.path(g))
        assert len(held) == len(packed), (g, sorted(held))
        for tensor_name, (q, scale) in held.items():
            module = tensor_name.removesuffix(".weight").removeprefix("model.")
            assert np.array_equal(q, packed[module].q) and np.array_equal(scale, packed[module].scale), \
                f"{g}: {tensor_name} is not the smoothed weight rounded per channel"
    gaps = [float(row.max() - row[t]) / max(1.0, float(row.abs().max())) for row, t in zip(logits, gen.tokens)]
    assert max(gaps) <= CROSS_CHECK_ATOL, f"w8: tokens {gen.tokens} off the emulated greedy by {gaps} (of the scale)"


def test_cli_convert_w8(capsys, tmp_path, llama_config):
    from circleops.cli import main

    out = tmp_path / "m.circle"
    code = main(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8", "--target", "onert",
                 "--quantize", "w8", "--verify"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verify:  onert: max abs error" in captured.out and "MISMATCH" not in captured.out
    _check_w8_layout(out)


def _check_w8_tflite_layout(path, subgraphs=None, tied=False):
    """TFLite's dynamic-range form (litert-torch's own int8 recipe writes the same): every
    FULLY_CONNECTED weight INT8 [N, K] carrying its N per-channel scales (quantized dimension 0,
    zero points 0), float input and output, no MUL after it; the scales are those of
    quantize_per_channel of the values they encode; the embedding table is INT8 with one scale
    per row too, read by an EMBEDDING_LOOKUP (LiteRT dequantizes its rows), no FLOAT32 copy of
    it in the file, and a tied head's FULLY_CONNECTED reads that same tensor."""
    from ai_edge_litert import schema_py_generated as S  # LiteRT's own reading of the file

    model = S.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    names = {v: k for k, v in vars(S.BuiltinOperator).items() if not k.startswith("_")}
    checked = 0
    for si in subgraphs if subgraphs is not None else [0]:
        sg = model.subgraphs[si]
        readers = {i: op for op in sg.operators for i in op.inputs}
        fc_weights, lookups = set(), []
        for op in sg.operators:
            code = model.operatorCodes[op.opcodeIndex]
            opname = names[max(code.builtinCode, code.deprecatedBuiltinCode)]
            assert opname != "GATHER" or sg.tensors[op.inputs[0]].buffer == 0 \
                or model.buffers[sg.tensors[op.inputs[0]].buffer].data is None, "a constant table GATHERed"
            if opname == "EMBEDDING_LOOKUP":
                lookups.append(op.inputs[1])
            if opname != "FULLY_CONNECTED":
                continue
            fc_weights.add(op.inputs[1])
            x, w, y = (sg.tensors[i] for i in (op.inputs[0], op.inputs[1], op.outputs[0]))
            assert (x.type, w.type, y.type) == (S.TensorType.FLOAT32, S.TensorType.INT8, S.TensorType.FLOAT32)
            assert code.version >= 5  # LiteRT's per-channel hybrid FULLY_CONNECTED
            n, k = (int(d) for d in w.shape)
            scale, zp = np.asarray(w.quantization.scale), np.asarray(w.quantization.zeroPoint)
            assert scale.shape == (n,) and zp.shape == (n,) and not zp.any() and w.quantization.quantizedDimension == 0
            q = np.frombuffer(bytes(model.buffers[w.buffer].data), np.int8).reshape(n, k)
            again = int8.quantize_per_channel(torch.from_numpy(q.astype(np.float32) * scale[:, None]))
            assert np.array_equal(again.q, q) and np.allclose(again.scale, scale, rtol=1e-6)
            nxt = readers.get(op.outputs[0])  # no MUL by constant channel scales (onert's form) after it
            if nxt is not None:
                other = [sg.tensors[i] for i in nxt.inputs if i != op.outputs[0]]
                assert not any(t.buffer and model.buffers[t.buffer].data is not None
                               and [int(d) for d in t.shape] == [n] for t in other), "a MUL by the scales"
            checked += 1
        tables = [t for t in sg.tensors if t.buffer and model.buffers[t.buffer].data is not None
                  and len(t.shape) == 2 and int(t.shape[0]) == 256 and int(t.shape[1]) == 64]
        assert tables and all(t.type == S.TensorType.INT8 for t in tables)  # the embedding table (and head)
        assert len(lookups) == 1
        table = sg.tensors[lookups[0]]
        assert table.type == S.TensorType.INT8 and np.asarray(table.quantization.scale).shape == (256,)
        if tied:  # one tensor for the lookup and the head
            assert lookups[0] in fc_weights
    assert checked
    return checked


def test_convert_w8_tflite_runs_in_litert(tmp_path, llama):
    """w8 on target tflite: LiteRT's dynamic-range FULLY_CONNECTED (per-channel scales in the
    weight), verified in LiteRT against torch on the dequantized (SmoothQuant-folded) weights."""
    from circleops.quantize.smooth import smoothed
    from circleops.runtime import litert

    ids = example_ids(8)
    path = tmp_path / "m.tflite"
    report = circleops.convert(llama, (ids,), path, target="tflite", quantize="w8", verify=True)
    assert report.verify.passed and report.verify.runtime == "litert"
    # gate, up, down per layer and lm_head; the circle.attention composite takes wq/wk/wv/wo as
    # float inputs (its interface): kept FLOAT32 and named (generation graphs write attention inline)
    assert _check_w8_tflite_layout(path) == 2 * 2 + 1  # per layer gate/up fused (passes.fuse_linears), down; head
    q = report.quantization
    # and the embedding table (int8 rows, untied here)
    assert q.form == "per_channel" and len(q.weights) == 2 * 3 + 2 and all(w.dtype == "INT8" for w in q.weights)
    assert len(q.kept_fp32) == 2 * 4 and all("circle.attention composite" in why for _, _, why in q.kept_fp32)
    assert "dynamic-range FULLY_CONNECTED" in report.summary()
    got = litert.run(path, [ids.numpy()])[0]
    with torch.no_grad(), smoothed(llama), dequantized_sources(q, llama):
        deq = llama(ids).logits.numpy()
    fp32 = llama(ids).logits.detach().numpy()
    scale = max(1.0, float(np.abs(deq).max()))
    # LiteRT rounds each input row to int8 (XNNPACK: asymmetric per row), as onert does: the
    # format's tolerance (verify's) bounds it, and the file is nearer the weights it holds than fp32
    assert np.abs(got - deq).max() <= report.verify.tolerance * scale
    assert np.abs(got - deq).max() < np.abs(got - fp32).max()
    fp32_path = tmp_path / "fp32.tflite"
    circleops.convert(llama, (ids,), fp32_path, target="tflite")
    assert path.stat().st_size / fp32_path.stat().st_size < 0.75  # the tiny model's fp32 table weighs a layer


def test_w8_tflite_tied_table_is_one_int8_tensor(tmp_path, llama):
    """A tied table and head in a w8 .tflite file: one INT8 tensor with per-row scales, read by
    the EMBEDDING_LOOKUP and the head's FULLY_CONNECTED (litert-torch's int8 files store the
    table int8 too; a FLOAT32 table beside an INT8 head was 1.6 of a 3B file's 4.9 GB), and
    verify, torch on those same int8 rows for the lookup and the head, passes in LiteRT."""
    model = copy.deepcopy(llama)
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    ids = example_ids(8)
    path = tmp_path / "tied.tflite"
    report = circleops.convert(model, (ids,), path, target="tflite", quantize="w8", verify=True)
    assert report.verify.passed and report.verify.runtime == "litert"
    assert _check_w8_tflite_layout(path, tied=True) == 2 * 2 + 1
    q = report.quantization
    assert q.embedding.endswith("embed_tokens.weight") and "EMBEDDING_LOOKUP" in report.summary()
    assert sum(w.shape == (256, 64) for w in q.weights) == 1  # stored once
    fp32_path = tmp_path / "fp32.tflite"
    circleops.convert(model, (ids,), fp32_path, target="tflite")
    table = 256 * 64
    # the file holds the table once, at a byte per value: an fp32 copy beside it would add 4 x table
    untied_bytes = path.stat().st_size
    assert untied_bytes < fp32_path.stat().st_size - 3 * 4 * table * 0.9


def test_graphs_w8_tflite_generate(tmp_path, llama):
    """The generation graphs with w8 on tflite (one file, both signatures share the int8
    weights), run by the Generator in LiteRT: each greedy token is torch's on the weights
    the file holds, up to the file's measured error (as for onert above)."""
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest
    from circleops.quantize.smooth import smoothed
    from circleops.serialize.reader import read_signatures

    out = tmp_path / "g"
    model = copy.deepcopy(llama)
    report = convert_graphs(model, out, target="tflite", prefill_len=8, max_cache_len=32, verify=True, quantize="w8")
    assert report.verify_runtime == "litert" and report.quantization.form == "per_channel"
    manifest = read_manifest(out)
    # with the prefill reading only the first 16 cache slots (graphs.default_cache_windows)
    assert manifest.quantize == "w8" and manifest.files == {g: "model.tflite" for g in ("prefill", "prefill_c16", "decode")}
    path = manifest.path("decode")
    subgraphs = [s.subgraph_index for s in read_signatures(str(path))]
    # per layer q/k/v and gate/up fused (passes.fuse_linears), o, down; the head
    assert _check_w8_tflite_layout(path, subgraphs) == 3 * (2 * 4 + 1)
    # the signatures share one set of int8 weights (the linears, the head, the table)
    assert len(report.quantization.weights) == 2 * 7 + 2
    gen = Generator(manifest).generate([5, 17, 42], 6)
    assert gen.runtime == "litert" and (len(gen.tokens) == 6 or gen.stopped_at_eos)
    err = max(info.max_abs_error for info in report.graphs.values())
    with smoothed(model), dequantized_sources(report.quantization, model), torch.no_grad():
        logits = model(torch.tensor([[5, 17, 42, *gen.tokens]])).logits[0, 2:2 + len(gen.tokens)]
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, gen.tokens)]
    assert max(gaps) <= 2 * err, f"w8 tflite: tokens {gen.tokens} off torch's greedy by logit gaps {gaps} (error {err:.3g})"


def test_quant_check_w8_costs_little(llama):
    from circleops.tools.quant_report import quant_check

    r = quant_check(llama, None, quantize="w8", prompt_ids=[5, 17, 42], new_tokens=6, window=64, max_windows=2)
    assert r.runtime == "onert" and r.note is None  # onert runs w8 on any x86-64
    assert len(r.layer_max_abs) == 2 and r.perplexity_tokens == 2 * 63
    assert abs(r.perplexity_ratio - 1) < 0.02  # measured 1.1% on the sharp tiny Llama
    assert "INT8 per channel" in r.table()


def test_quant_check_w8_litert(llama):
    """check --quantize w8 --runtime litert: the tflite file (dynamic-range FULLY_CONNECTED,
    attention inline as the generation graphs write it: every linear int8) run by LiteRT."""
    from circleops.tools.quant_report import quant_check

    r = quant_check(llama, None, quantize="w8", prompt_ids=[5, 17, 42], new_tokens=6, window=64, max_windows=2,
                    runtime="litert")
    assert r.runtime == "litert" and r.perplexity_tokens == 2 * 63
    # 14 linears, the head and the (untied) embedding table
    assert any("16 weights as INT8 per channel (dynamic-range" in line and "as INT8 per row, an EMBEDDING_LOOKUP"
               in line for line in r.quantization), r.quantization
    assert abs(r.perplexity_ratio - 1) < 0.05  # measured -2.2 % on the sharp tiny Llama (random weights)


def test_quant_check_w8_scores_the_smoothed_file(llama):
    """check writes two files (the layer outputs, then the perplexity logits) inside one
    SmoothQuant fold: the second must hold the same smoothed weights as the first. Each folded
    weight takes its own values back once its blocks exist, so a second file quantizing afresh
    got unsmoothed linears beside smoothed norms: SmolLM2's w8 perplexity read 1.9e6 (28.7
    before), here -1.7 dB and 9 of 128 tokens. Outlier norm channels (as trained LLMs have)
    make the fold large enough to show: the perplexity file's logits must be as near fp32 as
    the format's rounding puts them (8-bit weights and inputs through 2 layers: ~17 dB measured;
    bound 10 dB, and 3 of 4 greedy tokens)."""
    from circleops.tools.quant_report import quant_check

    model = copy.deepcopy(llama)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] = 20.0
            layer.post_attention_layernorm.weight[:4] = 20.0
    r = quant_check(model, None, quantize="w8", prompt_ids=[5, 17, 42], new_tokens=4, window=64, max_windows=2,
                    runtime="litert")
    assert r.holdout_sqnr_db > 10 and r.holdout_agreement >= 0.75 * r.holdout_positions, \
        (r.holdout_sqnr_db, r.holdout_agreement, r.holdout_positions)


def test_cli_check_w8(tmp_path, capsys, llama_config):
    import json

    from circleops.cli import main

    out = tmp_path / "r.json"
    code = main(["check", "--config", str(llama_config), "--quantize", "w8", "--prompt-ids", "5,17,42", "-n", "4",
                 "--window", "32", "--max-windows", "1", "--json", str(out), "-q"])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["format"] == "w8" and data["perplexity_tokens"] == 31
