"""--quantize int4 (and int4-b64 / int4-b128 / int4-pc) for target tflite: INT4 FULLY_CONNECTED
weights in TFLite BlockwiseQuantization (FLOAT16 scales on the bf16 grid) or per channel, what
LiteRT's XNNPACK runs (qd8-f32-qb4w / qc4w); the embedding and tied head one INT8 table read by
EMBEDDING_LOOKUP. The packing, one-op files in LiteRT against numpy's dequantization, the
reference interpreter's kernel, the fallback rule, convert / convert_graphs / generate."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import circleops
from circleops import ir
from circleops.quantize import formats, int4
from circleops.quantize.weights import dequantized_sources
from circleops.runtime import reference
from circleops.serialize import write_model
from families import BY_NAME, example_ids

INT4_FORMATS = [n for n in formats.names(formats.WEIGHTS) if formats.get(n).form == formats.BLOCKWISE]


@pytest.fixture(scope="module")
def llama():
    return BY_NAME["llama"].build()


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).float().numpy()


# ----------------------------------------------------------------------------- the codec
def test_block_for_fallback_rule():
    """The asked block where it divides K, else the largest multiple of 32 below it that does
    (XNNPACK delegates no smaller block), else None: int8 per channel. 0 (per channel): any K."""
    assert int4.block_for(576, 32) == 32 and int4.block_for(1536, 128) == 128
    assert int4.block_for(576, 128) == 96 and int4.block_for(576, 64) == 64
    assert int4.block_for(96, 64) == 32 and int4.block_for(64, 128) == 64
    assert int4.block_for(40, 32) is None and int4.block_for(40, 128) is None and int4.block_for(16, 32) is None
    assert int4.block_for(40, 0) == 0


@pytest.mark.parametrize("block", [32, 64, 0])
def test_quantize_levels_and_scales(block):
    torch.manual_seed(0)
    w = torch.randn(48, 192) * torch.rand(48, 1) * 2
    w[0] = 0  # a zero row: zero levels at the smallest scale (XNNPACK refuses a file with a 0 scale)
    w[1, :64] *= 1e-6  # tiny blocks: scales clamped to fp16's normal range, values round to 0
    imp = torch.rand(192) + 0.1
    p = int4.quantize(w, block, imp)
    g = 192 if block == 0 else block
    assert p.q.dtype == np.int8 and p.q.min() >= -8 and p.q.max() <= 7 and p.block == block
    s = np.asarray(p.scales, np.float32).reshape(48, -1)
    assert s.shape == (48, 192 // g) and (s[0] == 2.0 ** -14).all() and not p.q[0].any()
    assert np.array_equal(_bf16(s), s)  # bf16 values: what XNNPACK computes with is what fp16 stores
    assert s.min() >= 2.0 ** -14 and (block == 0 or p.scales.dtype == np.float16)
    # each block's weighted error at most that of the plain rounding at max|block| / 7 (within
    # the bf16 grid's 2^-9 of the scale), and the sum well below it: the candidates' search works
    deq = int4.dequantize(p).reshape(48, -1, g)
    blocks, wi = w.reshape(48, -1, g), imp.reshape(1, -1, g)
    plain_s = (blocks.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-30)
    plain = (blocks / plain_s).round().clamp(-8, 7) * plain_s
    err, err0 = (((deq - blocks) ** 2) * wi).sum(-1), (((plain - blocks) ** 2) * wi).sum(-1)
    normal = plain_s.squeeze(-1) >= 2.0 ** -14  # tiny blocks: the scale at fp16's floor, each value off < 2^-15
    assert (err <= err0 * 1.002)[normal].all() and err.sum() < 0.8 * err0.sum()
    assert ((deq - blocks).abs().amax(-1)[~normal] <= 2.0 ** -15).all()
    assert p.nbytes == 48 * 192 // 2 + p.scales.nbytes


def test_importance_lowers_the_weighted_error():
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    imp = torch.rand(128) ** 4 * 100  # a few channels matter
    plain, fitted = int4.dequantize(int4.quantize(w, 32)), int4.dequantize(int4.quantize(w, 32, imp))
    assert (((fitted - w) ** 2) * imp).sum() < 0.97 * (((plain - w) ** 2) * imp).sum()


# ----------------------------------------------------------------------------- one-op files in LiteRT
def _fc_file(path, packed: int4.Int4Weight, rows: int, scales: np.ndarray | None = None) -> None:
    """x [rows, K] -> FULLY_CONNECTED with the INT4 weight (blockwise FLOAT16 scales or per channel)."""
    from circleops.quantize.int4_tflite import weight_tensor

    n, k = packed.q.shape
    if scales is not None:
        packed = packed._replace(scales=scales)
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (rows, k), "FLOAT32"))
    w = sg.add_tensor(weight_tensor("w", (n, k), packed))
    y = sg.add_tensor(ir.Tensor("y", (rows, n), "FLOAT32"))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions",
                                    {"fusedActivationFunction": 0, "keepNumDims": False}, 13))
    sg.inputs, sg.outputs = [x], [y]
    write_model(ir.Model([sg]), str(path), "tflite")


def _litert(path, x, resolver_name="AUTO"):
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(model_path=str(path), num_threads=1,
                     experimental_op_resolver_type=getattr(OpResolverType, resolver_name))
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    delegated = any(o["op_name"] == "DELEGATE" for o in it._get_ops_details())
    return it.get_tensor(it.get_output_details()[0]["index"]), delegated


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n,k,block", [(96, 576, 32), (64, 1536, 128), (40, 576, 0)])
def test_fc_in_litert_is_the_numpy_dequantization(tmp_path, rows, n, k, block):
    """LiteRT (XNNPACK delegated) computes int4.blockwise_linear to float rounding, and that is
    x @ dequant(W).T up to the input's int8 rounding (half a step of the row's range / 255
    times the row sum of |W|). A swapped nibble order or a scale off the bf16 grid breaks it."""
    rng = np.random.default_rng(rows * 7 + n)
    w = rng.standard_normal((n, k)) * rng.uniform(0.2, 3.0, (n, 1)) / np.sqrt(k)
    packed = int4.quantize(torch.from_numpy(w.astype(np.float32)), block)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.1, 10.0, (rows, 1))).astype(np.float32)
    x[:, :3] *= 8
    x[-1] += 2.0
    path = tmp_path / "fc.tflite"
    _fc_file(path, packed, rows)
    got, delegated = _litert(path, x)
    assert delegated  # XNNPACK took the op (blocks of 32, 128; per channel)
    wd = int4.dequantize(packed).double().numpy()
    # the numpy dequantization: levels from the packed bytes' nibbles, low one first
    deq = x.astype(np.float64) @ wd.T
    scale = float(np.abs(deq).max())
    kernel = int4.blockwise_linear(torch.from_numpy(x), torch.from_numpy(packed.q),
                                   torch.from_numpy(np.asarray(packed.scales, np.float32)), block).numpy()
    np.testing.assert_allclose(got, kernel, atol=2e-6 * scale, rtol=0)
    np.testing.assert_allclose(reference.run(path, [x])[0], got, atol=2e-6 * scale, rtol=0)
    rng_x = np.maximum(x.max(1), 0) - np.minimum(x.min(1), 0)
    bound = 0.5 * rng_x[:, None] / 255 * np.abs(wd).sum(1)[None, :]
    assert (np.abs(got - deq) <= bound * (1 + 1e-4) + 2e-6 * scale).all()
    if block:  # LiteRT's builtin kernel computes the same (its per-channel INT4 is wrong: not written for it)
        builtin, delegated = _litert(path, x, "BUILTIN_WITHOUT_DEFAULT_DELEGATES")
        assert not delegated
        np.testing.assert_allclose(builtin, got, atol=2e-6 * scale, rtol=0)


def test_interpreter_rounds_foreign_fp16_scales_as_xnnpack(tmp_path):
    """A file whose FLOAT16 block scales are not bf16 values (another exporter's): XNNPACK
    computes with them rounded to bf16 (measured 1-2.5e-3 of the output off the fp16 product);
    the reference interpreter does the same."""
    rng = np.random.default_rng(3)
    packed = int4.quantize(torch.from_numpy(rng.standard_normal((64, 128)).astype(np.float32)), 32)
    scales = rng.uniform(0.01, 0.1, packed.scales.shape).astype(np.float16)
    x = (rng.standard_normal((2, 128)) + 0.5).astype(np.float32)
    path = tmp_path / "fc.tflite"
    _fc_file(path, packed, 2, scales)
    got, delegated = _litert(path, x)
    assert delegated
    scale = float(np.abs(got).max())
    np.testing.assert_allclose(reference.run(path, [x])[0], got, atol=2e-6 * scale, rtol=0)
    fp16 = int4.blockwise_linear(torch.from_numpy(x), torch.from_numpy(packed.q),
                                 torch.from_numpy(scales.astype(np.float32)), 32)
    exact = (torch.from_numpy(x).double() @ (torch.from_numpy(packed.q).double()
             * torch.from_numpy(scales.astype(np.float64)).repeat_interleave(32, 1)).T)
    assert np.abs(fp16.numpy() - got).max() < 2e-6 * scale and np.abs(exact.numpy() - got).max() > 5e-4 * scale


def test_embedding_lookup_of_the_int8_table_is_exact(tmp_path, llama):
    """The GATHER of the embedding becomes EMBEDDING_LOOKUP of the INT8 table: LiteRT returns
    exactly the dequantized rows (GATHER of a quantized table would return its integers)."""
    from circleops.runtime import litert

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(300, 64)

        def forward(self, ids):
            return self.e(ids) * 2.0

    model = Embed().eval()
    ids = torch.tensor([[0, 299, 7, 7, 150]])
    path = tmp_path / "e.tflite"
    report = circleops.convert(model, (ids,), path, target="tflite", quantize="int4", verify=True)
    assert report.quantization.embedding and report.verify.passed
    assert "EMBEDDING_LOOKUP" in report.summary() and "GATHER" not in report.summary()
    with dequantized_sources(report.quantization, model), torch.no_grad():
        want = model(ids).numpy()
    np.testing.assert_array_equal(litert.run(path, [ids.numpy()])[0], want)


# ----------------------------------------------------------------------------- whole models
class _Widths(torch.nn.Module):
    """K=40 (no block of 32: int8 per channel), K=96 (int4-b64: blocks of 32), K=64 with a bias
    and a ReLU after it."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(40, 96, bias=False)
        self.b = torch.nn.Linear(96, 64, bias=True)
        self.c = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x))))


def test_fallback_rule_in_a_file(tmp_path):
    from ai_edge_litert import schema_py_generated as S

    torch.manual_seed(0)
    model, x = _Widths().eval(), torch.randn(3, 40)
    path = tmp_path / "w.tflite"
    report = circleops.convert(model, (x,), path, target="tflite", quantize="int4-b64", verify=True)
    assert report.verify.passed and report.verify.runtime == "litert"
    q = report.quantization
    assert [w.dtype for w in q.weights] == ["INT8", "INT4", "INT4"]
    assert list(q.fallbacks) == ["a.weight"] and "K=40 takes no int4 block" in q.fallbacks["a.weight"][1]
    summary = report.summary()
    assert "fell back: a.weight [96, 40]" in summary and "K=96 in blocks of 32" in summary
    m = S.ModelT.InitFromPackedBuf(path.read_bytes(), 0)
    sg = m.subgraphs[0]
    blocks = {}
    for t in sg.tensors:
        d = t.quantization.details if t.quantization is not None else None
        if t.type == S.TensorType.INT4:
            assert type(d).__name__ == "BlockwiseQuantizationT"
            assert sg.tensors[d.scales].type == S.TensorType.FLOAT16
            blocks[tuple(int(v) for v in t.shape)] = int(d.blockSize)
    assert blocks == {(64, 96): 32, (32, 64): 64}


@pytest.mark.parametrize("fmt", INT4_FORMATS)
def test_convert_int4_tflite_runs_in_litert(tmp_path, llama, fmt):
    """Every int4 format on a tiny Llama: LiteRT against torch on the dequantized weights
    within the format's tolerance, the interpreter equal to LiteRT, the file smaller than w8's."""
    from circleops.runtime import litert

    ids = example_ids(8)
    path = tmp_path / "m.tflite"
    report = circleops.convert(llama, (ids,), path, target="tflite", quantize=fmt, verify=True)
    assert report.verify.passed and report.verify.runtime == "litert"
    q = report.quantization
    assert q.form == "blockwise" and q.embedding
    eight = sorted(w.name.rsplit(".", 2)[-2] for w in q.weights if w.dtype == "INT8")
    # the table (EMBEDDING_LOOKUP) and the head, int8 per row; int4 keeps the MLP down
    # projections int8 too (measured better: int4_tflite.EIGHT_BIT_LINEARS)
    layers = llama.config.num_hidden_layers
    downs = ["down_proj"] * layers if fmt in ("int4", "int4-topk") else []
    assert eight == sorted(["embed_tokens", "lm_head"] + downs)
    assert {w.dtype for w in q.weights} == {"INT4", "INT8"} and not q.fallbacks
    got = litert.run(path, [ids.numpy()])[0]
    np.testing.assert_allclose(reference.run(path, [ids.numpy()])[0], got, atol=1e-5 * max(1, np.abs(got).max()))
    with torch.no_grad(), dequantized_sources(q, llama):
        deq = llama(ids).logits.numpy()
    assert np.abs(got - deq).max() <= report.verify.tolerance * max(1.0, float(np.abs(deq).max()))


def test_graphs_int4_tflite_generate(tmp_path, llama):
    """The generation graphs (prefill, its cache window, decode: one file sharing one set of
    int4 weights), every linear INT4 (attention inline), run by the Generator in LiteRT: each
    greedy token is torch's on the file's dequantized weights, up to the file's own error."""
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs
    from circleops.package.manifest import read_manifest

    out = tmp_path / "g"
    model = copy.deepcopy(llama)
    report = convert_graphs(model, out, target="tflite", prefill_len=8, max_cache_len=32, verify=True, quantize="int4")
    assert report.verify_runtime == "litert" and report.quantization.form == "blockwise"
    # verified against torch with XNNPACK's int8 rounding of every linear's input (qd8), and
    # the model's noise floor under it: the bound that holds at any depth (issue 32)
    assert report.noise_floor is not None and report.noise_floor > 0
    manifest = read_manifest(out)
    assert manifest.quantize == "int4" and set(manifest.files) == {"prefill", "prefill_c16", "decode"}
    q = report.quantization
    # 2 layers x 7 linears: all int4 but the 2 MLP down projections (int8 by measurement)
    assert sum(w.dtype == "INT4" for w in q.weights) == 2 * 6 and not q.kept_fp32 and not q.fallbacks
    downs = sorted(w.name for w in q.weights if "down_proj" in w.name and w.dtype == "INT8")
    assert len(downs) == 2 and all(n.endswith(f"layers.{i}.mlp.down_proj.weight") for i, n in enumerate(downs))
    assert any("kept INT8 per channel by measurement" in line for line in q.summary_lines())
    # XNNPACK's decode graph whole: RMSNorm inline (WeightFormat.graph_inline_ops), no composite;
    # q/k/v and gate/up one FULLY_CONNECTED each (TargetProfile.fuse_linear_dtypes): per layer
    # q/k/v, o, gate/up, down; and the lm_head
    from collections import Counter

    from circleops.serialize import read_model

    m = read_model(str(out / "model.tflite"))
    for sig in m.signatures:
        sg = m.subgraphs[sig.subgraph_index]
        ops = Counter(op.opcode for op in sg.operators)
        assert ops["STABLEHLO_COMPOSITE"] == 0 and ops["FULLY_CONNECTED"] == 4 * 2 + 1, (sig.key, ops)
        fused = {sg.tensors[op.inputs[1]].name for op in sg.operators if op.opcode == "FULLY_CONNECTED"}
        assert sum("{q,k,v}_proj" in n or "{gate,up}_proj" in n for n in fused) == 2 * 2, (sig.key, fused)
    gen = Generator(manifest).generate([5, 17, 42], 6)
    assert gen.runtime == "litert" and (len(gen.tokens) == 6 or gen.stopped_at_eos)
    err = max(info.max_abs_error for info in report.graphs.values())
    with dequantized_sources(q, model), torch.no_grad():
        logits = model(torch.tensor([[5, 17, 42, *gen.tokens]])).logits[0, 2:2 + len(gen.tokens)]
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, gen.tokens)]
    assert max(gaps) <= 2 * err, f"int4 tflite: tokens {gen.tokens} off torch's greedy by logit gaps {gaps}"


def test_int4_refused_for_circle_and_onert(llama):
    from circleops.errors import TargetError

    for target in ("onert", "circle"):
        with pytest.raises(TargetError, match="use target 'tflite'"):
            circleops.convert(llama, (example_ids(8),), "/nonexistent/x.circle", target=target, quantize="int4")


def test_gptq_at_static_block_scales_lowers_the_output_error():
    """GPTQ (act order) at the block scales fixed first: the levels stay on the int4 grid of
    those scales and the output over correlated inputs is closer than round-to-nearest's."""
    from circleops.quantize.int4_gptq import gptq_static

    torch.manual_seed(0)
    x = torch.randn(512, 96) @ (torch.eye(96) + 0.3 * torch.randn(96, 96))  # correlated inputs
    w = torch.randn(48, 96)
    h = x.T @ x
    packed = int4.quantize(w, 32, torch.diagonal(h) / len(x))
    scale = int4.expanded_scales(packed)
    q = gptq_static(w, h, scale)
    assert q.min() >= -8 and q.max() <= 7 and torch.equal(q, q.round())
    rtn = torch.from_numpy(packed.q).float() * scale
    err_gptq, err_rtn = ((x @ (q * scale - w).T) ** 2).sum(), ((x @ (rtn - w).T) ** 2).sum()
    assert err_gptq < 0.8 * err_rtn


def test_quant_check_int4_runs_the_tflite_file_in_litert(llama):
    """check --quantize int4 (no --runtime): only LiteRT runs its files, so the report is LiteRT's."""
    from circleops.tools.quant_report import quant_check

    r = quant_check(llama, None, quantize="int4", prompt_ids=[5, 17, 42], new_tokens=4, window=64, max_windows=1)
    assert r.runtime == "litert" and r.perplexity_tokens == 63
    assert any("weights as INT4, blocks of 32" in line for line in r.quantization), r.quantization
