"""Integer LLMs for NPUs: Circle INT4 weights (packing, fixed-point kernels), Hadamard
rotation folded into the weights, mixed precision from measured sensitivity, GPTQ."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

import circleops
from circleops.errors import CircleOpsError
from circleops.quantize import pt2e
from circleops.runtime import reference
from circleops.serialize import read_model
from circleops.serialize.buffers import pack_4bit, unpack_4bit
from rounding import pt2e_rounding_depth


# ------------------------------------------------------------------ INT4 packing
def test_int4_packing_matches_a_hand_built_example():
    # ONE's luci exporter (CircleTensorExporter.cpp, S4): element 2i -> low nibble, 2i+1 -> high
    # nibble; an odd count leaves the last high nibble 0. Two's complement nibbles:
    # 1 -> 0x1, -2 -> 0xE | 7 -> 0x7, -8 -> 0x8 | 0 -> 0x0, 3 -> 0x3 | -1 -> 0xF
    values = np.array([1, -2, 7, -8, 0, 3, -1], np.int8)
    assert pack_4bit(values).tolist() == [0xE1, 0x87, 0x30, 0x0F]
    assert unpack_4bit(np.array([0xE1, 0x87, 0x30, 0x0F], np.uint8), "INT4", (7,)).tolist() == values.tolist()
    assert pack_4bit(np.array([3, 15, 0, 9], np.uint8), "UINT4").tolist() == [0xF3, 0x90]
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_4bit(np.array([8], np.int8))


@pytest.fixture(scope="module")
def tiny_llama_int4(tmp_path_factory):
    """The tiny Llama of tests/families.py, int16 activations and int4 per-channel weights,
    written to a Circle file: (converted module, ids, path)."""
    from families import FAMILIES

    from circleops.pipeline.convert import export, export_module, hf_export_settings

    model = next(f for f in FAMILIES if f.name == "llama").build()
    module = export_module(model)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with hf_export_settings(model), torch.no_grad():
        ep = export(module, (ids,))
    samples = pt2e.calibration_samples((ids,), 2, vocab_size=256)
    converted, qep = pt2e.quantize(module, (ids,), pt2e.make_quantizer("int16", weight="int4"), samples, exported=ep)
    path = tmp_path_factory.mktemp("int4") / "llm.circle"
    circleops.save(qep, path)
    return converted, ids, path


def test_int4_weights_are_written_packed_as_circle_int4(tiny_llama_int4):
    from circle_schema import circle

    _, _, path = tiny_llama_int4
    sg = read_model(str(path)).subgraphs[0]
    fcs = [op for op in sg.operators if op.opcode == "FULLY_CONNECTED"]
    weights = [sg.tensors[op.inputs[1]] for op in fcs]
    assert fcs and all(w.dtype == "INT4" for w in weights)
    w = weights[0]
    assert w.data.dtype == np.int8 and w.data.min() >= -7 and w.data.max() <= 7 and w.data.max() == 7
    assert w.quant.per_channel and len(w.quant.scale) == w.shape[0] and not w.quant.zero_point.any()
    # the raw flatbuffer: TensorType INT4 (17) and half a byte per weight, low nibble first
    raw = circle.Model.Model.GetRootAs(path.read_bytes(), 0)
    g = raw.Subgraphs(0)
    t = next(g.Tensors(k) for k in range(g.TensorsLength()) if g.Tensors(k).Name().decode() == w.name)
    assert t.Type() == circle.TensorType.TensorType.INT4 == 17
    data = raw.Buffers(t.Buffer()).DataAsNumpy()
    flat = w.data.reshape(-1).astype(np.int16)
    assert data.size == (flat.size + 1) // 2
    assert [int(b) & 0xF for b in data[:8]] == [int(v) & 0xF for v in flat[0:16:2]]
    assert [int(b) >> 4 for b in data[:8]] == [int(v) & 0xF for v in flat[1:16:2]]


@pytest.mark.parametrize("act", ["int16", "uint8"])
def test_int4_fully_connected_fixed_point_matches_fake_quant_within_a_step(tmp_path, act):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 24)).eval()  # with a bias: int32, s_in · s_w
    x = torch.randn(3, 40)
    converted, qep = pt2e.quantize(model, (x,), pt2e.make_quantizer(act, weight="int4"),
                                   pt2e.calibration_samples((x,), 3))
    circleops.save(qep, tmp_path / "fc.circle")
    sg = read_model(str(tmp_path / "fc.circle")).subgraphs[0]
    fc = next(op for op in sg.operators if op.opcode == "FULLY_CONNECTED")
    assert [sg.tensors[i].dtype for i in fc.inputs] == [act.upper(), "INT4", "INT32"]
    out = reference.run(str(tmp_path / "fc.circle"), [x.numpy()])[0]
    step = float(sg.tensors[fc.outputs[0]].quant.scale[0])
    assert np.abs(out - converted(x).detach().numpy()).max() <= 1 * step + 1e-7


def test_int4_llm_fixed_point_matches_fake_quant(tiny_llama_int4):
    converted, ids, path = tiny_llama_int4
    sg = read_model(str(path)).subgraphs[0]
    out = reference.run(str(path), [ids.numpy()])[0]
    want = converted(ids).detach().numpy()
    step = float(sg.tensors[sg.operators[-1].inputs[0]].quant.scale[0])  # the logits' int16 step
    # Each kernel rounds in fixed point where torch rounds in float (a single op: within 1
    # step, test above), so at each activation rounding of the graph the two may land one
    # step apart (a value on a rounding boundary; which values are depends on the float
    # matmul's summation order, i.e. on the CPU's MKL/oneDNN kernel). Passed on at unit gain,
    # the logits are off by at most the rounding depth (26 quantize nodes on the tiny Llama's
    # longest path); + 1e-3 for the float division. Most logits see none of those flips.
    depth = pt2e_rounding_depth(converted.graph)
    diff = np.abs(out - want) / step
    assert depth >= 10 and diff.max() <= depth + 1e-3, (diff.max(), depth)
    assert (diff <= 2 + 1e-3).mean() > 0.85, (diff <= 2 + 1e-3).mean()


# ------------------------------------------------------------------ convert: the recipe end to end
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "convert"))
from convert_fixtures import llama_config, llama_model  # noqa: E402,F401


def test_cli_int16_int4_gptq_rotated_llm_records_its_recipe(capsys, tmp_path, llama_config):
    from circleops.cli import main
    from circleops.quantize.recipe import METADATA_KEY

    out = tmp_path / "m.circle"
    code = main(["convert", "--config", str(llama_config), "-o", str(out), "--seq-len", "8", "--quantize", "int16",
                 "--weight-bits", "4", "--gptq", "--calibrate", "2", "--verify"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "verify:  reference: max abs error" in captured.out and "MISMATCH" not in captured.out
    model = read_model(str(out))
    sg = model.subgraphs[0]
    weights = [sg.tensors[op.inputs[1]] for op in sg.operators if op.opcode == "FULLY_CONNECTED"]
    # every decoder linear INT4, the output head (the last FC, vocab rows) int8
    assert {w.dtype for w in weights[:-1]} == {"INT4"} and weights[-1].dtype == "INT8"
    recipe = json.loads(model.metadata[METADATA_KEY])
    assert recipe["weights"] == "int4" and recipe["activations"] == "int16" and recipe["gptq"] is True
    assert any(s.startswith("Hadamard rotation folded") for s in recipe["steps"])
    assert any(s.startswith("GPTQ (4-bit") for s in recipe["steps"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(target="onert", quantize="uint8", weight_bits=4), "onert 0.1.0 loads no INT4 tensor"),
    (dict(target="tflite", quantize="int16", weight_bits=4), "integer TFLite files carry 8-bit weights"),
    (dict(quantize="int16", verify="onert"), "reference interpreter"),
    (dict(quantize="uint8", verify="onert"), "no uint8 RMS_NORM"),
    (dict(quantize="int16", weight_bits=3), "8 or 4 bits"),
    (dict(gptq=True), "apply to integer graphs"),
])
def test_refuses_what_the_runtime_cannot_run_before_work(tmp_path, kwargs, match):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(CircleOpsError, match=match):
        circleops.convert(model, (torch.randn(1, 4),), tmp_path / "m.circle", **kwargs)
    assert not list(tmp_path.iterdir())


def test_onert_session_refuses_an_int16_file_naming_the_reference_interpreter(tiny_llama_int4):
    from circleops.runtime.onert import integer_refusal

    _, _, path = tiny_llama_int4
    message = integer_refusal(str(path))
    assert "INT16, INT4 tensors" in message and "quantized ATTENTION, RMS_NORM" in message
    assert "--runtime reference" in message


# ------------------------------------------------------------------ rotation, GPTQ, sensitivity
@pytest.fixture(scope="module")
def tiny_llama_model():
    from families import FAMILIES

    return next(f for f in FAMILIES if f.name == "llama").build()


def test_hadamard_rotation_folds_into_the_weights_and_is_undone():
    from families import FAMILIES

    from circleops.quantize.rotate import orthogonal, rotated

    for n in (64, 576, 1536):  # powers of two, SmolLM2's hidden (8 x Paley 72) and MLP widths
        q, how = orthogonal(n)
        assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12) and "Hadamard" in how
        assert torch.allclose(q.abs(), torch.full_like(q, n ** -0.5))
    model = next(f for f in FAMILIES if f.name == "llama").build(tie_word_embeddings=True)  # tied, as SmolLM2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids).logits
        with rotated(model) as report:
            got = model(ids).logits
            emb = model.model.embed_tokens.weight
            assert report.layers == 2 and model.lm_head.weight is not emb
            assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
            assert not torch.allclose(emb, before["model.embed_tokens.weight"])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again

    gemma = next(f for f in FAMILIES if f.name == "gemma").build()  # (1 + weight) norms: not folded
    with rotated(gemma) as report:
        assert report.layers == 0 and "Llama-shaped" in report.skipped


def test_gptq_lowers_a_layers_output_error_below_round_to_nearest(tiny_llama_model):
    from circleops.quantize.gptq import gptq, hessians, rtn

    model = tiny_llama_model
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (1, 32), generator=gen),) for _ in range(4)]
    lin = model.model.layers[0].mlp.down_proj
    xs = []
    handle = lin.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, a[0].shape[-1])))
    hs, tokens = hessians(model, {"down": lin}, samples)
    handle.remove()
    x = torch.cat(xs)
    assert tokens == 128 and torch.allclose(hs["down"], x.T @ x, rtol=1e-4, atol=1e-4)
    w = lin.weight.detach()
    for bits in (4, 8):
        q, scale = gptq(w, hs["down"], bits)
        qr, sr = rtn(w, bits)
        err_gptq = (x @ (q * scale[:, None]).T - x @ w.T).pow(2).sum()
        err_rtn = (x @ (qr * sr[:, None]).T - x @ w.T).pow(2).sum()
        assert err_gptq < 0.8 * err_rtn, (bits, float(err_gptq), float(err_rtn))
        # same grid as the PT2E weight observer: it finds the same scale in the GPTQ weights
        qmax = 2 ** (bits - 1) - 1
        assert q.abs().amax(1).eq(qmax).all() and torch.equal(scale, sr)
        torch.testing.assert_close((q * scale[:, None]).abs().amax(1) / qmax, scale)


def test_choose_int16_takes_the_worst_tensors_within_the_budget():
    from circleops.quantize.sensitivity import TensorScore, choose_int16

    scores = [TensorScore("mul_1", ["down_1"], 9.0), TensorScore("add_3", ["norm_4", "add_5"], 14.0),
              TensorScore("mul_2", ["down_2"], 18.0), TensorScore("linear_7", ["silu_7"], 40.0)]
    report = choose_int16(scores, ops=20, min_db=20, budget=0.25)  # 5 ops at most
    assert report.int16_ops == ["mul_1", "down_1", "add_3", "norm_4", "add_5"] and report.worst_db_left == 18.0
    report = choose_int16(scores, ops=20, min_db=20, budget=1.0)
    assert report.int16_ops[-2:] == ["mul_2", "down_2"] and report.worst_db_left == 40.0
    assert "7 of 20 ops int16" in report.summary_line()


def test_int16_auto_gives_the_worst_measured_ops_int16(tmp_path):
    from families import FAMILIES

    from circleops.pipeline.convert import export, export_module, hf_export_settings

    model = next(f for f in FAMILIES if f.name == "llama").build()
    module = export_module(model)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with hf_export_settings(model), torch.no_grad():
        ep = export(module, (ids,))
    samples = pt2e.calibration_samples((ids,), 2, vocab_size=256)

    def make(names=()):
        q = pt2e.make_quantizer("uint8")
        for n in names:
            q.set_node_name(n, "int16")
        return q

    converted, qep, report = pt2e.quantize_mixed(module, (ids,), make, samples, exported=ep, min_db=60, budget=0.2)
    assert 0 < len(report.int16_ops) <= 0.2 * report.ops and report.worst_db_left < 60
    circleops.save(qep, tmp_path / "auto.circle", verify="reference")
    sg = read_model(str(tmp_path / "auto.circle")).subgraphs[0]
    dtypes = {sg.tensors[op.outputs[0]].dtype for op in sg.operators}
    assert {"UINT8", "INT16"} <= dtypes


def test_gptq_hessians_keep_the_inputs_not_a_matrix_per_linear(tiny_llama_model):
    """Issue 32: a [cols, cols] XᵀX per linear held at once was 5.9 GB at the Llama-3.2-1B
    shape (16 down_proj Hessians of 8192²) for 512 tokens of inputs (0.47 GB). While a
    linear has seen fewer rows than columns its inputs are kept instead (one tensor for the
    linears reading it), and each XᵀX, made when GPTQ reads it, is bit for bit the sum
    sample by sample it always was."""
    from circleops.quantize.gptq import eligible_linears, hessians

    model = tiny_llama_model
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (1, 8), generator=gen),) for _ in range(3)]  # 24 rows < 64 columns
    linears = {n: m for n, m in eligible_linears(model).items() if n.startswith("model.layers.0.")}
    seen: dict[str, list] = {n: [] for n in linears}
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0])) for n, m in linears.items()]
    hs, tokens = hessians(model, linears, samples)
    for h in handles:
        h.remove()
    assert tokens == 24 and set(hs) == set(linears)
    inputs = {id(x): x for xs in seen.values() for x in xs}
    # q/k/v read one tensor, gate/up another: 4 inputs per sample, kept as they are (no [cols, cols] matrix)
    assert len(inputs) == 4 * len(samples)
    squares = sum(m.weight.shape[1] ** 2 * 4 for m in linears.values())
    assert hs.held_bytes() == sum(x.numel() * 4 for x in inputs.values()) < squares / 4
    seen = {n: [x.reshape(-1, x.shape[-1]) for x in xs] for n, xs in seen.items()}
    q = hs.pop("model.layers.0.self_attn.q_proj")
    for n in linears:
        want = None
        for x in seen[n]:  # the per-sample sum, in order
            want = x.T @ x if want is None else want + x.T @ x
        got = q if n.endswith("q_proj") else hs.pop(n)
        assert torch.equal(got, want), n
    assert hs.held_bytes() == 0 and len(hs) == 0


def test_gptq_keeps_no_clone_of_the_weights_it_rounds(tiny_llama_model):
    """Issue 32: GPTQ restores every linear it rounds on exit; a clone of each was, after the
    rotation had written them all, the Llama-3.2-1B shape's 5 GB beside its 6 GB of weights.
    A weight its file no longer holds (a model built in memory, as here, or rotated) is
    written to an unlinked temporary file instead and read back bit for bit."""
    from circleops.quantize.gptq import eligible_linears, gptq_applied

    model = tiny_llama_model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (1, 16), generator=gen),) for _ in range(2)]
    linears = eligible_linears(model)
    weights = sum(m.weight.numel() * 4 for m in linears.values())
    with gptq_applied(model, samples, 4, group=16) as report:
        assert report.linears == len(linears)
        assert report.held_bytes == 0 and report.spilled_bytes == weights
        assert not torch.equal(model.model.layers[0].mlp.down_proj.weight,
                               before["model.layers.0.mlp.down_proj.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_rotation_rounds_large_weights_a_block_of_rows_at_a_time(monkeypatch):
    """Issue 32: the embedding and the untied lm_head were rotated whole in float64, 2 x 2.1 GB
    at the Llama-3.2-1B shape beside the model (its convert peaked at 2.5x the fp32 weights
    there). A block of rows at a time: no float64 copy of either table, the same weights bit
    for bit."""
    from families import FAMILIES

    from circleops.quantize import rotate

    def rotated_weights():
        model = next(f for f in FAMILIES if f.name == "llama").build()
        with rotate.rotated(model) as report:
            assert report.layers
            return model.model.embed_tokens.weight.numel(), {n: p.detach().clone()
                                                             for n, p in model.named_parameters()}

    _, whole = rotated_weights()
    largest = [0]
    double = torch.Tensor.double

    def counted(self, *args, **kwargs):
        out = double(self, *args, **kwargs)
        largest[0] = max(largest[0], out.numel())
        return out

    monkeypatch.setattr(rotate, "ROTATE_ELEMENTS", 1024)
    monkeypatch.setattr(rotate, "FOLD_ELEMENTS", 1024)  # the fold check's logits by blocks too
    monkeypatch.setattr(torch.Tensor, "double", counted)
    table, blocks = rotated_weights()
    assert largest[0] < table  # neither table whole in float64
    mlp = blocks["model.layers.0.mlp.down_proj.weight"].numel()
    assert largest[0] < mlp  # nor an MLP weight (o_proj / down_proj by columns, issue 32)
    assert whole.keys() == blocks.keys() and all(torch.equal(whole[n], blocks[n]) for n in whole)


def test_rotation_keeps_no_copy_of_the_untied_head():
    """Issue 32: a tied lm_head is untied for the rotation (it takes the final norm's gamma);
    its copy is dropped when the tie comes back, so it is not snapshotted for a restore (a
    clone of it was 1.05 GB at the Llama-3.2-1B shape). The model is restored bit for bit."""
    from families import FAMILIES

    from circleops.quantize import rotate

    model = next(f for f in FAMILIES if f.name == "llama").build()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    taken = []
    snapshot = rotate.Snapshot

    def watched(t, *args, **kwargs):
        taken.append(t)
        return snapshot(t, *args, **kwargs)

    rotate.Snapshot = watched
    try:
        with rotate.rotated(model) as report:
            assert report.layers and model.lm_head.weight is not model.model.embed_tokens.weight
            assert not any(t is model.lm_head.weight for t in taken)
    finally:
        rotate.Snapshot = snapshot
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_gptq_per_channel_rounds_a_large_weight_a_block_of_rows_at_a_time(monkeypatch, tiny_llama_model):
    """Issue 32: GPTQ of the Llama-3.2-1B shape's lm_head (8-bit per channel, 128256 x 2048)
    held ~3.2 GB of whole-weight copies (its 16a4w convert's peak, 11.0 GB). Each row is
    rounded on its own, so blocks of rows give the same weights bit for bit, and no copy of
    the whole weight is made."""
    from circleops.quantize import gptq as G

    model = tiny_llama_model
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 256, (1, 16), generator=gen),) for _ in range(2)]
    head = model.lm_head.weight
    with G.gptq_applied(model, samples, 8) as report:
        assert "lm_head" in report.names
        whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    largest = [0]
    compensate = G.compensate

    def counted(w, *args, **kwargs):
        largest[0] = max(largest[0], w.numel())
        return compensate(w, *args, **kwargs)

    monkeypatch.setattr(G, "GPTQ_ROW_ELEMENTS", head.shape[1] * 16)
    monkeypatch.setattr(G, "compensate", counted)
    with G.gptq_applied(model, samples, 8):
        assert all(torch.equal(p, whole[n]) for n, p in model.named_parameters())
    assert largest[0] == head.shape[1] * 16 < head.numel()


def test_integer_constants_are_quantized_a_block_of_rows_at_a_time(monkeypatch):
    """Issue 32: the Llama-3.2-1B shape's 16a4w convert was OOM-killed lowering its graphs
    (24.3 GB on 24 GB): its 128256 x 2048 embedding and lm_head were quantized whole in
    float64, ~6 copies of 2.1 GB. A block of rows at a time: the same integers (the ops are
    elementwise), no float64 copy of the whole table."""
    import numpy as np

    from circleops.quantize.integer import graph as G

    def reference(x, dtype, q):  # the formula, whole
        scale = q.scale.astype(np.float64)
        zp = q.zero_point.astype(np.float64)
        if scale.size > 1:
            scale, zp = scale.reshape(-1, 1), zp.reshape(-1, 1)
        v = x.double().numpy() / scale
        return np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5) + zp, *G.RANGE[dtype]).astype(G.NP[dtype])

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(1000, 64, generator=gen) * 3
    largest = [0]
    to_float64 = G._float64

    def counted(data):
        out = to_float64(data)
        largest[0] = max(largest[0], out.size)
        return out

    monkeypatch.setattr(G, "BLOCK_ELEMENTS", 64 * 100)
    monkeypatch.setattr(G, "_float64", counted)
    for dtype, axis in (("INT8", 0), ("INT16", None), ("UINT8", None)):
        qp = G.params_from_data(table, dtype, axis)
        got = G.quantize_array(table, dtype, qp)
        assert got.dtype == G.NP[dtype] and np.array_equal(got, reference(table, dtype, qp)), dtype
    assert largest[0] == 64 * 100 < table.numel()
