"""Each fused circle op, per target profile: the structure schema/ops.yaml asks for, and the
written file computing what the torch op computes (reference interpreter for circle, onert,
LiteRT for tflite). Parametrized over circleops.ops.REGISTRY."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops import ir
from circleops.lowering import lower_program
from circleops.ops import BUILTINS, REGISTRY
from circleops.serialize import write_model
from circleops.targets import PROFILES
from lowering_util import opcodes

g = torch.Generator().manual_seed(0)


def _r(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


class OpModule(torch.nn.Module):
    """Calls one circle op; ``params`` become parameters (constants), ``inputs`` graph inputs."""

    def __init__(self, call, params: dict[str, torch.Tensor]):
        super().__init__()
        self.call = call
        for k, v in params.items():
            self.register_parameter(k, torch.nn.Parameter(v, requires_grad=False))

    def forward(self, *inputs):
        return self.call(self, *inputs)


def _rope_inputs(s):
    ang = _r(s, 4)
    return (_r(1, 2, s, 8), torch.cat([ang.cos()] * 2, -1)[None], torch.cat([ang.sin()] * 2, -1)[None])


def _attention_inputs():
    c, s = 6, 1
    ang = _r(s, 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    mask = torch.zeros(s, c)
    mask[:, 4:] = float("-inf")
    return (_r(1, s, 16), cos, sin, mask, _r(1, c, 2, 4), _r(1, c, 2, 4), torch.tensor([3]))


# name -> (module, example inputs) where a hand-picked case says more than the op's first
# sample (constants as parameters, a decode-step attention); another op runs its own
# sample_inputs(float32)[0], its tensors as graph inputs (_sample_case).
CASES = {
    "rms_norm": lambda: (OpModule(lambda m, x: torch.ops.circle.rms_norm(x, m.w, 1e-5), {"w": _r(16) * 0.2 + 1}),
                         (_r(1, 4, 16, scale=3.0),)),
    "rope": lambda: (OpModule(lambda m, x, c, s: torch.ops.circle.rope(x, c, s), {}), _rope_inputs(4)),
    "attention": lambda: (OpModule(lambda m, x, cos, sin, mask, k, v, pos: torch.ops.circle.attention(
        x, m.wq, m.wk, m.wv, m.wo, cos, sin, mask, k, v, pos),
        {"wq": _r(16, 16) * 0.3, "wk": _r(8, 16) * 0.3, "wv": _r(8, 16) * 0.3, "wo": _r(16, 16) * 0.3}),
        _attention_inputs()),
    "instance_norm": lambda: (OpModule(lambda m, x: torch.ops.circle.instance_norm(x, m.w, m.b, 1e-5),
                                       {"w": _r(3) * 0.2 + 1, "b": _r(3) * 0.2}), (_r(1, 3, 5, 5),)),
}

FORMAT = {"circle": "circle", "onert": "circle", "tflite": "tflite"}


def _run(target, path, inputs):
    if target == "onert":
        from circleops.runtime import onert as runtime
    elif target == "tflite":
        from circleops.runtime import litert as runtime
    else:
        from circleops.runtime import reference as runtime
    return runtime.run(path, [np.asarray(i) for i in inputs])


def _sample_case(name):
    from circleops.testing import CallOp

    args, kwargs = REGISTRY[name].sample_inputs(torch.float32)[0]
    return CallOp(REGISTRY[name].op, args, kwargs), tuple(a for a in args if isinstance(a, torch.Tensor))


@pytest.fixture(scope="module", params=sorted(BUILTINS))
def case(request):
    name = request.param
    module, inputs = CASES[name]() if name in CASES else _sample_case(name)
    ep = torch.export.export(module, inputs, strict=False)
    with torch.no_grad():
        expected = module(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    return name, ep, inputs, expected


@pytest.mark.parametrize("target", ["circle", "onert", "tflite"])
def test_fused_op_structure_and_numerics(case, target, tmp_path):
    name, ep, inputs, expected = case
    spec = REGISTRY[name]
    model = lower_program(ep, target)
    ops = opcodes(model)
    how = spec.targets[target]
    builtin = spec.circle["builtin"]
    if how == "builtin" and name == "rope" and PROFILES[target].rope_max_positions is not None:
        how = "decomposed"  # S = 4 here: more positions than onert's ROPE handles
    if how == "builtin":
        assert ops[builtin] == 1, ops
        op = next(o for o in model.subgraphs[0].operators if o.opcode == builtin)
        assert op.options_type == spec.circle["options"]
        for field, arg in spec.circle["option_fields"].items():
            assert field in op.options, (field, op.options)
    elif how == "composite":
        assert ops["STABLEHLO_COMPOSITE"] == 1 and len(model.subgraphs) == 2, ops
        op = model.subgraphs[0].operators[[o.opcode for o in model.subgraphs[0].operators].index("STABLEHLO_COMPOSITE")]
        assert op.options["name"] == spec.tflite["composite"]
        assert set(op.options["compositeAttributes"]) == set(spec.tflite["attributes"])
        body = model.subgraphs[op.options["decompositionSubgraphIndex"]]
        assert body.operators and not any(o.opcode == "STABLEHLO_COMPOSITE" for o in body.operators)
        assert len(body.inputs) == len(op.inputs) and len(body.outputs) == len(op.outputs)
    else:  # decomposed
        assert builtin not in ops and ops, ops

    path = tmp_path / f"{name}.{FORMAT[target]}"
    write_model(model, path, FORMAT[target])
    outs = _run(target, path, inputs)
    assert len(outs) == len(expected)
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


def test_circle_builtin_options_come_from_the_contract():
    """RMS_NORM epsilon, ROPE mode as RoPEMode, INSTANCE_NORM epsilon: values, not just fields."""
    module, inputs = CASES["rms_norm"]()
    op = lower_program(torch.export.export(module, inputs, strict=False), "circle").subgraphs[0].operators[0]
    assert (op.opcode, op.options) == ("RMS_NORM", {"epsilon": pytest.approx(1e-5)})

    x, cos, sin = _rope_inputs(4)
    gptj = OpModule(lambda m, x, c, s: torch.ops.circle.rope(x, c, s, "gpt_j"), {})
    model = lower_program(torch.export.export(gptj, (x, cos, sin), strict=False), "circle")
    rope = next(o for o in model.subgraphs[0].operators if o.opcode == "ROPE")
    assert rope.options == {"mode": 1}  # circle.RoPEMode.GPT_J
    sg = model.subgraphs[0]
    # inputs in the contract's order (x, sin, cos), tables as rank 4 [1, 1, S, D]
    assert [sg.tensors[i].shape for i in rope.inputs] == [(1, 2, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8)]

    module, inputs = CASES["instance_norm"]()
    model = lower_program(torch.export.export(module, inputs, strict=False), "circle")
    sg = model.subgraphs[0]
    norm = next(o for o in sg.operators if o.opcode == "INSTANCE_NORM")
    assert norm.options["epsilon"] == pytest.approx(1e-5)
    assert sg.tensors[norm.inputs[0]].shape == (1, 5, 5, 3)  # channels-last between transposes


def test_rope_on_onert_is_the_builtin_for_one_position(tmp_path):
    """onert's ROPE reads only the first row of sin/cos: the lowering uses it for S == 1 only."""
    module = OpModule(lambda m, x, c, s: torch.ops.circle.rope(x, c, s), {})
    for s, expect_builtin in ((1, True), (4, False)):
        inputs = _rope_inputs(s)
        model = lower_program(torch.export.export(module, inputs, strict=False), "onert")
        assert ("ROPE" in opcodes(model)) == expect_builtin
        path = tmp_path / f"rope{s}.circle"
        write_model(model, path, "circle")
        got = _run("onert", path, inputs)[0]
        np.testing.assert_allclose(got, module(*inputs).numpy(), atol=1e-6)


def test_attention_builtin_updates_caches_in_place():
    """ONE's ATTENTION has one output and writes the new k/v into its cache inputs: the
    op's updated caches are those tensors, so the graph outputs point at them."""
    module, inputs = CASES["attention"]()
    model = lower_program(torch.export.export(module, inputs, strict=False), "circle")
    sg = model.subgraphs[0]
    (att,) = [o for o in sg.operators if o.opcode == "ATTENTION"]
    assert len(att.inputs) == 11 and len(att.outputs) == 1
    assert [sg.tensors[i].name for i in att.inputs[8:10]] == [sg.tensors[i].name for i in sg.outputs[1:]]
    assert sg.outputs[1:] == att.inputs[8:10]


def test_partial_rotary_keeps_rope_on_the_rotated_dims():
    x = _r(1, 2, 4, 8)
    ang = _r(4, 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # R = 4 < D = 8
    module = OpModule(lambda m, x, c, s: torch.ops.circle.rope(x, c, s), {})
    model = lower_program(torch.export.export(module, (x, cos, sin), strict=False), "circle")
    ops = opcodes(model)
    assert ops["ROPE"] == 1 and ops["CONCATENATION"] == 1
    from circleops.runtime import reference

    got = reference.run(model, [x.numpy(), cos.numpy(), sin.numpy()])[0]
    np.testing.assert_allclose(got, module(x, cos, sin).numpy(), atol=1e-6)


def test_constants_are_the_parameters_themselves():
    module, inputs = CASES["rms_norm"]()
    model = lower_program(torch.export.export(module, inputs, strict=False), "circle")
    consts = [t for t in model.subgraphs[0].tensors if t.is_const]
    assert len(consts) == 1 and consts[0].name == "w"
    assert consts[0].data.data_ptr() == module.w.data_ptr()  # no copy: the writer streams it
    assert isinstance(model.subgraphs[0].tensors[0], ir.Tensor)


@pytest.mark.parametrize("shape", [(5, 16), (2, 2, 3, 2, 16)])
def test_rms_norm_on_onert_is_reshaped_to_a_rank_it_runs(shape, tmp_path):
    """onert's RMS_NORM takes rank 3 or 4 only: other ranks go through [1, N, C]."""
    module = OpModule(lambda m, x: torch.ops.circle.rms_norm(x, m.w, 1e-5), {"w": _r(16) * 0.2 + 1})
    x = _r(*shape, scale=2.0)
    model = lower_program(torch.export.export(module, (x,), strict=False), "onert")
    sg = model.subgraphs[0]
    (norm,) = [o for o in sg.operators if o.opcode == "RMS_NORM"]
    assert sg.tensors[norm.inputs[0]].shape == (1, x.numel() // 16, 16)
    path = tmp_path / "rms.circle"
    write_model(model, path, "circle")
    (got,) = _run("onert", path, [x])
    np.testing.assert_allclose(got, module(x).numpy(), atol=1e-6)
