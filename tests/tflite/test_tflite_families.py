"""Every family converted with target tflite (fp32, the default fuse=auto: attention
adapters where the layer is fusable) runs in LiteRT like torch, with one composite per
fused op, named and attributed as schema/ops.yaml says."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from circleops.ops import BUILTINS, REGISTRY
from families import FAMILIES
from tflite_util import RESOLVERS, composite_counts, composites, constant, dtype, litert, max_error, read, scale

NAMES = [f.name for f in FAMILIES]
FUSABLE = {f.name: f.attention_fusable for f in FAMILIES}
COMPOSITE = {name: REGISTRY[name].tflite["composite"] for name in BUILTINS}


@pytest.mark.parametrize("resolver", RESOLVERS)
@pytest.mark.parametrize("name", NAMES)
def test_runs_in_litert_like_torch(converted, name, resolver):
    c = converted(name)
    (got,) = litert(c.path, c.inputs, resolver)
    (want,) = c.expected
    assert got.shape == want.shape and got.dtype == np.float32
    # the comparison with torch is this test's own: the fixture converts without verify
    # (a `verify is None or verify.passed` here passed on every file and checked nothing)
    assert max_error(got, want) <= 1e-4 * scale(want)


def test_file_is_tfl3_schema_3(converted):
    c = converted("llama")
    data = c.path.read_bytes()
    assert data[4:8] == b"TFL3"
    m = read(c.path)
    assert m.version == 3
    codes = {(oc.builtinCode, oc.deprecatedBuiltinCode) for oc in m.operatorCodes}
    # STABLEHLO_COMPOSITE (206) sits past the int8 range: deprecated code 127 (the placeholder)
    assert (206, 127) in codes


def _norm_modules(model) -> int:
    return sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())


@pytest.mark.parametrize("name", NAMES)
def test_one_composite_per_fused_op(converted, name):
    c = converted(name)
    m = read(c.path)
    in_file = composite_counts(m)
    # what the exported graph fused (circle ops counted by convert) ...
    assert in_file == Counter({COMPOSITE[op]: n for op, n in c.report.fused.items()})
    # ... is what the HF model has: every RMSNorm module; one attention per layer where the
    # layer is fusable, else its q and k RoPE
    layers = c.model.config.num_hidden_layers
    expected = {"odml.rms_norm": _norm_modules(c.model)}
    expected.update({"circle.attention": layers} if FUSABLE[name] else {"circle.rope": 2 * layers})
    assert in_file == Counter(expected)


@pytest.mark.parametrize("name", NAMES)
def test_composite_attributes_and_interfaces(converted, name):
    c = converted(name)
    m = read(c.path)
    cfg = c.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    main = m.subgraphs[0]
    for comp in composites(m):
        spec_keys = set(REGISTRY[next(k for k, v in COMPOSITE.items() if v == comp.name)].tflite["attributes"])
        assert set(comp.attributes) == spec_keys, comp.name
        if comp.name == "odml.rms_norm":
            assert comp.attributes["epsilon"] == pytest.approx(cfg.rms_norm_eps, rel=1e-7)
        elif comp.name == "circle.rope":
            assert comp.attributes["mode"] == "gpt_neox"
        else:
            assert comp.attributes["scale"] in (0.0, pytest.approx(head_dim ** -0.5))
        assert comp.version == 1
        # the decomposition subgraph takes and returns what the composite does
        dec = m.subgraphs[comp.subgraph]
        assert comp.subgraph > 0 and len(dec.operators) > 0
        assert [dtype(main, i) for i in comp.op.inputs] == [dtype(dec, i) for i in dec.inputs]
        assert [list(main.tensors[i].shape) for i in comp.op.inputs] == [list(dec.tensors[i].shape) for i in dec.inputs]
        assert [dtype(main, i) for i in comp.op.outputs] == [dtype(dec, i) for i in dec.outputs]


@pytest.mark.parametrize("name", ["llama", "gemma", "olmo2"])
def test_rms_norm_composite_scale_is_the_multiplier(converted, name):
    """LiteRT's delegates compute odml.rms_norm as x̂ · scale with a constant scale: the
    second input must be the multiplier itself (Gemma's 1 + w, not w)."""
    c = converted(name)
    m = read(c.path)
    main = m.subgraphs[0]
    final = c.model.model.norm
    offset = 1.0 if name == "gemma" else 0.0
    want = offset + final.weight.detach().float().numpy()
    scales = [constant(m, main, comp.op.inputs[1]) for comp in composites(m) if comp.name == "odml.rms_norm"]
    assert scales and all(s is not None and s.ndim == 1 for s in scales)  # constant, [C]
    assert any(np.array_equal(s.astype(np.float32), want) for s in scales)
