"""A user's own op, defined outside the circleops package with the public decorator, through
every target (issue 20's "How it is checked"), and read back by the interpreter and inspect.

circle: exactly one CUSTOM op with the op's custom_code and a flexbuffer map of its
attributes, run by the reference interpreter equal to torch; onert: decomposed and verified
on onert; tflite: a STABLEHLO_COMPOSITE named after the op that LiteRT runs equal to torch.
The file is read with circle_schema / ai_edge_litert's generated readers and flexbuffers,
not with circleops' own reader.
"""
from __future__ import annotations

import ai_edge_litert.schema_py_generated as tfl
import numpy as np
import pytest
import torch
from circle_schema import circle
from flatbuffers import flexbuffers

import circleops
from circleops.cli import main as cli_main
import circleops.tools.inspect
from circleops.errors import CircleOpsError, RuntimeRunError, UnsupportedOpError
from circleops.ops import REGISTRY, OpDefinitionError, by_custom_code
from circleops.runtime import litert, reference


@circleops.op("mylib::swiglu(Tensor x, float alpha=1.0, str act=\"silu\") -> Tensor")
def swiglu(x, alpha=1.0, act="silu"):
    """SwiGLU over the last dim: silu(a * alpha) * b, (a, b) = x's two halves."""
    a, b = x.chunk(2, -1)
    return torch.nn.functional.silu(a * alpha) * b


@swiglu.register_fake
def _(x, alpha=1.0, act="silu"):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


class Block(torch.nn.Module):
    """A linear, the user's op, a linear: the op sits between real layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 32)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.ops.mylib.swiglu(self.up(x), 0.5))


X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))


def _circle_model(path):
    return circle.Model.ModelT.InitFromPackedBuf(path.read_bytes(), 0)


def _tflite_model(path):
    return tfl.ModelT.InitFromPackedBuf(path.read_bytes(), 0)


def _opcodes(model, ops):
    return [model.operatorCodes[op.opcodeIndex] for op in ops]


def _name(code, enum):
    builtin = max(code.builtinCode, code.deprecatedBuiltinCode)
    return next(k for k, v in vars(enum).items() if v == builtin and not k.startswith("_"))


def test_the_decorator_makes_a_real_torch_op():
    assert torch.ops.mylib.swiglu.default is swiglu.overload
    want = torch.nn.functional.silu(X[..., :4] * 2.0) * X[..., 4:]
    assert torch.equal(torch.ops.mylib.swiglu(X[..., :8], 2.0), want)
    assert REGISTRY["mylib::swiglu"] is swiglu and swiglu.provider == __name__
    assert swiglu.targets == {"circle": "custom", "onert": "decomposed", "tflite": "composite"}
    ep = torch.export.export(Block(), (X,))
    assert sum(n.target is swiglu.overload for n in ep.graph.nodes) == 1


def test_circle_writes_one_custom_op_the_interpreter_runs(tmp_path):
    path = tmp_path / "block.circle"
    report = circleops.convert(Block(), (X,), path, target="circle", verify=True)
    assert report.verify.runtime == "reference" and report.verify.passed
    model = _circle_model(path)
    sg = model.subgraphs[0]
    codes = _opcodes(model, sg.operators)
    custom = [(op, c) for op, c in zip(sg.operators, codes)
              if _name(c, circle.BuiltinOperator.BuiltinOperator) == "CUSTOM"]
    assert len(custom) == 1
    op, code = custom[0]
    assert code.customCode.decode() == "mylib::swiglu"
    assert op.customOptionsFormat == circle.CustomOptionsFormat.CustomOptionsFormat.FLEXBUFFERS
    options = flexbuffers.GetRoot(bytes(op.customOptions)).AsMap
    assert {k.AsKey: v.Value for k, v in zip(options.Keys, options.Values)} == {"alpha": 0.5, "act": "silu"}
    got = reference.run(str(path), [X.numpy()])[0]
    np.testing.assert_array_equal(got, Block()(X).detach().numpy())


def test_onert_decomposes_the_op_and_verifies_on_onert(tmp_path):
    path = tmp_path / "block.circle"
    report = circleops.convert(Block(), (X,), path, target="onert", verify=True)
    assert report.verify.runtime == "onert" and report.verify.passed
    assert "CUSTOM" not in report.ops and "LOGISTIC" in report.ops  # silu, decomposed


def test_tflite_writes_a_composite_litert_runs(tmp_path):
    path = tmp_path / "block.tflite"
    report = circleops.convert(Block(), (X,), path, target="tflite", verify=True)
    assert report.verify.runtime == "litert" and report.verify.passed
    model = _tflite_model(path)
    sg = model.subgraphs[0]
    composites = [op for op, c in zip(sg.operators, _opcodes(model, sg.operators))
                  if _name(c, tfl.BuiltinOperator) == "STABLEHLO_COMPOSITE"]
    assert len(composites) == 1
    options = composites[0].builtinOptions2
    assert options.name.decode() == "mylib.swiglu"
    attrs = flexbuffers.Loads(bytes(options.compositeAttributes))
    assert attrs == {"alpha": 0.5, "act": "silu"}
    got = litert.run(str(path), [X.numpy()])[0]
    np.testing.assert_allclose(got, Block()(X).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_inspect_shows_custom_code_and_decoded_options(tmp_path, capsys):
    path = tmp_path / "block.circle"
    circleops.convert(Block(), (X,), path, target="circle")
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "custom ops (1):" in out and "mylib::swiglu x1  custom_options {act='silu', alpha=0.5}" in out


def test_ops_lists_the_user_op_beside_the_builtins(capsys):
    assert cli_main(["ops"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("mylib::swiglu "))
    for text in ("CUSTOM 'mylib::swiglu'", "flexbuffer {alpha, act}", "mylib.swiglu", "onert: decomposed", __name__):
        assert text in row
    assert any(line.startswith("circle::rms_norm ") for line in out.splitlines())


# ------------------------------------------------------------------------ the other forms
@circleops.op("mylib::gelu_t(Tensor x) -> Tensor", circle={"builtin": "GELU", "options": "GeluOptions",
                                                           "option_fields": {}}, tflite="decompose")
def gelu_t(x):
    return torch.nn.functional.gelu(x)


@circleops.op("mylib::scaled(Tensor x, float s=2.0) -> Tensor", custom_code="VendorScale", tflite="custom")
def scaled(x, s=2.0):
    return x * s


class Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_a_named_circle_builtin(tmp_path):
    report = circleops.convert(Call(gelu_t), (X,), tmp_path / "g.circle", target="circle", verify=True)
    assert report.ops == {"GELU": 1} and report.verify.passed
    report = circleops.convert(Call(gelu_t), (X,), tmp_path / "g.tflite", target="tflite", verify=True)
    # tflite="decompose": the reference kernel's aten.gelu, lowered as any aten.gelu is
    assert report.ops == {"GELU": 1} and report.verify.passed


def test_a_custom_code_given_and_a_tflite_custom_op(tmp_path):
    path = tmp_path / "s.circle"
    circleops.convert(Call(scaled), (X,), path, target="circle", verify=True)
    assert by_custom_code("VendorScale") is scaled
    model = _circle_model(path)
    assert [c.customCode.decode() for c in model.operatorCodes if c.customCode] == ["VendorScale"]
    tpath = tmp_path / "s.tflite"
    circleops.convert(Call(scaled), (X,), tpath, target="tflite")  # LiteRT has no kernel for it: no verify
    model = _tflite_model(tpath)
    assert [c.customCode.decode() for c in model.operatorCodes if c.customCode] == ["VendorScale"]
    np.testing.assert_array_equal(reference.run(str(tpath), [X.numpy()])[0], (X * 2).numpy())


def test_an_unknown_custom_code_is_a_clear_error(tmp_path):
    from circleops.serialize import read_model, write_model

    path = tmp_path / "s.circle"
    circleops.convert(Call(scaled), (X,), path, target="circle")
    model = read_model(str(path))
    op = next(o for o in model.subgraphs[0].operators if o.opcode == "CUSTOM")
    op.options["customCode"] = "acme::fused_moe"
    write_model(model, str(tmp_path / "u.circle"), "circle")
    with pytest.raises(RuntimeRunError, match=r"custom_code 'acme::fused_moe': no registered op provides it"):
        reference.run(str(tmp_path / "u.circle"), [X.numpy()])


def test_definition_errors_are_clear():
    with pytest.raises(OpDefinitionError, match="already defined"):
        circleops.op("mylib::swiglu(Tensor x) -> Tensor")(lambda x: x)
    with pytest.raises(OpDefinitionError, match="not a Circle BuiltinOperator"):
        circleops.op("mylib::nope(Tensor x) -> Tensor", circle={"builtin": "NOT_AN_OP"})
    with pytest.raises(OpDefinitionError, match="option_fields name"):
        circleops.op("mylib::nope(Tensor x) -> Tensor", circle={"builtin": "GELU", "option_fields": {"approximate": "y"}})
    with pytest.raises(OpDefinitionError, match="custom_code 'VendorScale' already names mylib::scaled"):
        circleops.op("mylib::other_scale(Tensor x) -> Tensor", custom_code="VendorScale")(lambda x: x)
    with pytest.raises(OpDefinitionError, match="schema must be"):
        circleops.op("swiglu(Tensor x) -> Tensor")
    assert issubclass(OpDefinitionError, CircleOpsError)


def test_a_shape_derived_attribute_is_written_as_a_constant(tmp_path):
    class Dyn(torch.nn.Module):
        def forward(self, x):
            return torch.ops.mylib.scaled(x, float(x.shape[0]) * 1.5)

    path = tmp_path / "d.circle"
    circleops.convert(Dyn(), (X,), path, target="circle", verify=True)
    assert "custom_options {s=3.0}" in circleops.tools.inspect.format_text(circleops.tools.inspect.summarize(path))


@circleops.op("mylib::band(Tensor x) -> Tensor", circle="decompose")
def band(x):
    # writes into a tensor it made: the decomposition must keep the write (the trace is
    # functionalized; before, the write was dropped and the file silently computed x @ 0)
    m = torch.zeros(x.shape[-1], x.shape[-1])
    m[0, 1] += 1.0
    m.diagonal().fill_(2.0)
    return x @ m


@pytest.mark.parametrize("target", ["circle", "tflite"])
def test_a_reference_kernel_writing_in_place_decomposes_right(tmp_path, target):
    path = tmp_path / f"band.{'tflite' if target == 'tflite' else 'circle'}"
    report = circleops.convert(Call(band), (X,), path, target=target, verify=True)
    assert report.verify.max_abs_error == 0.0


@torch.library.custom_op("plainlib::twice", mutates_args=())
def plain_twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@plain_twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_plain_torch_library_op_is_refused_with_the_way_in(tmp_path):
    with pytest.raises(UnsupportedOpError, match=r"plainlib\.twice.*@circleops\.op\(schema\).*circleops\.register_op"):
        circleops.convert(Call(torch.ops.plainlib.twice), (X,), tmp_path / "p.circle", target="circle")
    # registered with its reference kernel, the same op converts
    circleops.register_op(torch.ops.plainlib.twice, lambda x: x * 2)
    report = circleops.convert(Call(torch.ops.plainlib.twice), (X,), tmp_path / "p.circle", target="circle",
                               verify=True)
    assert report.ops == {"CUSTOM": 1} and report.verify.passed
