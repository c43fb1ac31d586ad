"""CONTRIBUTING's "Adding X (N files)" claims, each checked by doing it (issue 33): a throwaway X
is written as the files CONTRIBUTING names, into a temporary directory laid out as the
repository, loaded the way the repository's own are (a module imported, an entry run as if
it stood in its file), then converted, verified and run. Each test counts the files it wrote
and compares the count with the heading's N, so the guide and the code cannot drift apart: a
registry that stopped picking X up fails the run, a doc that claims fewer files than X needs
fails the count, and a new "Adding" heading without a test here fails the first test.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

import circleops
from circleops.serialize import read_model

CONTRIBUTING = Path(__file__).resolve().parents[2] / "CONTRIBUTING.md"


def claims() -> dict[str, int]:
    """'an op' -> 2 for each ``## Adding an op (2 files)`` heading of CONTRIBUTING.md."""
    found = re.findall(r"^## Adding (.+?) \((\d+) files?\b", CONTRIBUTING.read_text(), re.M)
    return {what: int(n) for what, n in found}


class Workspace:
    """The files a contributor writes for one X (``claim``: CONTRIBUTING's "Adding X"), at
    their repository paths under ``root``: as many as the heading says, or the test fails."""

    def __init__(self, root: Path, claim: str, files: dict[str, str]):
        self.root = root
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text).lstrip())
        assert len(files) == claims()[claim], f"adding {claim} took {len(files)} files: {sorted(files)}"

    def module(self, rel: str, name: str) -> ModuleType:
        """The file at ``rel`` imported as module ``name`` (in sys.modules, so a registry
        entry can name it as it names circleops' own modules)."""
        spec = importlib.util.spec_from_file_location(name, self.root / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def entry(self, rel: str, into: ModuleType) -> dict:
        """Run the file at ``rel`` as if its lines stood at the end of module ``into`` (with
        its names; what it defines stays out of the real module)."""
        namespace = dict(vars(into))
        exec(compile((self.root / rel).read_text(), str(self.root / rel), "exec"), namespace)
        return namespace


def _opcodes(path) -> set[str]:
    return {op.opcode for sg in read_model(path).subgraphs for op in sg.operators}


# ------------------------------------------------------------------------------------- op

OP = "pixel_shuffle_nhwc"  # DEPTH_TO_SPACE of NHWC activations: a Circle builtin the interpreter has no kernel for

OP_ENTRY = f"""
ops:
  {OP}:
    summary: Depth to space of NHWC activations, as TFLite's DEPTH_TO_SPACE (a test's op).
    schema: 'circle::{OP}(Tensor x, int block_size=2) -> Tensor'
    inputs:
      - {{name: x, shape: "[N, H, W, C]", dtypes: [float32, float16, bfloat16], meaning: "NHWC, C a multiple of b²"}}
    attributes:
      - {{name: block_size, type: int, default: 2, meaning: the side b of each block}}
    outputs:
      - {{name: y, shape: "[N, H·b, W·b, C / b²]", dtype: x.dtype}}
    compute_policy: {{default: input dtype, note: a permutation}}
    autocast: none
    circle: {{builtin: DEPTH_TO_SPACE, code: 5, inputs: [x], options: DepthToSpaceOptions,
              option_fields: {{blockSize: block_size}}}}
    tflite: {{composite: test.{OP}, attributes: {{block_size: block_size}}}}
"""

OP_MODULE = f'''
    """DEPTH_TO_SPACE: out[n, h·b + i, w·b + j, k] = x[n, h, w, (i·b + j)·C/b² + k]."""
    import torch

    NAME = "{OP}"


    def reference(x, block_size):
        n, h, w, c = x.shape
        b = block_size
        y = x.reshape(n, h, w, b, b, c // (b * b)).permute(0, 1, 3, 2, 4, 5)
        return y.reshape(n, h * b, w * b, c // (b * b)).clone()  # a new tensor, never a view of x


    def fake(x, block_size):
        n, h, w, c = x.shape
        return x.new_empty((n, h * block_size, w * block_size, c // (block_size * block_size)))


    def sample_inputs(dtype):
        g = torch.Generator().manual_seed(0)
        return [((torch.randn(1, 2, 3, 8, generator=g).to(dtype),), {{}}),
                ((torch.randn(2, 2, 1, 18, generator=g).to(dtype), 3), {{}})]
'''


def test_every_adding_claim_has_its_test():
    assert set(claims()) == set(CHECKED), ("an 'Adding X (N files)' heading of CONTRIBUTING.md without its test here, "
                                           "or a test whose heading is gone")


def test_an_op(tmp_path):
    """schema/ops.yaml's entry and the op's module: the op battery (schema, kernel, opcheck,
    gradcheck, autocast, export, every target converted and verified on its runtime) passes,
    the interpreter runs its Circle builtin from the contract (no kernel written), and the
    lowering test's generic case takes it (no CASES entry)."""
    import yaml

    from circleops.lowering import lower_program
    from circleops.ops import REGISTRY, define_builtin
    from circleops.ops.table import rows
    from circleops.testing import CallOp, check_op

    ws = Workspace(tmp_path, "an op", {"schema/ops.yaml": OP_ENTRY, f"circleops/ops/{OP}.py": OP_MODULE})

    contract = yaml.safe_load((tmp_path / "schema/ops.yaml").read_text())["ops"][OP]
    # (a torch op cannot be undefined: the op stays registered for the rest of this process)
    spec = REGISTRY.get(OP) or define_builtin(contract, ws.module(f"circleops/ops/{OP}.py", f"howto_ops_{OP}"))
    assert spec.builtin and spec.targets == {"circle": "builtin", "onert": "builtin", "tflite": "composite"}
    assert check_op(spec) == ["schema", "kernel", "opcheck", "gradcheck", "autocast", "export", "targets"]
    assert any(row["op"] == f"circle::{OP}" for row in rows())  # `circleops ops` lists it

    args, kwargs = spec.sample_inputs(torch.float32)[1]  # block 3: the option must reach the kernel
    module = CallOp(spec.op, args, kwargs)
    ep = torch.export.export(module, (args[0],))
    path = tmp_path / "op.circle"
    circleops.save(ep, path, target="circle")
    assert "DEPTH_TO_SPACE" in _opcodes(path)
    from circleops.runtime import reference

    (got,) = reference.run(str(path), [args[0].numpy()])
    assert np.array_equal(got, spec(*args).numpy())
    assert lower_program(ep, "onert").subgraphs[0].operators[0].options == {"blockSize": 3}


# ------------------------------------------------------------------------------- lowering

LOWERING = """
    import torch

    from circleops.lowering.registry import lower


    @lower(torch.ops.aten.hardsigmoid)
    def _(ctx, node, x):
        # relu6(x + 3) / 6, as torch computes it
        return ctx.div(ctx.unary("RELU6", ctx.add(x, 3.0, ctx.out_dtype)), 6.0, ctx.out_dtype)
"""


class HardSigmoid(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.hardsigmoid(x) * 2


def test_a_lowering(tmp_path):
    """One function in its op group's module: every target writes it (RELU6 where the
    decomposition wrote MAXIMUM/MINIMUM) and its runtime computes torch's values."""
    from circleops.lowering.registry import LOWERINGS

    x = torch.linspace(-5, 5, 24).reshape(2, 12)
    assert "RELU6" not in _opcodes(circleops.convert(HardSigmoid(), (x,), tmp_path / "before.circle").path)
    ws = Workspace(tmp_path, "a lowering", {"circleops/lowering/elementwise.py": LOWERING})
    ws.module("circleops/lowering/elementwise.py", "howto_lowering")
    try:
        for target, suffix in (("circle", "circle"), ("onert", "circle"), ("tflite", "tflite")):
            path = tmp_path / f"after_{target}.{suffix}"
            report = circleops.convert(HardSigmoid(), (x,), path, target=target, verify=True)
            assert report.verify.passed and "RELU6" in _opcodes(path), target
    finally:
        LOWERINGS.pop(torch.ops.aten.hardsigmoid)


# --------------------------------------------------------------------------------- target

TARGET = """
    # fp32-only Circle files for the reference interpreter (an accelerator without fp16)
    import dataclasses

    CIRCLE_FP32 = dataclasses.replace(CIRCLE, name="circle-fp32", float_dtypes=frozenset({"float32"}))
    register_target(CIRCLE_FP32)
"""


def test_a_target(tmp_path):
    """One profile in circleops/targets.py: convert and verify with it; its facts are asked."""
    import circleops.targets as targets
    from circleops.errors import TargetError

    ws = Workspace(tmp_path, "a target", {"circleops/targets.py": TARGET})
    ws.entry("circleops/targets.py", targets)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
        report = circleops.convert(model, (torch.randn(2, 8),), tmp_path / "m.circle", target="circle-fp32",
                                   verify=True)
        assert report.target == "circle-fp32" and report.verify.passed and report.verify.runtime == "reference"
        with pytest.raises(TargetError, match="circle-fp32"):
            circleops.convert(model, (torch.randn(2, 8),), tmp_path / "h.circle", target="circle-fp32", dtype="fp16")
    finally:
        targets.unregister_target("circle-fp32")


# -------------------------------------------------------------------------------- runtime

RUNTIME_MODULE = '''
    """The reference interpreter, counting the files it opens (a test's runtime)."""
    from circleops.runtime import reference

    OPENED = []


    class Session:
        def __init__(self, path, signature=None):
            OPENED.append(str(path))
            self._session = reference.Session(path, signature)
            self.inputs, self.outputs = self._session.inputs, self._session.outputs

        def run(self, inputs):
            return self._session.run(inputs)


    def run(path, inputs):
        return Session(path).run(inputs)
'''

RUNTIME_ENTRY = """
    register_runtime(Runtime("counting", ("circle",), "howto_runtime_counting", "the counting interpreter",
                             selects_signatures=True, threads_env=None))
"""


def test_a_runtime(tmp_path):
    """Its module and its entry in circleops/runtime/__init__.py: convert verifies with it,
    open_session opens it."""
    import circleops.runtime as runtime

    ws = Workspace(tmp_path, "a runtime", {"circleops/runtime/counting.py": RUNTIME_MODULE,
                                           "circleops/runtime/__init__.py": RUNTIME_ENTRY})
    module = ws.module("circleops/runtime/counting.py", "howto_runtime_counting")
    ws.entry("circleops/runtime/__init__.py", runtime)
    try:
        model, x = torch.nn.Linear(8, 4).eval(), torch.randn(2, 8)
        report = circleops.convert(model, (x,), tmp_path / "m.circle", verify="counting")
        assert report.verify.passed and report.verify.runtime == "counting" and len(module.OPENED) == 1
        (got,) = runtime.open_session("counting", tmp_path / "m.circle").run([x.numpy()])
        assert len(module.OPENED) == 2 and np.allclose(got, model(x).detach().numpy(), atol=1e-6)
    finally:
        runtime.unregister_runtime("counting")


# -------------------------------------------------------------------------- weight format

CODEC = """
    \"\"\"GGML_Q8_0 blocks whose values are truncated toward zero (a test's codec).\"\"\"
    import numpy as np
    import torch

    from circleops.quantize import ggml

    BLOCK = 32


    def encode(weight, dtype, importance=None):
        x = torch.as_tensor(weight).detach().float().numpy().reshape(-1, BLOCK)
        d = (np.abs(x).max(axis=1) / 127).astype(np.float16)
        scale = np.where(d == 0, 1, d.astype(np.float32))
        q = np.clip(np.trunc(x / scale[:, None]), -127, 127).astype(np.int8)
        return np.concatenate([d[:, None].view(np.uint8), q.view(np.uint8)], axis=1).reshape(-1)


    def decode(packed, dtype, shape):
        return ggml.decode(packed, dtype, shape)


    def decode_into(packed, dtype, out):
        return ggml.decode_into(packed, dtype, out)
"""

FORMAT_ENTRY = """
    register(WeightFormat("q8_0-trunc-howto", "GGML_Q8_0 linear weights, truncated (a test's format)", WEIGHTS,
                          "GGML_Q8_0", "howto_codec", file_formats=frozenset({"circle"}),
                          target_refusal="is a Circle-only test format", runtimes=frozenset({"reference"})))
"""


def test_a_weight_format(tmp_path):
    """A codec module and its entry in circleops/quantize/formats.py: convert writes the
    codec's bytes, verify and the interpreter run them."""
    from circleops.quantize import formats

    ws = Workspace(tmp_path, "a weight format", {"circleops/quantize/q8_0_trunc.py": CODEC,
                                                 "circleops/quantize/formats.py": FORMAT_ENTRY})
    codec = ws.module("circleops/quantize/q8_0_trunc.py", "howto_codec")
    ws.entry("circleops/quantize/formats.py", formats)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
        path = tmp_path / "m.circle"
        report = circleops.convert(model, (torch.randn(2, 64),), path, quantize="q8_0-trunc-howto", verify=True)
        assert report.verify.passed and report.quantization.format == "q8_0-trunc-howto"
        stored = next(t for t in read_model(path).subgraphs[0].tensors if t.name == "0.weight")
        assert np.array_equal(np.asarray(stored.data).reshape(-1), codec.encode(model[0].weight, "GGML_Q8_0"))
    finally:
        formats.unregister("q8_0-trunc-howto")


# --------------------------------------------------------------------------- model family

FAMILY = """
    \"\"\"Arcee (AFM): Llama's layers with a ReLU² MLP.\"\"\"
    from circleops.adapters import _rmsnorm
    from circleops.adapters._family import Family

    FAMILY = Family(
        name="arcee",
        module="transformers.models.arcee.modeling_arcee",
        norm_classes=("ArceeRMSNorm",),
        norm_style=_rmsnorm.LLAMA,
        attention_class="ArceeAttention",
    )

    (patched_arcee_rmsnorm, patched_arcee_rope,
     patched_arcee_attention, patched_arcee_modules) = FAMILY.context_managers()
"""


def test_a_model_family(tmp_path):
    """One file with its FAMILY row (found in circleops/adapters/ without another edit;
    register_family for one outside the package): convert writes the ATTENTION builtin where
    attention was decomposed before, and the generation graphs give transformers' greedy tokens."""
    import transformers

    import circleops.adapters as adapters
    from circleops.adapters import _package_families, register_family, unregister_family
    from circleops.generation.generator import Generator
    from circleops.recipes.llm import convert_graphs

    cfg = transformers.ArceeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.ArceeForCausalLM(cfg).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    assert "ATTENTION" not in _opcodes(circleops.convert(model, (ids,), tmp_path / "before.circle").path)

    ws = Workspace(tmp_path, "a model family", {"circleops/adapters/arcee.py": FAMILY})
    register_family(ws.module("circleops/adapters/arcee.py", "howto_adapters_arcee").FAMILY)
    try:
        assert "ATTENTION" in _opcodes(circleops.convert(model, (ids,), tmp_path / "after.circle", verify=True).path)
        convert_graphs(model, tmp_path / "g", target="circle", prefill_len=4, max_cache_len=8, verify=True)
        got = Generator(tmp_path / "g").generate([1, 2, 3], max_new_tokens=3, stop_at_eos=False).tokens
        want = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)[0, 3:].tolist()
        assert list(got) == want
    finally:
        unregister_family("arcee")
    # the package's own families are its modules with a FAMILY row: no list to extend
    rows = {m.FAMILY.name for m in map(sys.modules.get, list(sys.modules))
            if m is not None and m.__name__.startswith("circleops.adapters.") and hasattr(m, "FAMILY")}
    assert {f.name for f in _package_families()} == rows == set(adapters.BY_NAME)


# ---------------------------------------------------------------------------- CLI

COMMAND_V1 = """
    \"\"\"``circleops describe TARGET``: a target's file format (a test's subcommand).\"\"\"
    import argparse


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        from circleops.targets import TARGETS

        parser.add_argument("target", choices=TARGETS)


    def main(args: argparse.Namespace) -> int:
        from circleops.targets import profile

        print(profile(args.target).format)
        return 0
"""

COMMAND_ENTRY = """
    COMMANDS["describe"] = ("howto_cli_describe", "describe a target")
"""

COMMAND_V2 = COMMAND_V1.replace(
    '        parser.add_argument("target", choices=TARGETS)\n',
    '        parser.add_argument("target", choices=TARGETS)\n'
    '        parser.add_argument("--runtime", action="store_true", help="its runtime instead")\n').replace(
    "        print(profile(args.target).format)\n",
    "        print(profile(args.target).runtime if args.runtime else profile(args.target).format)\n")


def test_a_subcommand_and_a_flag(tmp_path, capsys, monkeypatch):
    """A subcommand is its module and one line in COMMANDS; a flag of it is that module alone."""
    import circleops.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", dict(cli.COMMANDS))
    ws = Workspace(tmp_path, "a subcommand", {"circleops/cli/describe.py": COMMAND_V1,
                                              "circleops/cli/__init__.py": COMMAND_ENTRY})
    ws.module("circleops/cli/describe.py", "howto_cli_describe")
    cli.COMMANDS.update(ws.entry("circleops/cli/__init__.py", cli)["COMMANDS"])
    assert cli.main(["describe", "tflite"]) == 0 and capsys.readouterr().out == "tflite\n"
    with pytest.raises(SystemExit) as refused:
        cli.main(["describe", "nope"])
    assert refused.value.code == 2

    flag = Workspace(tmp_path / "flag", "a CLI flag", {"circleops/cli/describe.py": COMMAND_V2})
    flag.module("circleops/cli/describe.py", "howto_cli_describe")
    assert cli.main(["describe", "onert", "--runtime"]) == 0 and capsys.readouterr().out == "onert\n"
    assert cli.main(["describe", "circle"]) == 0 and capsys.readouterr().out == "circle\n"


def test_a_convert_option():
    """Checked by tests/cli/test_convert_option.py, which edits a copy of circleops (the option's
    field and its one use) and runs convert from it; here: that test names the same two files."""
    text = (CONTRIBUTING.parent / "tests" / "cli" / "test_convert_option.py").read_text()
    edits = re.search(r"^EDITS = \{(.*)\}$", text, re.M).group(1)
    assert len(re.findall(r'"circleops/[\w/]+\.py"', edits)) == claims()["a convert option"]


def test_a_recipe():
    """Checked by tests/package/test_recipe_interface.py, which declares a recipe in its own
    module (a Recipe subclass over circleops' public names, no circleops file changed) and
    writes, compares and publishes it for every target; here: that test's recipe is one module."""
    text = (CONTRIBUTING.parent / "tests" / "package" / "test_recipe_interface.py").read_text()
    assert len(re.findall(r"^class \w+\(Recipe\):", text, re.M)) == claims()["a recipe"] == 1
    assert "from circleops.recipes.base import Graph, Recipe" in text


CHECKED = {"an op": test_an_op, "a lowering": test_a_lowering, "a target": test_a_target, "a runtime": test_a_runtime,
           "a weight format": test_a_weight_format, "a model family": test_a_model_family,
           "a subcommand": test_a_subcommand_and_a_flag, "a CLI flag": test_a_subcommand_and_a_flag,
           "a convert option": test_a_convert_option, "a recipe": test_a_recipe}
