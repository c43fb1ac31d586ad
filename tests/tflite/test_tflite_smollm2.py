"""The real SmolLM2-135M (30 layers) as TFLite, run in LiteRT against torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import circleops
from circleops.serialize import read_model
from rounding import FP32_STEP, rounding_steps
from tflite_util import RESOLVERS, composite_counts, composites, litert, max_error, read, scale

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from circleops.sources.models import load_smollm2

    model, tokenizer = load_smollm2()
    ids = tokenizer("Once upon a time, there was a little", return_tensors="pt").input_ids
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.numpy()
    path = tmp_path_factory.mktemp("smollm2") / "smollm2.tflite"
    report = circleops.convert(model, (ids,), path, target="tflite", verify=True)
    return model, ids.numpy(), want, path, report


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_smollm2_logits_in_litert(smollm2, resolver):
    model, ids, want, path, report = smollm2
    assert report.verify.runtime == "litert" and report.verify.passed
    (got,) = litert(path, [ids], resolver)
    # fp32 rounding steps on the file's deepest path (tests/rounding.py: 30 layers of sums over
    # 576-1536 terms), one fp32 step each: ~4e-3 of the largest logit. Measured on the AMD
    # EPYC: 2e-4 absolute on logits up to 28.6 (LiteRT's fp32 kernels sit 1.1e-4 to 1.8e-4
    # from an fp64 torch run; torch fp32 4.4e-5). It stays sharp: a 1 % error of the logits
    # (a wrong scale, a dropped op) is more than twice the bound.
    bound = rounding_steps(read_model(str(path))) * FP32_STEP
    assert 2 * bound < 0.01
    assert max_error(got, want) <= bound * scale(want)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_smollm2_one_composite_per_fused_op(smollm2):
    model, ids, want, path, report = smollm2
    layers = model.config.num_hidden_layers
    m = read(path)
    assert report.fused == {"rms_norm": 2 * layers + 1, "attention": layers}
    assert composite_counts(m) == {"odml.rms_norm": 2 * layers + 1, "circle.attention": layers}
    eps = [c.attributes["epsilon"] for c in composites(m) if c.name == "odml.rms_norm"]
    assert eps == [pytest.approx(model.config.rms_norm_eps)] * (2 * layers + 1)
