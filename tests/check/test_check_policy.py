"""Norm policies on an exported graph: what each writes for target circle, that rewriting
is repeatable, and that the forced decomposition (node meta flag) computes what the
RMS_NORM builtin computes."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from circleops.lowering import lower_program
from circleops.lowering.circle_ops import LOWERING_META
from circleops.numerics import NORM_POLICIES, norm_policy, rms_norm_nodes, set_norm_policy
from circleops.errors import CircleOpsError
from circleops.runtime.reference import Interpreter

from families import example_ids

N_NORMS = 5  # 2 layers x 2 + the final norm


@pytest.fixture(scope="module")
def fp16_program(tiny_llama):
    import copy

    from circleops.pipeline.convert import hf_export_settings, export
    from circleops.numerics import LayerOutputs

    model = copy.deepcopy(tiny_llama).half()
    with hf_export_settings(model), torch.no_grad():
        return export(LayerOutputs(model), (example_ids(8),), adapters=True, warn_list=[])


def _policy_of(node) -> str:
    """The node's policy argument: positional, keyword, or (left out by the export) the default."""
    names = [a.name for a in torch.ops.circle.rms_norm.default._schema.arguments]
    k = names.index("policy")
    return node.args[k] if len(node.args) > k else node.kwargs.get("policy", "fp32")


def _norm_ops(model) -> list[tuple[str, list[str], list[str]]]:
    """(opcode, input dtypes, output dtypes) of every operator, main subgraph."""
    sg = model.subgraphs[0]
    return [(op.opcode, [sg.tensors[i].dtype for i in op.inputs if i >= 0], [sg.tensors[o].dtype for o in op.outputs])
            for op in sg.operators]


@pytest.mark.parametrize("name", list(NORM_POLICIES))
def test_policy_writes_its_norm(fp16_program, name):
    assert set_norm_policy(fp16_program, name) == N_NORMS
    assert all(_policy_of(n) == NORM_POLICIES[name].op_policy for n in rms_norm_nodes(fp16_program))
    ops = _norm_ops(lower_program(fp16_program, "circle", dtype=torch.float16))
    count = Counter(op for op, _, _ in ops)
    rsqrt = [ins[0] for op, ins, _ in ops if op == "RSQRT"]
    if name == "fused":
        assert count["RMS_NORM"] == N_NORMS and not rsqrt
        assert all(ins[0] == "FLOAT32" for op, ins, _ in ops if op == "RMS_NORM")  # computed in fp32
    else:
        assert count["RMS_NORM"] == 0 and len(rsqrt) == N_NORMS
        # the island computes the norm in fp32 between CASTs; scaled and native in fp16
        assert set(rsqrt) == ({"FLOAT32"} if name == "fp32-island" else {"FLOAT16"})
    if name == "native":
        assert count["CAST"] == 0  # nothing leaves fp16
    else:
        assert count["CAST"] >= 2 * N_NORMS


def test_rewrite_is_repeatable(fp16_program):
    set_norm_policy(fp16_program, "native")
    set_norm_policy(fp16_program, "fused")
    assert not any(LOWERING_META in n.meta for n in rms_norm_nodes(fp16_program))
    ops = Counter(op for op, _, _ in _norm_ops(lower_program(fp16_program, "circle", dtype=torch.float16)))
    assert ops["RMS_NORM"] == N_NORMS


def test_island_computes_what_the_builtin_computes(fp16_program):
    """Same policy (fp32), two writings: the RMS_NORM builtin and the CAST island agree
    to fp16 rounding of the outputs, and both match the torch fp16 program."""
    ids = example_ids(8)
    outs = {}
    for name in ("fused", "fp32-island"):
        set_norm_policy(fp16_program, name)
        outs[name] = Interpreter(lower_program(fp16_program, "circle", dtype=torch.float16)).run_torch([ids])
    set_norm_policy(fp16_program, "fused")
    with torch.no_grad():
        want = fp16_program.module()(ids)
    for a, b, w in zip(outs["fused"], outs["fp32-island"], want):
        scale = float(w.abs().max())
        assert float((a.float() - b.float()).abs().max()) <= 2e-3 * max(1.0, scale)
        assert float((a.float() - w.float()).abs().max()) <= 5e-3 * max(1.0, scale)


def test_policy_given_as_keyword_is_rewritten():
    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            return torch.ops.circle.rms_norm(x, self.weight, eps=1e-6, policy="fp32")

    ep = torch.export.export(Norm().half(), (torch.randn(1, 3, 16).half(),))
    assert set_norm_policy(ep, "scaled") == 1
    assert _policy_of(rms_norm_nodes(ep)[0]) == "scaled"
    x = (torch.randn(1, 3, 16) * 400).half()  # fp16 x² overflows: only scaled stays finite
    y = Interpreter(lower_program(ep, "circle", dtype=torch.float16)).run_torch([x])[0]
    want = torch.ops.circle.rms_norm(x.float(), ep.state_dict["weight"].detach().float(), 1e-6)
    assert torch.isfinite(y).all()
    assert float((y.float() - want).abs().max()) < 1e-2 * float(want.abs().max())


def test_unknown_policy_is_a_user_error():
    with pytest.raises(CircleOpsError, match="unknown norm policy 'fp8'.*fused, fp32-island, scaled, native"):
        norm_policy("fp8")
