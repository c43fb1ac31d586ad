"""Target circle in fp16: fp16 weights and activations, the fp32 islands the torch graph
asks for kept as CASTs, and RMS_NORM written as the builtin only where it computes exactly
what circle.rms_norm computes."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from circleops.lowering import lower_program
from circleops.runtime import reference
from families import example_ids
from lowering_util import family_program, lowered, opcodes, reference_logits

_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.type_as.default",
          "aten.softmax.int")


def _input_dependent_casts(ep) -> int:
    """Casts (and softmax's dtype=) in the torch graph that change the dtype of a value
    computed from the inputs: each must stay a CAST in the file."""
    dependent, count = set(), 0
    for n in ep.graph.nodes:
        if n.op == "placeholder":
            if n.name in {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}:
                dependent.add(n)
            continue
        if n.op != "call_function" or not any(a in dependent for a in n.all_input_nodes):
            continue
        dependent.add(n)
        src, out = n.all_input_nodes[0].meta.get("val"), n.meta.get("val")
        if str(n.target) in _CASTS and isinstance(out, torch.Tensor) and src.dtype != out.dtype:
            count += 1
    return count


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_fp16_decomposed_norms_keep_every_cast(family):
    ep = family_program(family, "none", torch.float16)
    model = lowered(family, "none", "circle", torch.float16)
    ops = opcodes(model)
    assert ops["CAST"] == _input_dependent_casts(ep) > 0
    sg = model.subgraphs[0]
    # the norm's mean of squares is an fp32 island in an fp16 graph
    means = [op for op in sg.operators if op.opcode == "MEAN"]
    assert means and all(sg.tensors[op.inputs[0]].dtype == "FLOAT32" for op in means)
    weights = [t for t in sg.tensors if t.is_const and len(t.shape) == 2]
    assert weights and all(t.dtype == "FLOAT16" for t in weights)


@pytest.mark.parametrize("family,fused", [("llama", "none"), ("llama", "norms"), ("gemma", "norms")])
def test_fp16_circle_matches_torch(family, fused):
    model = lowered(family, fused, "circle", torch.float16)
    if fused == "norms":
        sg = model.subgraphs[0]
        norms = [op for op in sg.operators if op.opcode == "RMS_NORM"]
        assert norms and all(sg.tensors[op.inputs[0]].dtype == "FLOAT32" for op in norms)  # fp32 island
    (got,) = reference.run(model, [example_ids().numpy()])
    want = reference_logits(family, torch.float16).float().numpy()
    assert got.dtype == np.float16
    # torch's CPU kernels compute fp16 ops in fp32 and round once (e.g. silu); a file of
    # fp16 ops rounds per op: one or two fp16 ulps (at the largest logit's magnitude) at most
    ulp = float(np.spacing(np.float16(np.abs(want).max())))
    np.testing.assert_allclose(got.astype(np.float32), want, atol=2 * ulp, rtol=0)


class Norm(torch.nn.Module):
    def __init__(self, dtype, **attrs):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w = torch.nn.Parameter((torch.randn(64, generator=g) * 0.1).to(dtype), requires_grad=False)
        self.attrs = attrs

    def forward(self, x):
        return torch.ops.circle.rms_norm(x, self.w, 1e-6, **self.attrs)


VARIANTS = list(itertools.product([torch.float32, torch.float16], ["input_dtype", "fp32"], [0.0, 1.0],
                                  ["fp32", "native", "scaled"]))


@pytest.mark.parametrize("dtype,multiply,offset,policy", VARIANTS,
                         ids=[f"{str(d)[6:]}-{m}-off{o:g}-{p}" for d, m, o, p in VARIANTS])
def test_rms_norm_builtin_only_when_exact(dtype, multiply, offset, policy):
    module = Norm(dtype, offset=offset, multiply=multiply, policy=policy)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 5, 64, generator=g) * 300).to(dtype)  # |x| > 256: x² overflows fp16
    ep = torch.export.export(module, (x,), strict=False)
    model = lower_program(ep, "circle")
    builtin = "RMS_NORM" in opcodes(model)
    # the builtin normalizes in fp32 (an island for fp16), so it cannot express the policies
    # that compute in the input dtype
    assert builtin == (policy != "scaled" and not (policy == "native" and dtype == torch.float16))
    (got,) = reference.run(model, [x.numpy()])
    want = module(x)
    assert got.dtype == want.numpy().dtype
    if policy == "native" and dtype == torch.float16:  # computed as fp16 backends do: overflows
        assert not np.isfinite(want.float().numpy()).all() or (want == 0).any()
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-3 if dtype == torch.float16 else 1e-6,
                               atol=0, equal_nan=True)
