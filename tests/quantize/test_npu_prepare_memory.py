"""The memory of the 16a4w NPU recipe before and through PT2E, issue 32: what the rotation's
fold check, the per-group rounding and the graphs' folds of the same tables held beside the
rotated weights (the Llama-3.2-1B shape's convert peaked in calibration at 2.17x its fp32
weights). Each fix writes the same file byte for byte."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.quantize import blocked_fold, grouped, rotate


# --------------------------------------------------------------------------- the per-group integers

@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_integers_are_read_back_exactly_from_the_float_weight(bits, monkeypatch):
    """The rounding keeps its scales only (its int8 integers were 0.97 GB at the 1B shape from
    before export to the write); the lowering reads q back from the float weight s_r·m·q it
    finds, exactly, over the whole grid and row scales from 1e-15 to 1e3, once for all graphs."""
    monkeypatch.setattr(grouped, "INTEGERS_BLOCK", 7 * 256)  # blocks of 7 rows: they do not divide the 96
    gen = torch.Generator().manual_seed(0)
    rows, cols, group = 96, 256, 16
    qmax = grouped.qmax_for(bits)
    q = torch.randint(-qmax, qmax + 1, (rows, cols), generator=gen).to(torch.float32)
    q[0, :2 * qmax + 1] = torch.arange(-qmax, qmax + 1)  # every integer of the grid
    s_r = (10.0 ** (torch.rand(rows, generator=gen) * 18 - 15)).to(torch.float32)
    mult = torch.randint(1, grouped.MULT_MAX + 1, (rows, cols // group), generator=gen) if bits == 4 else None
    mult = None if mult is None else mult.index_fill_(1, torch.tensor([0]), grouped.MULT_MAX)
    report = grouped.GroupedReport(4, group, "test")
    w = grouped.record(report, "lin", torch.nn.Linear(cols, rows, bias=False), q, s_r, mult)
    (gw,) = report.weights.values()
    assert gw.q is None  # nothing of the size of the weight held from the rounding on
    values, dtype, qp = grouped.blockwise_params("lin", gw, w)
    assert dtype == ("INT4" if bits == 4 else "INT8")
    assert np.array_equal(values, q.numpy().astype(np.int8)) and not values.flags.writeable
    again, _, _ = grouped.blockwise_params("lin", gw, w.clone())  # the next graph's lowering
    assert np.shares_memory(again, values)


def test_integers_read_back_are_dropped_once_written():
    """After the write nothing reads the integers the lowering read back (0.97 GB at the 1B
    shape through verify's torch runs and runtime): forget_integers drops them, and a later
    lowering reads them back, the same."""
    report = grouped.GroupedReport(4, 16, "test")
    q = torch.randint(-7, 8, (8, 32), generator=torch.Generator().manual_seed(0)).to(torch.float32)
    w = grouped.record(report, "lin", torch.nn.Linear(32, 8, bias=False), q, torch.full((8,), 0.01),
                       torch.randint(1, 256, (8, 2)))
    with grouped.written_as_blockwise(report.weights):
        gw = grouped.lookup(w)
        first, _, _ = grouped.blockwise_params("lin", gw, w)
        assert gw.q is not None and grouped.forget_integers() == 8 * 32 and gw.q is None
        again, _, _ = grouped.blockwise_params("lin", gw, w)
        assert np.array_equal(first, again)
    assert grouped.forget_integers() == 0  # outside the rounding's block: nothing open


def test_grouped_integers_refuse_a_weight_off_the_grid():
    report = grouped.GroupedReport(4, 16, "test")
    q = torch.ones(4, 32)
    w = grouped.record(report, "lin", torch.nn.Linear(32, 4, bias=False), q, torch.full((4,), 0.01), torch.ones(4, 2))
    (gw,) = report.weights.values()
    with pytest.raises(ValueError, match="not s_r·m·q"):
        gw.integers(w * 9)


def _frame_tensors(cm) -> list[str]:
    """The tensors a @contextmanager generator's frame holds while its block runs."""
    return [k for k, v in cm.gen.gi_frame.f_locals.items() if isinstance(v, torch.Tensor)]


def test_roundings_hold_no_float_copy_while_applied(tied_llama):
    """rtn_applied's and gptq_applied's frames stay suspended while the rounding is applied:
    their last linear's float integers and weight (0.13 GB at the 1B shape's MLP width) were
    kept alive by them through export and calibration."""
    from circleops.quantize.gptq import gptq_applied

    model = tied_llama()
    bits = {n: 4 for n in grouped.eligible_linears(model) if n != "lm_head"}
    cm = grouped.rtn_applied(model, bits, 16)
    report = cm.__enter__()
    try:
        assert report.names and _frame_tensors(cm) == []
    finally:
        cm.__exit__(None, None, None)
    ids = [(torch.arange(12)[None],)]
    cm = gptq_applied(model, ids, bits, group=16)
    report = cm.__enter__()
    try:
        assert report.linears and _frame_tensors(cm) == []
    finally:
        cm.__exit__(None, None, None)


# --------------------------------------------------------------------------- the rotation's fold check

def test_fold_error_by_blocks_is_the_whole_float64_figure(monkeypatch):
    """The fold check compares the fp32 logits a block at a time (its float64 copies of the
    1B shape's logits and their difference were 4 x 131 MB): the same figure, NaN included."""
    monkeypatch.setattr(rotate, "FOLD_ELEMENTS", 1000)  # blocks that do not divide the logits
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(1, 37, 301, generator=gen) * 30
    after = before + torch.randn(before.shape, generator=gen) * 1e-4
    whole = float((after.double() - before.double()).abs().max()) / max(float(before.double().abs().max()), 1.0)
    assert rotate.fold_error(before, after) == whole
    after.view(-1)[-1] = float("nan")
    assert rotate.fold_error(before, after) != rotate.fold_error(before, after)  # NaN: the check fails


def test_fold_check_keeps_the_models_logits_dtype(tied_llama):
    model = tied_llama()
    assert rotate._logits(model, torch.arange(6)[None]).dtype == torch.float32


# --------------------------------------------------------------------------- the graphs' folds and the file

@pytest.fixture(scope="module")
def tied_llama_dir(tmp_path_factory):
    """A tied Llama from disk (its weights in the checkpoint's mapping, as convert loads them)."""
    from families import BY_NAME

    out = tmp_path_factory.mktemp("tied_llama")
    BY_NAME["llama"].build(vocab_size=4096, tie_word_embeddings=True).save_pretrained(out)
    return out


@pytest.fixture
def tied_llama(tied_llama_dir):
    from circleops.sources.models import load_hf_dir

    return lambda: load_hf_dir(tied_llama_dir)


def _convert(model, out, **kw):
    from circleops.recipes.llm import convert_graphs

    convert_graphs(model, out, target="circle", quantize="int16", weight_bits=4, prefill_len=4, max_cache_len=16,
                   calibrate=1, rotate="on", source="tied llama", **kw)
    return (out / "model.circle").read_bytes()


def test_later_graphs_fold_no_second_table_and_the_file_is_the_same(tied_llama, monkeypatch, tmp_path):
    """The decode graph's convert_pt2e returns the prefill graph's integer tables (the 1B
    shape's int16 embedding and int8 head, 0.79 GB, were made again, then swapped for the
    first graph's); with the per-group integers read back in the lowering too, the file is
    byte for byte the one written with the integers kept and every table folded per graph."""
    import contextlib

    from circleops.quantize.integer.shared import SharedIntegers

    monkeypatch.setattr(blocked_fold, "FOLD_BLOCK", 1 << 12)  # the tiny model's 4096 x 64 tables count as large
    freed = []
    share = SharedIntegers.share
    monkeypatch.setattr(SharedIntegers, "share", lambda self, *a: freed.append(share(self, *a)) or freed[-1])
    record = grouped.record

    def eager(report, name, lin, q, row_scale, mult):  # the integers kept from the rounding on, as before
        w = record(report, name, lin, q, row_scale, mult)
        report.weights[grouped.key(w)].q = q.to(torch.int8)
        return w

    files, swapped = [], []
    for before in (True, False):
        freed.clear()
        with monkeypatch.context() as m:
            if before:
                m.setattr(grouped, "record", eager)
                m.setattr(blocked_fold, "shared_folds", contextlib.nullcontext)
            files.append(_convert(tied_llama(), tmp_path / f"before{before}", gptq=False, int8_weights="none"))
        swapped.append(list(freed))  # per graph: the bytes of its copies swapped for earlier equal tensors
    # the decode graph no longer makes the int16 embedding and int8 head (4096 x 64) to swap them
    assert swapped[1][0] == swapped[0][0] and swapped[0][1] - swapped[1][1] == 4096 * 64 * (2 + 1), swapped
    assert files[0] == files[1]


def test_default_recipe_gives_back_the_gptq_rounded_head(tied_llama, monkeypatch, tmp_path):
    """GPTQ spills the untied head it rounds through numpy, which leaves its storage
    unresizable: giving it back after PT2E failed ("Trying to resize storage that is not
    resizable") and the default 16a4w recipe stopped on any tied LLM. Now the parameter lets
    go of it; the file is the one written with it kept."""
    files = []
    for keep in (True, False):
        with monkeypatch.context() as m:
            if keep:
                m.setattr(rotate, "release_unread", lambda *a: 0)
            files.append(_convert(tied_llama(), tmp_path / f"keep{keep}"))
    assert files[0] == files[1]


# --------------------------------------------------------------------------- the lowering's float tables

def _mapping_of(t: torch.Tensor) -> str:
    """The /proc/self/maps line of the mapping holding ``t``'s first byte."""
    ptr = t.untyped_storage().data_ptr()
    for line in open("/proc/self/maps"):
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= ptr < end:
            return line.strip()
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.parametrize("dtype, per_row", [(torch.int16, True), (torch.int8, True), (torch.int8, False)])
def test_lowering_float_table_is_the_same_values_in_a_file_not_in_memory(monkeypatch, dtype, per_row):
    """The integer lowering's float constant of a large table (2 x 1.05 GB per graph at the 1B
    shape, its lowering's peak) is the dequantized table, value for value, in a deleted
    temporary file's mapping: not anonymous memory, nothing resident until read."""
    from circleops.quantize.integer import qdq, spilled

    monkeypatch.setattr(spilled, "SPILL_BYTES", 1 << 16)
    monkeypatch.setattr(qdq, "DEQUANTIZE_BLOCK", 7 * 64)  # blocks that do not divide the rows
    info = torch.iinfo(dtype)
    rows = 1001
    q = torch.randint(info.min, info.max + 1, (rows, 64), dtype=dtype, generator=torch.Generator().manual_seed(0))
    rng = np.random.default_rng(0)
    scale = (rng.random(rows if per_row else 1) * 1e-2 + 1e-5).astype(np.float32)
    spec = qdq.QSpec("INT16" if dtype == torch.int16 else "INT8", scale, np.zeros(scale.size, np.int64),
                     0, info.min, info.max, qdq.QuantPlan())
    table = spilled.dequantized_table(q, spec)
    where = _mapping_of(table)
    assert where.endswith("(deleted)"), where  # a file's pages, not the heap's
    assert table.dtype == torch.float32 and table.is_contiguous() and torch.equal(table, spec.dequantize(q))
    small = spilled.dequantized_table(q[:10], spec if not per_row else qdq.QSpec(
        spec.dtype, scale[:10], np.zeros(10, np.int64), 0, info.min, info.max, qdq.QuantPlan()))
    assert not _mapping_of(small).endswith("(deleted)")  # below SPILL_BYTES: in memory


def test_lowering_with_every_table_spilled_writes_the_same_file(tied_llama, monkeypatch, tmp_path):
    from circleops.quantize.integer import spilled

    files = []
    for spill in (False, True):
        monkeypatch.setattr(spilled, "SPILL_BYTES", 1 if spill else 1 << 62)
        files.append(_convert(tied_llama(), tmp_path / f"spill{spill}", gptq=False, int8_weights="none"))
    assert files[0] == files[1]


# --------------------------------------------------------------------------- verify's reference interpreter

@pytest.mark.parametrize("zero_points", ["per row", "none", "per tensor"])
def test_reference_integer_fc_by_row_blocks_is_the_whole_product(monkeypatch, zero_points):
    """The reference interpreter's integer FULLY_CONNECTED made the offsets of a whole weight
    in int64 and float64 (2 x 2.1 GB for the 1B shape's int8 lm_head, verify's peak); by
    blocks of rows it gives the same accumulator exactly (sums of integers below 2^53)."""
    from circleops import ir
    from circleops.runtime.kernels import quantized

    monkeypatch.setattr(quantized, "FC_BLOCK", 7 * 64)  # blocks that do not divide the 1001 rows
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    rows = 1001
    w = torch.randint(-127, 128, (rows, 64), dtype=torch.int8, generator=gen)
    scale = rng.random(rows).astype(np.float32) + 1e-3
    zp = {"per row": rng.integers(-20, 20, rows), "none": np.zeros(rows, np.int64),
          "per tensor": np.array([3])}[zero_points].astype(np.int64)
    wt = ir.Tensor("w", (rows, 64), "INT8", w.numpy(),
                   ir.QuantParams(scale if zp.size > 1 else scale[:1], zp, 0))
    xs = torch.randint(-32768, 32768, (5, 64), generator=gen).to(torch.float64)
    whole = xs @ (w.to(torch.int64) - quantized.params(wt, 2)[1]).to(torch.float64).T
    assert torch.equal(quantized._rows_product(xs, w, wt), whole)


def test_reference_integer_fc_holds_no_whole_offsets():
    """The kernel's rise above what it starts with, for a 4096 x 4096 int8 weight (16 MB): the
    whole offsets were an int64 and a float64 copy, 2 x 128 MiB (measured 256 MiB); by blocks
    a few 8 MiB blocks and the first product's own buffers (measured 56-69 MiB): less than one
    whole copy allowed."""
    from circleops import ir
    from circleops.runtime.kernels import KernelContext, quantized

    rows = cols = 4096
    w = torch.from_numpy(np.random.default_rng(0).integers(-127, 128, (rows, cols), dtype=np.int8))
    x = torch.from_numpy(np.random.default_rng(1).integers(-100, 100, (1, cols), dtype=np.int16))
    qp = lambda n: ir.QuantParams(np.full(n, 1e-3, np.float32), np.zeros(n, np.int64), 0)  # noqa: E731
    ctx = KernelContext([ir.Tensor("y", (1, rows), "INT16", None, qp(1))], None,
                        [ir.Tensor("x", (1, cols), "INT16", None, qp(1)), ir.Tensor("w", (rows, cols), "INT8", None, qp(rows))])
    op = ir.Operator("FULLY_CONNECTED", [0, 1], [2])
    quantized._fc(op, [x, w], ctx)  # the first product's one-time buffers
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss("VmRSS")
    (y,) = quantized._fc(op, [x, w], ctx)
    rise = _rss("VmHWM") - start
    assert tuple(y.shape) == (1, rows) and rise < rows * cols * 8, f"{rise / 2**20:.0f} MiB"


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


# --------------------------------------------------------------------------- the heap between linears

def test_rounding_trims_the_heap_between_linears():
    """The per-group rounding's temporaries of a linear (a few weight-sized tensors, under
    glibc's mmap threshold once it has risen) come from the C heap, between the scales each
    linear keeps: untrimmed, the heap kept them resident and grew with depth (1-1.5 GB at the
    Llama-3.2-1B shape, its rotation stage's peak; here 20x the largest weight for 6 layers).
    Trimmed after each linear, the rounding rises by one linear's temporaries (5 weight-sized
    tensors in rtn_grouped and dequantize) and the scales: at most 10 of its largest weight."""
    import transformers

    from circleops.system.memory import trim_heap

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=6,
                                   num_attention_heads=16, num_key_value_heads=4, vocab_size=1000)
    model = transformers.LlamaForCausalLM(cfg).eval()
    linears = grouped.eligible_linears(model)
    bits = {n: 4 for n in linears if n != "lm_head"}
    largest = max(lin.weight.numel() * lin.weight.element_size() for lin in linears.values())
    trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = _rss("VmRSS")
    with torch.no_grad(), grouped.rtn_applied(model, bits, 16) as report:
        rise = _rss("VmHWM") - start
    assert len(report.names) == len(bits)
    assert rise <= 10 * largest, f"the rounding rose {rise / 2**20:.0f} MiB ({rise / largest:.1f}x its largest weight)"
