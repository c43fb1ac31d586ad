"""A tied fp32 table past XNNPACK's packing budget is written as row blocks (target tflite).

LiteRT's XNNPACK weight cache packs every FULLY_CONNECTED weight through one zero-filled
scratch buffer the size of the largest (circleops.lowering.table_blocks): the Gemma-3-1B
shape's 1.21 GB tied lm_head made its `convert --target tflite --verify` peak at 1.59x its
fp32 weights (issue 32). Here a tiny tied Gemma3 with the budget shrunk to a few rows: no
op reads the whole table, the table's bytes are in the file once (as its blocks), and the
generator gives transformers' greedy tokens and logits for a prompt whose ids fall in every
block (the GATHERs of clamped ids picked by SELECT_V2) on LiteRT and on the reference
interpreter, with verify passing.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.generation.generator import Generator
from circleops.lowering import table_blocks
from circleops.recipes.llm import convert_graphs
from circleops.serialize import read_model
from families import BY_NAME
from generate_fixtures import one_torch_thread

VOCAB, HIDDEN = 512, 64
TABLE = VOCAB * HIDDEN * 4
BUDGET = 40 << 10  # 160 rows of 64 fp32: blocks of 160, 160, 160, 32 rows
PROMPT = [5, 170, 340, 500, 159, 160, 319, 480, 511, 0, 321]  # every block, and each block's first and last rows


@pytest.fixture(scope="module")
def model():
    return BY_NAME["gemma3"].build(tie_word_embeddings=True, vocab_size=VOCAB)


def _convert(model, out, budget=None):
    with pytest.MonkeyPatch.context() as mp, one_torch_thread():
        if budget is not None:
            mp.setattr(table_blocks, "BLOCK_BYTES", budget)
        return convert_graphs(model, out, target="tflite", prefill_len=(8, 4), max_cache_len=32, verify=True,
                              source="tiny tied gemma3")


@pytest.fixture(scope="module")
def converted(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("table_blocks")
    return out, _convert(model, out, BUDGET)


@pytest.fixture(scope="module")
def whole(model, tmp_path_factory):
    """The same model with the default budget: its 128 KB table stays one weight."""
    out = tmp_path_factory.mktemp("table_whole")
    _convert(model, out)
    return out


def test_no_op_reads_the_whole_table_and_it_is_stored_once(converted, whole):
    out, report = converted
    assert ": passed" in report.summary()
    m = read_model(str(out / "model.tflite"))
    for sg in m.subgraphs:
        for op in sg.operators:
            for i in op.inputs:
                t = sg.tensors[i] if i >= 0 else None
                if t is not None and t.is_const and t.dtype == "FLOAT32":
                    assert t.nbytes <= BUDGET, f"{op.opcode} reads {t.name} {t.shape} whole"
    assert len(m.signatures) == len(report.graphs) >= 3
    for sig in m.signatures:  # each graph's lm_head: one FULLY_CONNECTED per block, then their CONCATENATION
        sg = m.subgraphs[sig.subgraph_index]
        heads = [sg.tensors[op.inputs[1]].shape[0] for op in sg.operators
                 if op.opcode == "FULLY_CONNECTED" and "_rows" in sg.tensors[op.inputs[1]].name]
        assert sorted(heads) == [32, 160, 160, 160], (sig.key, heads)
        assert sum(op.opcode == "GATHER" and "_rows" in sg.tensors[op.inputs[0]].name for op in sg.operators) == 4
    # the blocks are views of the one table: the file holds its bytes once (the ops add a few kB
    # over the 11 graphs), not twice (the table beside its blocks) nor once per graph
    grown = (out / "model.tflite").stat().st_size - (whole / "model.tflite").stat().st_size
    assert 0 < grown < TABLE // 4, grown


def test_generate_equals_transformers_in_every_block(converted, whole, model):
    out, _ = converted
    with torch.no_grad(), one_torch_thread():
        want = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, use_cache=True,
                              output_logits=True, return_dict_in_generate=True,
                              attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    tokens = want.sequences[0, len(PROMPT):].tolist()
    logits = torch.cat(want.logits).numpy()
    scale = max(1.0, float(np.abs(logits).max()))
    for runtime in ("litert", "reference"):
        gen = Generator(out, runtime=runtime)
        same = Generator(whole, runtime=runtime)  # the same dot products: the blocks change no logit
        assert np.array_equal(gen.prefill(PROMPT), same.prefill(PROMPT)), runtime
        assert gen.generate(PROMPT, 6).tokens == tokens, runtime
        got = np.stack([gen.prefill(PROMPT)] + [gen.decode(t) for t in tokens[:-1]])
        assert float(np.abs(got - logits).max()) <= 1e-4 * scale, runtime
        for i in range(len(PROMPT)):  # each prompt id's row, looked up from its block, is the table's
            assert np.allclose(gen.prefill(PROMPT[:i + 1]), _forward(model, PROMPT[:i + 1]), atol=1e-4 * scale)


def _forward(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].numpy()
