"""The int4 formats' two-stage head (circleops.quantize.topk_head): every logit from a 4-bit copy
of the head, the k largest rescored with the INT8 table's rows. A one-head file in LiteRT against
torch's emulation (the rescored values are the int8 head's to float rounding; the greedy token is
the int8 head's where the 4-bit head's is not), verify's boundary rule, and a tiny tied Llama's
generation graphs in LiteRT."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from circleops.quantize import formats, int4, int4_tflite, int8, topk_head, topk_head_tflite
from circleops.serialize import write_model
from families import BY_NAME

FMT = "int4-topk"
K = formats.get(FMT).head_topk
EPS = 2.0 ** -24  # fp32's unit roundoff


def _asymmetric(x: torch.Tensor) -> torch.Tensor:
    xq, sx, _ = int8.quantize_rows_asymmetric(x)
    return xq.to(torch.float32) * sx


@pytest.fixture(scope="module")
def head():
    """A [V, H] head whose rows differ in norm (a real head's do), int8 and int4 blocks of 32, and
    64 input rows."""
    g = torch.Generator().manual_seed(0)
    v, h = max(8192, 2 * topk_head_tflite.GROUP * K), 64  # more groups than k: the two-level top-k
    table = torch.randn(v, h, generator=g) * torch.rand(v, 1, generator=g)
    x = torch.randn(64, h, generator=g) * 2.0
    return int8.quantize_per_channel(table), int4.quantize(table, 32), x


def _run(path, x: np.ndarray) -> np.ndarray:
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return it.get_tensor(it.get_output_details()[0]["index"]).copy()


def test_the_format_writes_a_two_stage_head():
    assert 16 <= K <= 128 and formats.get(FMT).head_type == "INT8"


@pytest.mark.parametrize("rows", [1, 64])
def test_two_stage_head_in_litert_is_torchs(tmp_path, head, rows):
    """LiteRT's logits are torch's two-stage head within int4's tolerance; at the candidates
    both pick, they are the int8 head's (the float rows times x) to float rounding; its greedy
    token is the int8 head's wherever that one wins by more than the rounding, also where the
    4-bit head alone would pick another."""
    from circleops.runtime import reference

    p8, p4, xs = head
    x = xs[:rows]
    path = tmp_path / "head.tflite"
    write_model(int4_tflite.head_model(p8, p4, K, rows), str(path), "tflite")
    got = _run(path, x.numpy())
    w8, w4 = int8.dequantize(p8), int4.dequantize(p4)
    logits, approx, exact = topk_head.two_stage(x, w4, w8, K, _asymmetric)
    scale = float(np.abs(logits.numpy()).max())
    # both products are float sums of H terms in another order than torch's (XNNPACK's 4-bit one
    # sums exact integer dots, then H / 32 block scales), and the rescored ones an add
    # approx + (exact - approx) more: within H + 4 roundings of the terms' magnitudes
    h = x.shape[1]
    bound = EPS * (h * (x.abs() @ w8.abs().T) + 4 * logits.abs().maximum(approx.abs())).numpy()
    bound4 = EPS * (h * (_asymmetric(x).abs() @ w4.abs().T) + 4 * approx.abs()).numpy()
    tight = float(max(bound.max(), bound4.max()))
    assert tight < 1e-4 * scale  # far inside int4's verify tolerance (16 int8 steps: 0.125 x scale)
    for r in range(rows):
        assert topk_head.head_error(got[r], approx[r].numpy(), exact[r].numpy(), K) <= tight
    top = approx.topk(K, dim=-1).indices.numpy()
    inside = top[:, : K // 2]  # far from the boundary: the file's set holds them too
    rows_i = np.arange(rows)[:, None]
    assert (np.abs(got[rows_i, inside] - exact.numpy()[rows_i, inside]) <= bound[rows_i, inside]).all()
    # and those are not the 4-bit values (the rescoring ran)
    assert (np.abs(got[rows_i, inside] - approx.numpy()[rows_i, inside]) > bound[rows_i, inside]).mean() > 0.9
    greedy8, greedy4 = exact.argmax(-1).numpy(), approx.argmax(-1).numpy()
    ex = np.sort(exact.numpy(), -1)
    clear = ex[:, -1] - ex[:, -2] > 2 * bound.max(-1)
    assert (got.argmax(-1)[clear] == greedy8[clear]).all()
    if rows > 1:  # the case the rescoring is for: the 4-bit head alone picks another token
        assert (greedy4 != greedy8)[clear].any()
    # the reference interpreter computes the same file alike
    np.testing.assert_allclose(reference.run(str(path), [x.numpy()])[0], got, atol=1e-5 * scale)


def test_head_error_takes_a_boundary_candidate_either_way():
    """A candidate at the k-th place whose 4-bit values tie: the file may pick it or its twin, and
    the logit is then its exact value or its approximate one; neither is an error. A rescored
    value written where the file should not, or missing far inside the set, is."""
    g = torch.Generator().manual_seed(1)
    v, k = 512, 8
    approx = torch.randn(v, generator=g).numpy().astype(np.float64)
    exact = approx + 0.5 + 0.1 * torch.randn(v, generator=g).numpy()
    order = np.argsort(-approx)
    a, b = order[k - 1], order[k]
    approx[b] = approx[a] - 1e-6  # a near-tie at the boundary
    file = approx.copy()
    chosen = np.r_[order[: k - 1], b]  # the file took b, torch a
    file[chosen] = exact[chosen]
    assert topk_head.head_error(file, approx, exact, k) < 1e-9
    plain = np.abs(file - np.where(np.isin(np.arange(v), order[:k]), exact, approx)).max()
    assert plain > 0.3  # compared plainly, the tie would read as an error of the whole rescoring
    wrong = file.copy()
    wrong[order[0]] = approx[order[0]]  # the best candidate not rescored
    assert topk_head.head_error(wrong, approx, exact, k) > 0.3
    far = file.copy()
    far[order[-1]] = exact[order[-1]]  # a rescored value at the bottom of the ranking
    assert topk_head.head_error(far, approx, exact, k) > 0.3


@pytest.fixture(scope="module")
def tied_llama():
    """A tiny Llama with a tied head over a vocabulary the two-stage head applies to, in more groups
    than k (a generation graph's one row takes the two-level top-k)."""
    return BY_NAME["llama"].build(vocab_size=max(8192, 2 * topk_head_tflite.GROUP * K), tie_word_embeddings=True)


def test_generation_graphs_with_the_two_stage_head(tmp_path, tied_llama):
    """convert_graphs int4 of a tied Llama: each graph's head is the two-stage one over the one
    INT8 table, verify passes against torch running the same head on the file's weights, and the
    Generator's greedy tokens in LiteRT are torch's up to the file's own error."""
    from collections import Counter

    from circleops.generation.generator import Generator
    from circleops.package.manifest import read_manifest
    from circleops.quantize.weights import dequantized_sources
    from circleops.recipes.llm import convert_graphs
    from circleops.serialize import read_model

    model = copy.deepcopy(tied_llama)
    out = tmp_path / "g"
    report = convert_graphs(model, out, target="tflite", prefill_len=8, max_cache_len=32, verify=True, quantize=FMT)
    q = report.quantization
    assert report.verify_runtime == "litert" and list(q.two_stage.values()) == [K]
    assert list(q.two_stage)[0].endswith("embed_tokens.weight")
    assert any("two-stage" in line for line in q.summary_lines())
    v, h = tied_llama.config.vocab_size, tied_llama.config.hidden_size
    assert sorted((w.dtype, w.shape) for w in q.weights if w.shape == (v, h)) == [("INT4", (v, h)), ("INT8", (v, h))]
    m = read_model(str(out / "model.tflite"))
    for sig in m.signatures:
        sg = m.subgraphs[sig.subgraph_index]
        ops = Counter(op.opcode for op in sg.operators)
        # one row: the two-level top-k (the groups' maxima, then the best groups' logits)
        assert ops["TOPK_V2"] == 2 and ops["REDUCE_MAX"] == 1, (sig.key, ops)
        assert ops["SCATTER_ND"] == 1 and ops["EMBEDDING_LOOKUP"] == 2, (sig.key, ops)
    gen = Generator(read_manifest(out)).generate([5, 17, 42], 6)
    err = max(info.max_abs_error for info in report.graphs.values())
    with dequantized_sources(q, model, "litert"), torch.no_grad():
        logits = model(torch.tensor([[5, 17, 42, *gen.tokens]])).logits[0, 2:2 + len(gen.tokens)]
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, gen.tokens)]
    assert max(gaps) <= 2 * err, f"two-stage head: tokens {gen.tokens} off torch's greedy by logit gaps {gaps}"


def test_single_graph_convert_with_the_two_stage_head(tmp_path, tied_llama):
    """circleops.convert of the whole sequence (8 rows of logits): the head two-stage per row, and
    verify's torch runs it too (its record reaches compare_file): LiteRT within fp32's tolerance
    of it, its boundary candidates either way."""
    import circleops
    from families import example_ids

    ids = example_ids(8, tied_llama.config.vocab_size)
    report = circleops.convert(copy.deepcopy(tied_llama), (ids,), tmp_path / "m.tflite", target="tflite",
                               quantize=FMT, verify=True)
    assert report.verify.passed and list(report.quantization.two_stage.values()) == [K]
    assert report.ops["TOPK_V2"] == 1 and report.ops["SCATTER_ND"] == 1
    assert report.verify.max_abs_error <= 1e-3 * max(1.0, report.verify.reference_max_abs)
