"""A tied model's embedding table on target onert with a quantized head (circleops.package.split,
PartBytes.head_rows): stored once, as the lm_head's quantized weight.

onert 0.1.0 GATHERs neither an INT8 table (w8's head) nor a Q8_0 one (q4_0's head), so the
generation files held the table a second time beside the head: FLOAT32 for w8 (1.05 GB beside
the head's 0.26 GB at the Llama-3.2-1B shape), Q4_0 for q4_0. Now the graphs (a split one's
first part) take the embeddings, which the generator reads from the head's stored values
(circleops.runtime.chain.HeadEmbedding: INT8 rows times their scales, Q8_0 blocks unpacked), and
verify's torch reference embeds with those same rows. A tiny tied Llama (vocab 8x the hidden
size, so that the table is a third of the weights) in both formats, one file per graph and split.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import manifest_json
from families import BY_NAME
from generate_fixtures import TINY_CACHE, TINY_PROMPTS
from onert_host import GGML_RUNTIME

from circleops.generation.generator import Generator
from circleops.package import split
from circleops.package.manifest import read_manifest
from circleops.quantize import ggml
from circleops.quantize.weights import dequantized_sources
from circleops.recipes.llm import convert_graphs
from circleops.runtime.chain import HeadEmbedding
from circleops.serialize import read_model
from circleops.serialize.writer import constant_bytes

LAYERS, VOCAB, NEW = 2, 512, 8
HEAD_TYPES = {"w8": "INT8", "q4_0": "GGML_Q8_0"}
RUNTIMES = {"w8": "onert", "q4_0": GGML_RUNTIME}  # onert runs w8 on any x86-64, GGML only with AVX-512
# a generated token's logit within this share of the logits' scale of the top one: onert rounds each
# product's input (per row to int8 for w8, to Q8_0 blocks for q4_0), and a one-ulp difference upstream
# (a summation order) moves an input across a rounding boundary now and then: one quantum of the
# input times the weights (test_w8.CROSS_CHECK_ATOL, conftest's GGML_CROSS_CHECK_ATOL)
TOKEN_GAP = 1e-2


@pytest.fixture(scope="module")
def tied_model():
    return BY_NAME["llama"].build(num_hidden_layers=LAYERS, tie_word_embeddings=True, vocab_size=VOCAB)


def _convert(model, out, fmt, **options):
    return convert_graphs(model, out, target="onert", prefill_len=(8, 4), max_cache_len=TINY_CACHE, quantize=fmt,
                          verify=True, source="tiny tied llama", **options)


@pytest.fixture(scope="module", params=["w8", "q4_0"])
def converted(request, tmp_path_factory, tied_model):
    """(format, directory, report, the model the files were written from)."""
    fmt = request.param
    model = copy.deepcopy(tied_model)
    out = tmp_path_factory.mktemp(f"head_table_{fmt}")
    return fmt, out, _convert(model, out, fmt), model


def _files(out) -> list[str]:
    data = manifest_json.fields(out)
    return sorted({f for g in data["files"] for f in (data.get("part_files") or {}).get(g, [data["files"][g]])})


def _table_like(path, hidden: int) -> list[tuple[str, set[str]]]:
    """(dtype, the ops reading it) of every [vocab, hidden] constant of the file (the table, the
    head: a 1x1 CONV_2D filter [vocab, 1, 1, hidden] too)."""
    found = []
    for sub in read_model(str(path)).subgraphs:
        readers: dict[int, set[str]] = {}
        for op in sub.operators:
            for i in op.inputs:
                if i >= 0:
                    readers.setdefault(i, set()).add(op.opcode)
        found += [(t.dtype, readers.get(i, set())) for i, t in enumerate(sub.tensors)
                  if t.data is not None and tuple(t.shape) in ((VOCAB, hidden), (VOCAB, 1, 1, hidden))]
    return found


def test_the_table_is_stored_once_as_the_quantized_head(converted, tied_model):
    fmt, out, report, _ = converted
    hidden = tied_model.config.hidden_size
    data = manifest_json.fields(out)
    assert data["part_embedding"] == "head" and not data.get("parts"), data
    manifest = read_manifest(out)  # a one-file "head" manifest loads (it needed parts before)
    assert manifest.part_embedding == "head"
    sizes = split.part_bytes(tied_model, fmt, "onert")
    twice = split.part_bytes(tied_model, fmt)  # the plan for a target that keeps the table (circle)
    assert sizes.head_rows and sizes.embedding == 0 and twice.embedding > 0
    for name in _files(out):
        path = out / name
        # the head alone: no FLOAT32 (w8) or Q4_0 (q4_0) table, nothing GATHERs a table
        assert _table_like(path, hidden) == [(HEAD_TYPES[fmt], {"FULLY_CONNECTED"})], (name, _table_like(path, hidden))
        sub = read_model(str(path)).subgraphs[0]
        first = sub.tensors[sub.inputs[0]]
        assert (first.name, first.dtype, first.shape[-1]) == ("hidden_in", "FLOAT32", hidden)
        written = constant_bytes(read_model(str(path)))
        # the plan's estimate is the file's weights but its few kB of other constants (RoPE
        # frequencies, shapes: 2 kB of this tiny model's 80), and the table's bytes are gone from both
        assert sizes.whole <= written <= sizes.whole + 4096, (name, written, sizes)
        assert twice.whole - sizes.whole == twice.embedding and written - sizes.whole < 0.2 * twice.embedding
    assert all(info.max_abs_error is not None for info in report.graphs.values())  # verify ran and passed
    assert "reads from its lm_head's quantized weight" in report.summary()


def _file_head_rows(path) -> np.ndarray:
    """The head's values as the file computes with them: INT8 rows times the MUL's scales, or
    the unpacked Q8_0 blocks; read here from the file's tensors, independently of HeadEmbedding."""
    sub = read_model(str(path)).subgraphs[0]
    readers = {i: op for op in sub.operators for i in op.inputs if i >= 0}
    for op in sub.operators:
        w = sub.tensors[op.inputs[1]] if op.opcode == "FULLY_CONNECTED" else None
        if w is None or w.data is None or w.shape[0] != VOCAB:
            continue
        if w.dtype == "INT8":
            mul = readers[op.outputs[0]]
            scale = np.asarray(sub.tensors[mul.inputs[1]].data, np.float32)
            return np.asarray(w.data, np.float32) * scale[:, None]
        return ggml.dequantize(w.data, w.dtype, tuple(w.shape)).numpy()
    raise AssertionError(f"{path}: no head")


def test_the_generator_reads_the_heads_dequantized_rows(converted):
    fmt, out, _, _ = converted
    manifest = read_manifest(out)
    path = manifest.path("decode")
    ids = np.array([[0, 5, 17, VOCAB - 1, 5]])
    rows = HeadEmbedding(path)(ids)
    assert rows.dtype == np.float32 and rows.shape == (1, 5, 64)
    np.testing.assert_array_equal(rows[0], _file_head_rows(path)[ids[0]])


def test_verify_embeds_with_the_heads_rows(converted):
    """verify's torch reference (dequantized_sources on the report) looks the embeddings up in
    the head's stored values, as the generator feeds them, not in the fp32 table."""
    fmt, out, report, model = converted
    embed, head = model.model.embed_tokens, model.lm_head
    seen: dict = {}

    def keep(name):  # the weight a module computes with (decoded as it runs); the output unchanged
        return lambda m, a, o: None if name in seen else seen.update({name: m.weight.detach().clone()})

    hooks = [embed.register_forward_hook(keep("embed")), head.register_forward_hook(keep("head"))]
    try:
        with dequantized_sources(report.quantization, model), torch.no_grad():
            model(torch.tensor([[5, 17, 42]]))
    finally:
        for h in hooks:
            h.remove()
    stored = torch.from_numpy(_file_head_rows(read_manifest(out).path("decode")))
    assert torch.equal(seen["head"], stored) and torch.equal(seen["embed"], stored)
    assert not torch.equal(embed.weight, stored)  # restored after: the model's own fp32 table


def _reference_logits(fmt, tied_model, model, report, ids, perturb=None):
    """torch on the file's own weights with onert's rounding of each product's input, the
    head's rows as the embeddings, teacher-forced on ``ids``; ``perturb`` (a seed): every
    rounded input nudged by a summation order's few ulps first (weights.perturbed). q4_0: the
    converted model inside dequantized_sources (its blocks; the head's Q8_0 rows embed). w8: a
    fresh copy with its SmoothQuant fold, every linear quantized per channel and run as onert's
    hybrid FULLY_CONNECTED (input rows rounded to int8), the embedding the head's int8 rows (the
    converted model's fold cannot be taken again after the convert: tests/quantize/test_w8.py)."""
    if fmt == "q4_0":
        with dequantized_sources(report.quantization, model, RUNTIMES[fmt], perturb=perturb), torch.no_grad():
            return model(torch.tensor([ids])).logits[0]
    from circleops.quantize import int8
    from circleops.quantize.smooth import smoothed
    from circleops.quantize.weights import perturbed

    nudge = perturbed(lambda x: x, perturb) if perturb is not None else (lambda x: x)
    ref = copy.deepcopy(tied_model)
    hooks = []
    with smoothed(ref), torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear):
                packed = int8.quantize_per_channel(mod.weight.detach())
                q, scale = torch.from_numpy(packed.q), torch.from_numpy(packed.scale)

                def hybrid(m, inputs, output, q=q, scale=scale):
                    x = nudge(inputs[0].reshape(-1, inputs[0].shape[-1]))
                    return (int8.hybrid_linear(x, q) * scale).reshape(*inputs[0].shape[:-1], -1)

                hooks.append(mod.register_forward_hook(hybrid))
        rows = int8.dequantize(int8.quantize_per_channel(ref.lm_head.weight.detach()))  # the tied head: not smoothed
        hooks.append(ref.model.embed_tokens.register_forward_hook(lambda m, a, o: rows[a[0]]))
        try:
            return ref(torch.tensor([ids])).logits[0]
        finally:
            for h in hooks:
                h.remove()


def test_generate_gives_torchs_tokens_on_the_files_weights(converted, tied_model):
    """The directory's greedy tokens, on onert and on the reference interpreter (the file's
    arithmetic implemented apart), against torch on the file's own weights (the head's rows
    embedding). q4_0: each token is torch's argmax within TOKEN_GAP of the logits' scale, or
    within NOISE_FLOORS x that step's noise (how far the logits move when every rounded input
    moves by 16 fp32 ulps: verify's rule, circleops.package.step). w8: torch's logits come from a
    fresh copy (the fold cannot be taken again on the converted model), whose decomposed
    attention sums in another order than onert's: on this random model one step of the 3-token
    prompt sits at a 0.14-logit top-2 margin that the file resolves the other way (the layout
    with the table did too, at 0.06): a w8 token's gap is held to verify's own bound of the
    logits (tolerance x max|logit|; the convert's verify, on the converted model, met 1e-6)."""
    from circleops.quantize.weights import NOISE_FLOORS

    fmt, out, report, model = converted
    onert_tokens = {}
    for runtime in (RUNTIMES[fmt], "reference"):
        gen = Generator(out, runtime=runtime)
        for prompt in TINY_PROMPTS:
            tokens = gen.generate(list(prompt), NEW, stop_at_eos=False).tokens
            assert len(tokens) == NEW
            if runtime == RUNTIMES[fmt]:
                onert_tokens[tuple(prompt)] = tokens
            else:  # the interpreter computes the file's arithmetic on its own
                assert tokens == onert_tokens[tuple(prompt)], (fmt, prompt)
            ids = [*prompt, *tokens]
            logits = _reference_logits(fmt, tied_model, model, report, ids)[len(prompt) - 1:-1]
            moved = _reference_logits(fmt, tied_model, model, report, ids, perturb=0)[len(prompt) - 1:-1]
            for step, (row, other, t) in enumerate(zip(logits, moved, tokens)):
                gap, noise = float(row.max() - row[t]), float((row - other).abs().max())
                scale = max(1.0, float(row.abs().max()))
                bound = max(TOKEN_GAP * scale, NOISE_FLOORS * noise)
                if fmt == "w8":
                    bound = max(bound, report.tolerance * scale)
                assert gap <= bound, (fmt, runtime, prompt, tokens, step, gap, noise)


def test_a_split_model_reads_the_heads_rows_too(converted, tied_model, tmp_path):
    """Split in two files per graph: the first part takes the rows and holds no table, the last
    holds the head; the tokens are the one-file directory's (the same weights and ops)."""
    fmt, one_file, _, _ = converted
    hidden = tied_model.config.hidden_size
    sizes = split.part_bytes(tied_model, fmt, "onert")
    limit = int((sizes.head + sizes.layers[0] + split.TABLE_BYTES) / split.WEIGHT_SHARE) + 4096
    _convert(copy.deepcopy(tied_model), tmp_path, fmt, max_file_bytes=limit)
    data = manifest_json.fields(tmp_path)
    assert data["parts"] == [[0, 1], [1, 2]] and data["part_embedding"] == "head"
    for files in data["part_files"].values():
        assert _table_like(tmp_path / files[0], hidden) == []
        assert _table_like(tmp_path / files[1], hidden) == [(HEAD_TYPES[fmt], {"FULLY_CONNECTED"})]
    runtime = RUNTIMES[fmt]
    whole, parts = Generator(one_file, runtime=runtime), Generator(tmp_path, runtime=runtime)
    for prompt in TINY_PROMPTS:
        assert parts.generate(list(prompt), NEW).tokens == whole.generate(list(prompt), NEW).tokens, prompt


def test_a_directory_with_its_table_still_runs(tied_model, tmp_path, monkeypatch):
    """A directory written before (the table in every file, GATHERed by the graph; no
    part_embedding): its manifest loads and it generates, its ids looked up in the graph."""
    monkeypatch.setattr(split, "head_rows_target", lambda target: False)  # the layout main wrote
    model = copy.deepcopy(tied_model)
    report = _convert(model, tmp_path, "w8", graphs="decode")
    data = manifest_json.fields(tmp_path)
    assert "part_embedding" not in data and report.graphs["decode"].max_abs_error is not None
    path = tmp_path / data["files"]["decode"]
    assert sorted(d for d, _ in _table_like(path, tied_model.config.hidden_size)) == ["FLOAT32", "INT8"]
    monkeypatch.undo()
    assert read_manifest(tmp_path).part_embedding is None
    from circleops.generation.sessions import open_graph
    from circleops.runtime.chain import ChainSession

    session = open_graph(read_manifest(tmp_path), "decode", "onert")
    assert not isinstance(session, ChainSession) and session.inputs[0].dtype == "int64"


def test_check_scores_the_file_generate_runs(tied_model, tmp_path):
    """``circleops check --quantize w8`` (onert) scores a file that takes the head's rows, as
    the generation graphs do: its perplexity is the directory's, not a file with an fp32 table."""
    from circleops.tools.quant_report import quant_check

    r = quant_check(copy.deepcopy(tied_model), None, quantize="w8", prompt_ids=[5, 17, 42], new_tokens=4, window=32,
                    max_windows=1, work_dir=str(tmp_path))
    (logits_file,) = tmp_path.rglob("logits_w8.circle")
    assert _table_like(logits_file, tied_model.config.hidden_size) == [("INT8", {"FULLY_CONNECTED"})]
    assert abs(r.perplexity_ratio - 1) < 0.05 and r.runtime == "onert"
