"""Constant folding (circleops.passes.fold): what does not depend on the inputs is computed
at conversion time, dead code goes, and shared weights are stored once."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.lowering import lower_program
from circleops.passes.fold import fold_constants
from circleops.serialize import write_model
from families import BY_NAME, example_ids
from lowering_util import Logits, family_program, lowered, opcodes, reference_logits

# computed from shapes, parameters and buffers only in an HF decoder: mask, RoPE tables,
# position ids, packed-sequence detection
INPUT_INDEPENDENT = {"aten.arange.default", "aten.cos.default", "aten.sin.default", "aten.cumsum.default",
                     "aten.diff.default", "aten.le.Tensor", "aten.where.ScalarOther", "aten.new_ones.default"}


def _targets(ep):
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.fixture(scope="module")
def folded():
    ep = family_program("llama", "none")
    return ep, fold_constants(ep)


def test_fold_constants_removes_input_independent_nodes(folded):
    ep, out = folded
    assert INPUT_INDEPENDENT <= _targets(ep)  # the HF graph computes them...
    assert not INPUT_INDEPENDENT & _targets(out)  # ...the folded one reads constants
    assert "aten._assert_tensor_metadata.default" not in _targets(out)  # dead code is gone
    lifted = [s.target for s in out.graph_signature.input_specs if s.target and s.target.startswith("_folded_")]
    assert lifted and all(k in out.constants for k in lifted)
    # the RoPE inv_freq buffers fed only folded nodes: they are dropped
    assert not any("inv_freq" in (s.target or "") for s in out.graph_signature.input_specs)
    assert len(list(out.graph.nodes)) < len(list(ep.graph.nodes)) // 2 + 60


def test_folded_program_computes_the_same(folded):
    ep, out = folded
    ids = example_ids()
    with torch.no_grad():
        torch.testing.assert_close(out.module()(ids), ep.module()(ids), rtol=0, atol=0)
    assert _targets(out) <= _targets(ep)


def test_folded_program_lowers_to_the_same_model(folded):
    ep, out = folded
    a, b = lower_program(ep, "circle"), lower_program(out, "circle")
    assert opcodes(a) == opcodes(b)


def test_lowering_folds_during_the_walk():
    model = lowered("llama", "none", "onert")
    ops = opcodes(model)
    assert not {"COS", "SIN", "CUMSUM", "LESS_EQUAL", "SELECT_V2", "LOGICAL_AND"} & set(ops), ops
    consts = [t for t in model.subgraphs[0].tensors if t.is_const]
    mask = [t for t in consts if t.shape == (1, 1, 8, 8)]
    assert len(mask) == 1 and mask[0].dtype == "FLOAT32"  # the causal mask, as one constant
    m = torch.as_tensor(mask[0].data)[0, 0]
    above = torch.ones(8, 8, dtype=torch.bool).triu(1)
    assert (m[above] < -1e30).all() and (m[~above] == 0).all()
    expected = reference_logits("llama")
    assert expected.shape == (1, 8, 256)


def test_tied_embedding_is_stored_once(tmp_path):
    model = BY_NAME["llama"].build(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ep = torch.export.export(Logits(model), (example_ids(),), strict=False)
    for program in (ep, fold_constants(ep)):
        ir_model = lower_program(program, "circle")
        sg = ir_model.subgraphs[0]
        gather = next(o for o in sg.operators if o.opcode == "GATHER")
        fcs = [o for o in sg.operators if o.opcode == "FULLY_CONNECTED" and sg.tensors[o.inputs[1]].shape == (256, 64)]
        assert len(fcs) == 1 and fcs[0].inputs[1] == gather.inputs[0]  # one tensor for both
        weight = sg.tensors[gather.inputs[0]].data
        assert weight.data_ptr() == model.lm_head.weight.data_ptr()  # the parameter itself
        info = write_model(ir_model, tmp_path / "tied.circle", "circle")
        params = sum(p.numel() * 4 for p in model.parameters())  # parameters() yields the tied one once
        assert info.weight_bytes < params + 8 * 1024  # weights once, plus small folded tables


def test_fold_constants_keeps_user_inputs_and_outputs(folded):
    ep, out = folded
    assert [s.arg.name for s in out.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == \
        [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert out.graph_signature.output_specs == ep.graph_signature.output_specs
    logits = out.module()(example_ids())
    np.testing.assert_allclose(logits.detach().numpy(), reference_logits("llama").numpy(), atol=1e-5)
