"""The adapters choose what becomes a composite: with the attention adapter (the default)
a fusable layer is one "circle.attention"; without it, its q and k RoPE are "circle.rope".
Both run in LiteRT like torch. Also: what target tflite refuses."""
from __future__ import annotations

import pytest
import torch

import circleops
from circleops.adapters import patched_modules
from circleops.pipeline.convert import export_module
from circleops.errors import TargetError
from families import BY_NAME, FAMILIES, example_ids
from tflite_util import composite_counts, litert, max_error, read, scale

FUSABLE = [f.name for f in FAMILIES if f.attention_fusable]


@pytest.mark.parametrize("name", FUSABLE)
def test_without_the_attention_adapter(tmp_path, converted, name):
    model = BY_NAME[name].build()
    ids = example_ids(seq_len=8)
    module = export_module(model)
    with torch.no_grad():
        want = module(ids).numpy()
        with patched_modules(attention=False):
            ep = torch.export.export(module, (ids,), strict=False)
    path = tmp_path / "no_attention.tflite"
    report = circleops.save(ep, path, target="tflite", fuse="none", verify=True, example_args=(ids,))
    assert report.verify.runtime == "litert" and report.verify.passed
    layers = model.config.num_hidden_layers
    norms = composite_counts(read(converted(name).path))["odml.rms_norm"]
    assert composite_counts(read(path)) == {"odml.rms_norm": norms, "circle.rope": 2 * layers}
    (got,) = litert(path, [ids.numpy()], "builtin")
    assert max_error(got, want) <= 1e-4 * scale(want)


def test_bf16_is_refused_before_any_work(tmp_path):
    model = BY_NAME["llama"].build(dtype=torch.bfloat16)
    with pytest.raises(TargetError, match="LiteRT.*bf16.*fp16"):
        circleops.convert(model, (example_ids(),), tmp_path / "m.tflite", target="tflite")
    assert not (tmp_path / "m.tflite").exists()
