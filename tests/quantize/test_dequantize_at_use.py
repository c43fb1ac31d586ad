"""verify's torch runs of PT2E's converted modules, issue 32: convert_pt2e puts every weight's
dequantize at the top of the graph, so a forward held every float weight at once (the 1B
shape's 16a4w graphs: the int16 embedding and int8 lm_head, 2 x 1.05 GB, its peak with
--verify). Within float32_dequantize a table is dequantized at the gathered rows, a large
linear by blocks of rows, anything else just before its use: the same outputs."""
from __future__ import annotations

import pytest
import torch

from circleops.quantize import blocked_dequantize, dequantize_at_use, pt2e

MB = 1 << 20


class _TableAndHead(torch.nn.Module):
    """An embedding, a hidden linear and an output head: the tables of an LLM's graph."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.embed(ids))))


def _converted(vocab: int, dim: int, weight: str = "int8"):
    torch.manual_seed(0)
    model = _TableAndHead(vocab, dim).eval()
    ids = (torch.randint(0, vocab, (1, 5)),)
    converted, _ = pt2e.quantize(model, ids, pt2e.make_quantizer("int16", weight=weight), [ids])
    return converted, ids


def _calls(module) -> list:
    return [(n.name, n.target, n.args) for n in module.graph.nodes]


def _output_step(module) -> float:
    """The scale of the module's last quantize: one step of its int16 output."""
    last = [n for n in module.graph.nodes if n.target is torch.ops.quantized_decomposed.quantize_per_tensor.default]
    return float(last[-1].args[1])


@pytest.mark.parametrize("rows", [1 << 20, 64, 7])
def test_dequantized_at_use_gives_the_same_outputs_and_restores_the_graph(monkeypatch, rows):
    """The gathered rows and the head by blocks of ``rows`` output channels compute the floats
    of the whole tables: whole (2^20) the very same outputs; by blocks the same products, which
    BLAS may sum in another order for another shape (blocks of 7 rows: a few float32 ulps
    before the output's int16 rounding), so at most one step of the int16 output apart."""
    monkeypatch.setattr(dequantize_at_use, "LINEAR_BLOCK_ROWS", rows)
    converted, ids = _converted(1001, 32)
    before = _calls(converted)
    dequantizes = [n for n in converted.graph.nodes if "dequantize_per" in str(n.target)
                   and n.args[0].op == "get_attr"]
    assert len(dequantizes) >= 3  # the table (per tensor), the head and the hidden linear (per channel)
    with torch.no_grad():
        want = converted(*ids)
        with blocked_dequantize.float32_dequantize([converted]):
            names = [getattr(t, "__name__", "") for _, t, _ in _calls(converted)]
            assert "dequantize_per_channel.default" not in names
            assert names.count("gathered_of_dequantized") == 1 and names.count("blocked_linear_of_dequantized") == 2
            got = converted(*ids)
    assert _calls(converted) == before  # the op, its arguments and the order as convert_pt2e left them
    if rows >= 1001:
        assert torch.equal(got, want)
    else:
        # one step, plus the float32 rounding of the two dequantized outputs (half an ulp each)
        ulp = torch.finfo(torch.float32).eps * float(want.abs().max())
        assert float((got - want).abs().max()) <= _output_step(converted) + ulp


def test_gathered_rows_are_the_whole_tables_rows():
    """The embedding's rows dequantized after the gather are the rows of the whole dequantized
    table, bit for bit (per tensor and per row)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-32767, 32768, (301, 24), dtype=torch.int16, generator=gen)
    ids = torch.tensor([[5, 300, 0, 5, 17]])
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers the quantized_decomposed ops)

    qd = torch.ops.quantized_decomposed
    whole = torch.nn.functional.embedding(ids, qd.dequantize_per_tensor.default(q, 3.1e-5, 0, -32767, 32767,
                                                                                 torch.int16))
    assert torch.equal(dequantize_at_use._gathered(qd.dequantize_per_tensor.default, False, q, 3.1e-5, 0, -32767,
                                                   32767, torch.int16, ids), whole)
    scales = torch.rand(301, generator=gen) * 1e-3 + 1e-6
    zps = torch.randint(-9, 9, (301,), generator=gen)
    per_row = (scales, zps, 0, -32768, 32767, torch.int16)
    whole = torch.nn.functional.embedding(ids, blocked_dequantize.dequantize_per_channel(q, *per_row))
    assert torch.equal(dequantize_at_use._gathered(blocked_dequantize.dequantize_per_channel, True, q, *per_row, ids),
                       whole)


def test_dequantize_moved_to_its_use_comes_back_to_its_place():
    """A dequantize read by something else than an embedding or a linear is made just before
    its first user (not at the top), and put back on exit."""
    converted, ids = _converted(64, 16)
    graph = converted.graph
    table = next(n for n in graph.nodes if "dequantize_per" in str(n.target)
                 and any(u.target is torch.ops.aten.embedding.default for u in n.users))
    # a second reader of the table that is not a gather: the table is then dequantized whole
    gather = next(u for u in table.users if u.target is torch.ops.aten.embedding.default)
    with graph.inserting_after(gather):
        extra = graph.call_function(torch.ops.aten.sum.default, (table,))
    with graph.inserting_after(extra):
        total = graph.call_function(torch.ops.aten.add.Tensor, (gather, extra))
    gather.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total and u is not extra)
    converted.recompile()
    before = [n.name for n in graph.nodes]
    with torch.no_grad():
        want = converted(*ids)
        with blocked_dequantize.float32_dequantize([converted]):
            order = [n.name for n in graph.nodes]
            assert order.index(table.name) == order.index(gather.name) - 1  # just before its first user
            got = converted(*ids)
    assert [n.name for n in graph.nodes] == before and torch.equal(got, want)


def _rss(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def test_converted_forward_holds_no_whole_float_table():
    """A forward of a converted module with a 65536 x 512 int16 table and int8 head (128 MB
    each in float32): the rise of the resident set above what it holds before stays below
    one float table (whole, both were made at the top and held together: 2 x 128 MB)."""
    converted, ids = _converted(65536, 512)
    table_bytes = 65536 * 512 * 4
    with torch.no_grad(), blocked_dequantize.float32_dequantize([converted]):
        converted(*ids)  # one-time buffers (code pages, threads' arenas)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _rss("VmRSS")
        converted(*ids)
        rise = _rss("VmHWM") - start
    assert rise < table_bytes // 2, f"the forward rose {rise / MB:.0f} MB (a float table is {table_bytes / MB:.0f} MB)"
