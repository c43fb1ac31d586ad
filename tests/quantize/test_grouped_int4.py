"""Per-group (blockwise) int4 weights: the Circle BlockwiseQuantization form against a
hand-built file, the reference interpreter's fixed-point FULLY_CONNECTED against the
fake-quantized module, grouped GPTQ against grouped round to nearest, and the recipe end to
end on the tiny Llama."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import circleops
from circleops import ir
from circleops.errors import CircleOpsError
from circleops.quantize import grouped, pt2e
from circleops.runtime import reference
from circleops.serialize import read_model, write_model

Q = np.array([[1, -1, 2, -2, 3, -3, 4, -4],
              [7, 0, -7, 1, 0, 0, 2, -1]], np.int8)
M = np.array([[1, 2], [3, 4]], np.uint8)  # group multipliers, groups of 4 columns
S_ROW = np.array([0.1, 0.2], np.float32)


def _hand_built_fc(path):
    """x INT16 [1, 8] (scale 0.5) -> FULLY_CONNECTED with the weight Q (INT4, groups of 4,
    scales S_ROW · M) -> INT16 [1, 2] with scale 0.05 = s_x · s_row[0]: row 0 requantizes by
    exactly 1, row 1 by exactly 2, so the expected integers need no rounding."""
    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (1, 8), "INT16", None, ir.QuantParams(np.array([0.5], np.float32),
                                                                               np.zeros(1, np.int64))))
    scales = ir.Tensor("w_scales", (2, 2), "UINT8", M.copy(), ir.QuantParams(S_ROW.copy(), np.zeros(2, np.int64), 0))
    w = sg.add_tensor(ir.Tensor("w", (2, 8), "INT4", Q.copy(), ir.QuantParams(
        S_ROW.copy(), np.zeros(2, np.int64), 0, ir.Blockwise(4, scales))))
    y = sg.add_tensor(ir.Tensor("y", (1, 2), "INT16", None, ir.QuantParams(np.array([0.05], np.float32),
                                                                               np.zeros(1, np.int64))))
    sg.operators.append(ir.Operator("FULLY_CONNECTED", [x, w, -1], [y], "FullyConnectedOptions", {}))
    sg.inputs, sg.outputs = [x], [y]
    write_model(ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"y": y})]), path)


def test_blockwise_int4_file_matches_a_hand_built_example(tmp_path):
    from circle_schema import circle

    path = tmp_path / "fc.circle"
    _hand_built_fc(path)
    raw = circle.Model.Model.GetRootAs(path.read_bytes(), 0)
    g = raw.Subgraphs(0)
    tensors = {g.Tensors(k).Name().decode(): (k, g.Tensors(k)) for k in range(g.TensorsLength())}
    _, w = tensors["w"]
    assert w.Type() == circle.TensorType.TensorType.INT4
    # two values per byte, element 2i in the low nibble: (1,-1) -> 0xF1, (2,-2) -> 0xE2 ... (2,-1) -> 0xF2
    assert raw.Buffers(w.Buffer()).DataAsNumpy().tolist() == [0xF1, 0xE2, 0xD3, 0xC4, 0x07, 0x19, 0x00, 0xF2]
    qp = w.Quantization()
    assert qp.DetailsType() == circle.QuantizationDetails.QuantizationDetails.BlockwiseQuantization == 3
    assert qp.ScaleLength() == 0  # the schema ignores scale / zero_point when details are set
    details = circle.BlockwiseQuantization.BlockwiseQuantization()
    details.Init(qp.Details().Bytes, qp.Details().Pos)
    assert details.BlockSize() == 4 and details.ZeroPoints() == -1
    k, s = tensors["w_scales"]
    assert details.Scales() == k and s.Type() == circle.TensorType.TensorType.UINT8 and list(s.ShapeAsNumpy()) == [2, 2]
    assert raw.Buffers(s.Buffer()).DataAsNumpy().tolist() == [1, 2, 3, 4]
    assert s.Quantization().ScaleAsNumpy().tolist() == pytest.approx(S_ROW.tolist())
    # read back: the IR's Blockwise names the same scales
    back = read_model(str(path)).subgraphs[0]
    wt = next(t for t in back.tensors if t.name == "w")
    assert wt.quant.blockwise.block_size == 4 and wt.quant.blockwise.scales.name == "w_scales"
    assert np.asarray(wt.data).tolist() == Q.tolist()
    # the fixed-point FC: row 0: 1·(1-2+6-8) + 2·(15-18+28-32) = -17; row 1: 2·(3·(7-21+4) + 4·(14-8)) = -12
    x = np.arange(1, 9, dtype=np.int16).reshape(1, 8)
    assert reference.run(str(path), [x])[0].tolist() == [[-17, -12]]


@pytest.mark.parametrize("act", ["int16", "uint8"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_fully_connected_fixed_point_matches_fake_quant_within_a_step(tmp_path, act, bias):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 24, bias=bias)).eval()
    x = torch.randn(5, 96)
    with grouped.rtn_applied(model, {"0": 4}, 32) as report, grouped.written_as_blockwise(report.weights):
        converted, qep = pt2e.quantize(model, (x,), pt2e.make_quantizer(act, weight=grouped.GROUPED),
                                       pt2e.calibration_samples((x,), 3))
        circleops.save(qep, tmp_path / "fc.circle")
        want = converted(x).detach().numpy()  # (the converted module reads the rounded parameter)
    assert report.names == ["0"]
    sg = read_model(str(tmp_path / "fc.circle")).subgraphs[0]
    fc = next(op for op in sg.operators if op.opcode == "FULLY_CONNECTED")
    w = sg.tensors[fc.inputs[1]]
    assert w.dtype == "INT4" and w.quant.blockwise.block_size == 32 and w.quant.blockwise.scales.shape == (24, 3)
    assert (sg.tensors[fc.inputs[2]].dtype == "INT32") if bias else fc.inputs[2] == -1
    out = reference.run(str(tmp_path / "fc.circle"), [x.numpy()])[0]
    step = float(sg.tensors[fc.outputs[0]].quant.scale[0])
    assert np.abs(out - want).max() <= 1 * step + 1e-7


def test_grouped_grid_is_finer_than_per_channel_and_gptq_beats_round_to_nearest():
    from circleops.quantize.gptq import gptq_grouped, rtn

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * torch.linspace(0.2, 3.0, 128)  # columns of unequal range
    x = torch.randn(512, 128, generator=gen) @ torch.randn(128, 128, generator=gen) * 0.3  # correlated inputs
    h = x.T @ x
    q, s_r, m = grouped.rtn_grouped(w, 4, 32)
    assert q.abs().max() <= 7 and m.min() >= 1 and m.max() == 255 and m.shape == (48, 4)
    w_group = grouped.dequantize(q, s_r, m, 32)
    qc, sc = rtn(w, 4)
    err = lambda v: float((x @ v.T - x @ w.T).pow(2).sum())  # noqa: E731
    assert err(w_group) < 0.6 * err(qc * sc[:, None])
    qg, s_g, m_g = gptq_grouped(w, h, 4, 32)
    assert qg.abs().max() <= 7 and m_g.min() >= 1 and m_g.max() <= 255
    assert err(grouped.dequantize(qg, s_g, m_g, 32)) < 0.8 * err(w_group)


def _outlier_layer():
    """A tiny linear with outlier weights and inputs of unequal energy (what act order and a
    weighted clipping search are for), its Hessian XᵀX and its output error function."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * torch.linspace(0.2, 3.0, 128)
    w[torch.randint(0, 48, (20,), generator=gen), torch.randint(0, 128, (20,), generator=gen)] *= 6
    energy = torch.exp(torch.randn(128, generator=gen))
    x = (torch.randn(512, 128, generator=gen) @ torch.randn(128, 128, generator=gen) * 0.3) * energy
    return w, x.T @ x, lambda v: float((x @ v.T - x @ w.T).pow(2).sum())


def test_weighted_clipping_search_minimises_the_weighted_error():
    """Each group's multiplier is the candidate of least importance-weighted error: never worse
    than the unweighted search's choice on that measure, better on some groups."""
    w, h, _ = _outlier_layer()
    g = w.reshape(48, 4, 32)
    s_r = grouped.row_scales(w, 4)
    imp = torch.diagonal(h).reshape(4, 32)

    def weighted(m):
        s = (s_r[:, None] * m)[:, :, None]
        return ((g - torch.clamp(torch.round(g / s), -7, 7) * s).pow(2) * imp[None]).sum(2)

    plain = grouped.search_mult(g, s_r, 4, grouped.CLIP_GRID)
    chosen = grouped.search_mult(g, s_r, 4, grouped.CLIP_GRID, imp)
    assert (weighted(chosen) <= weighted(plain) + 1e-6).all()
    assert float(weighted(chosen).sum()) < 0.95 * float(weighted(plain).sum())
    assert (chosen != plain).any() and chosen.min() >= 1 and chosen.max() <= 255


def test_gptq_act_order_and_clipping_search_each_lower_the_output_error():
    """The measured 16a4w rounding (bench/results/36-npu-16a4w.yaml): act order with static
    group scales, and the Hessian-weighted clipping search, each lower the layer's output error."""
    from circleops.quantize.gptq import gptq_grouped

    w, h, err = _outlier_layer()
    out = {}
    for act_order in (False, True):
        for clip in (False, True):
            q, s_r, m = gptq_grouped(w, h, 4, 32, act_order=act_order, clip_search=clip)
            assert q.abs().max() <= 7 and m.min() >= 1 and m.max() <= 255
            out[act_order, clip] = err(grouped.dequantize(q, s_r, m, 32))
    assert out[True, False] < 0.8 * out[False, False], out  # 0.42 measured
    assert out[True, True] < 0.95 * out[True, False], out  # 0.84
    assert out[False, True] < 0.9 * out[False, False], out  # 0.72


def test_coordinate_descent_after_gptq_lowers_the_output_error():
    """refine_grouped (bench/results/41-npu-16a4w-ideas.yaml): after GPTQ each column's integers
    moved to their best level given the others lower the layer's damped output error, never
    raise it, keep the scales and stay on the int4 grid; gptq_grouped(refine=) applies it."""
    from circleops.quantize.gptq import DAMP, gptq_grouped, refine_grouped

    w, h, err = _outlier_layer()
    q, s_r, m = gptq_grouped(w, h, 4, 32, act_order=True, clip_search=True)
    damped = h + DAMP * torch.diagonal(h).mean() * torch.eye(h.shape[0])

    def objective(levels):
        e = w - grouped.dequantize(levels, s_r, m, 32)
        return float(torch.einsum("ri,ij,rj->", e, damped, e))

    before = objective(q)
    one = refine_grouped(w, h, q, s_r[:, None] * m, 32, passes=1)
    two = refine_grouped(w, h, q, s_r[:, None] * m, 32, passes=2)
    assert one.abs().max() <= 7 and torch.equal(one, one.round())
    assert objective(two) <= objective(one) <= before
    assert err(grouped.dequantize(two, s_r, m, 32)) < 0.9 * err(grouped.dequantize(q, s_r, m, 32))  # 0.84 measured
    q2, s2, m2 = gptq_grouped(w, h, 4, 32, act_order=True, clip_search=True, refine=2)
    assert torch.equal(s2, s_r) and torch.equal(m2, m) and torch.equal(q2, two)


def _refine_per_column(w, h, q, s_r, m, group, passes, damp):
    """refine_grouped's definition: the whole gradient (w - ŵ)·H updated after every move."""
    h = h + damp * torch.diagonal(h).mean() * torch.eye(h.shape[0])
    diag = torch.diagonal(h)
    scale = (s_r[:, None] * m.to(torch.float32)).repeat_interleave(group, dim=1)
    q = q.clone()
    g = (w - q * scale) @ h
    for _ in range(passes):
        for j in torch.argsort(diag, descending=True).tolist():
            step = torch.clamp(q[:, j] + torch.round(g[:, j] / (scale[:, j] * diag[j])), -7, 7) - q[:, j]
            q[:, j] += step
            g -= (scale[:, j] * step)[:, None] * h[j][None, :]
    return q


@pytest.mark.parametrize("block", [1, 16, 24, 128])  # one column; whole blocks; a ragged last block; one block
def test_blockwise_refinement_equals_the_per_column_definition(block):
    """refine_grouped keeps its gradient blockwise (a block's moves reach the other columns in
    one product when it ends): the same integers as the definition that updates every column
    after every move. Exact equality: both sum the same terms in float32 on a seeded 24 x 64
    layer, no level within rounding of a tie; a move lost across blocks changes the integers."""
    from circleops.quantize.gptq import DAMP, gptq_grouped, refine_grouped

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=gen)
    x = torch.randn(256, 64, generator=gen) @ (torch.eye(64) + 0.5 * torch.randn(64, 64, generator=gen))
    h = x.T @ x  # correlated inputs: a move in one column changes its neighbours' best levels
    q, s_r, m = gptq_grouped(w, h, 4, 16)
    want = _refine_per_column(w, h, q, s_r, m, 16, 2, DAMP)
    assert int((want != q).sum()) > 20  # the refinement moves integers: the comparison is not vacuous
    assert torch.equal(refine_grouped(w, h, q, s_r[:, None] * m, 16, passes=2, block=block), want)


def test_blockwise_integers_are_the_reports_own_not_a_copy_per_graph():
    """Issue 32: every graph lowered (prefill, decode) took its own int8 copy of each 4-bit
    linear's integers (0.88 GB per graph at the Llama-3.2-1B shape) beside the report's; the
    writer stores one buffer either way. The lowering now reads the report's integers
    (read-only: a pass that wrote into them would change every graph's)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen)
    q, s_r, m = grouped.rtn_grouped(w, 4, 16)
    gw = grouped.GroupedWeight(q.to(torch.int8), s_r.float(), m.to(torch.uint8), 16, 4)
    values, dtype, qp = grouped.blockwise_params("w", gw)
    assert dtype == "INT4" and np.shares_memory(values, gw.q.numpy()) and not values.flags.writeable
    assert np.array_equal(values, q.numpy().astype(np.int8))
    assert np.shares_memory(qp.blockwise.scales.data, gw.mult.numpy())
    per_channel = grouped.GroupedWeight(q.to(torch.int8), s_r.float(), None, 0, 8)
    values, dtype, _ = grouped.blockwise_params("w", per_channel)
    assert dtype == "INT8" and np.shares_memory(values, per_channel.q.numpy())


def test_int16_grouped_int4_llm_end_to_end(tmp_path):
    """The recipe on the tiny Llama: every decoder linear (the FCs and the fused ATTENTION's
    wq..wo) blockwise INT4, the head int8, verified against the fake-quantized module; the
    weights the file carries are closer to the model's with per-group scales than per channel."""
    from families import BY_NAME

    from circleops.quantize.recipe import METADATA_KEY
    from circleops.runtime.kernels.quantized import dequantize

    model = BY_NAME["llama"].build()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    params = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    error = {}
    for group in (0, 32):
        path = tmp_path / f"g{group}.circle"
        circleops.convert(model, (ids,), path, quantize="int16", weight_bits=4, weight_group_size=group,
                          calibrate=2, rotate="off", verify="reference", gptq=False, int8_weights="none")
        m = read_model(str(path))
        sg = m.subgraphs[0]
        recipe = json.loads(m.metadata[METADATA_KEY])
        assert recipe["group_size"] == group
        # each INT4 weight against the model's weight it stands for (PT2E names its own constants
        # _frozen_param*: the nearest weight of the same shape)
        num = den = 0.0
        for t in (t for t in sg.tensors if t.dtype == "INT4"):
            d = dequantize(torch.as_tensor(np.asarray(t.data)), t)
            err, ref = min((float((d - p).pow(2).sum()), float(p.pow(2).sum()))
                           for p in params.values() if tuple(p.shape) == tuple(d.shape))
            num, den = num + err, den + ref
        error[group] = num / den
    blockwise = {t.name for t in sg.tensors if t.quant is not None and t.quant.blockwise is not None}
    linears = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"]
    assert len(blockwise) == len(linears), (sorted(blockwise), linears)
    head = [sg.tensors[op.inputs[1]] for op in sg.operators if op.opcode == "FULLY_CONNECTED"][-1]
    assert head.dtype == "INT8" and head.quant.blockwise is None
    assert any(s.startswith(f"{len(linears)} linears int4 in groups of 32") for s in recipe["steps"])
    assert error[32] < 0.8 * error[0], error  # Gaussian weights: 0.70 measured (real ones have outliers)


@pytest.mark.parametrize("kwargs,match", [
    (dict(quantize="int16", weight_group_size=48), "power of two"),
    (dict(quantize="int16", weight_group_size=32), "4-bit weights"),
    (dict(quantize=None, weight_bits=4, weight_group_size=32), "integer graphs"),
])
def test_group_size_is_checked_before_work(tmp_path, kwargs, match):
    model = torch.nn.Sequential(torch.nn.Linear(32, 8))
    with pytest.raises(CircleOpsError, match=match):
        circleops.convert(model, (torch.randn(1, 32),), tmp_path / "m.circle", **kwargs)
    assert not (tmp_path / "m.circle").exists()


def test_choose_int8_takes_the_worst_linears_within_target_and_budget():
    noise = {"a": 5.0, "b": 3.0, "c": 1.0, "d": 1.0}
    sizes = {"a": 10, "b": 10, "c": 10, "d": 10}
    assert grouped.choose_int8(noise, sizes, target=0.25, budget=0.5) == ["a", "b"]  # 2/10 left
    assert grouped.choose_int8(noise, sizes, target=0.25, budget=0.25) == ["a"]  # the budget stops it
    assert grouped.choose_int8(noise, sizes, target=0.6, budget=1.0) == ["a"]  # 5/10 left <= 60 %


def test_choose_by_gain_takes_the_most_gain_per_weight_within_the_share():
    gains = {"big": 6.0, "small": 2.0, "mid": 2.5, "useless": -1.0}
    sizes = {"big": 40, "small": 10, "mid": 20, "useless": 5}
    # per weight: small 0.2, big 0.15, mid 0.125 (of 75 weights in all)
    assert grouped.choose_by_gain(gains, sizes, 0.3) == ["small"]  # big (40) and mid (20) do not fit beside it
    assert grouped.choose_by_gain(gains, sizes, 0.7) == ["small", "big"]  # 50 of 52.5
    assert grouped.choose_by_gain(gains, sizes, 1.0) == ["small", "big", "mid"]  # never a linear that gains nothing


def test_int8_gains_are_what_int8_weights_buy_in_the_rounded_model():
    """Each gain is the fall of the logits' squared error against fp32 when that linear alone
    goes back to int8 in the 4-bit model: checked against a full forward for the best one."""
    from families import BY_NAME

    model = BY_NAME["llama"].build()
    samples = pt2e.calibration_samples((torch.zeros(1, 16, dtype=torch.long),), 2, vocab_size=256)
    reference = grouped.logits_of(model, samples)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    int8 = {n: grouped.int8_rounding(m.weight) for n, m in linears.items()}
    energy = sum(float(r.pow(2).sum()) for r in reference)

    def error():
        return sum(float((got - r).pow(2).sum()) for got, r in zip(grouped.logits_of(model, samples), reference)) / energy

    with grouped.rtn_applied(model, {n: 4 for n in linears}, 32) as report:
        base = error()
        gains = grouped.int8_gains(model, samples, reference, int8)
        assert set(gains) == set(linears) and sum(gains.values()) > 0
        best = max(gains, key=gains.get)
        with grouped.int8_chosen_by_gain(model, report, samples, reference, {best: int8[best]}, share=1.0) as chosen:
            assert chosen == [best] and best in report.int8 and best not in report.names
            assert abs((base - error()) - gains[best]) <= 1e-6 * base + 1e-12
        assert abs(error() - base) <= 1e-9 * base  # restored on exit


def test_int8_weights_auto_keeps_the_measured_linears_int8_within_a_tenth(tmp_path):
    from families import BY_NAME

    model = BY_NAME["llama"].build()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "m.circle"
    report = circleops.convert(model, (ids,), path, quantize="int16", weight_bits=4, int8_weights="auto",
                               calibrate=2, rotate="off", verify="reference")
    line = next(s for s in report.quantization.summary_lines() if "linears int8 per channel" in s)
    assert "each linear's int4 rounding alone in the logits" in line and "within 10%" in line, line
    sg = read_model(str(path)).subgraphs[0]
    linears = {f"model.{n}.weight": m.weight.numel() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    by_name = {t.name: t for t in sg.tensors}
    int8 = [n for n in linears if by_name[n].dtype == "INT8" and by_name[n].quant.blockwise is None]
    assert int8 and sum(linears[n] for n in int8) <= grouped.INT8_SHARE * sum(linears.values()), (int8, line)
    assert all(by_name[n].dtype == "INT4" for n in linears if n not in int8)
