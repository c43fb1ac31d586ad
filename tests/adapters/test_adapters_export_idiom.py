"""The README's export idioms work as written on transformers 5, for every family, with
the model as HF builds it (config.use_cache=True, the default): inside an adapter session,
after circleops.fuse(model), and a plain export followed by fuse_patterns.

Without circleops/adapters/dynamic_cache.py each of these fails ("Found <class
'transformers.cache_utils.DynamicCache'> in output"), and attention handed an HF cache
stays decomposed."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import circleops
import circleops.adapters as adapters
from adapter_fixtures import ATTENTION_TOL, circle_counts
from circleops.passes.fusion import fuse_patterns
from families import FAMILIES, example_ids

NAMES = [f.name for f in FAMILIES]
FUSABLE = {f.name for f in FAMILIES if f.attention_fusable}


def _hf_default(name: str) -> torch.nn.Module:
    model = next(f for f in FAMILIES if f.name == name).build(use_cache=True)
    assert model.config.use_cache is True
    return model


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.parametrize("family", NAMES)
def test_patched_modules_idiom_as_written(family):
    model, ids = _hf_default(family), example_ids()
    with torch.no_grad():
        want = model(ids).logits
    with getattr(adapters, f"patched_{family}_modules")():
        ep = torch.export.export(model, (ids,))
    counts = circle_counts(ep)
    assert counts["rms_norm"] > 0
    # an HF cache object would have kept attention decomposed
    assert counts.get("attention", 0) == (model.config.num_hidden_layers if family in FUSABLE else 0)
    with torch.no_grad():
        got = _logits(ep.module()(ids))
    torch.testing.assert_close(got, want, rtol=0, atol=ATTENTION_TOL["fp32"])
    # the session is gone: the model builds its DynamicCache again
    assert type(model(ids).past_key_values).__name__ == "DynamicCache"


@pytest.mark.parametrize("family", NAMES)
def test_fuse_idiom_as_written(family):
    model, ids = _hf_default(family), example_ids()
    with torch.no_grad():
        want = model(ids).logits
    circleops.fuse(model)
    try:
        ep = torch.export.export(model, (ids,))
    finally:
        circleops.unfuse(model)
    assert circle_counts(ep).get("attention", 0) == (model.config.num_hidden_layers if family in FUSABLE else 0)
    with torch.no_grad():
        torch.testing.assert_close(_logits(ep.module()(ids)), want, rtol=0, atol=ATTENTION_TOL["fp32"])
    assert type(model(ids).past_key_values).__name__ == "DynamicCache"


@pytest.mark.parametrize("family", NAMES)
def test_fuse_patterns_idiom_as_written(family):
    """A plain export returns HF's cache too (DynamicCache as a pytree node); the
    pattern pass fuses the norms and rotations and leaves the outputs as they were."""
    model, ids = _hf_default(family), example_ids()
    with torch.no_grad():
        want = model(ids)
    ep = torch.export.export(model, (ids,))
    ep, report = fuse_patterns(ep)
    counts = circle_counts(ep)
    assert counts["rms_norm"] > 0 and counts["rope"] == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        got = ep.module()(ids)
    assert torch.equal(got.logits, want.logits)
    for layer_got, layer_want in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert torch.equal(layer_got.keys, layer_want.keys) and torch.equal(layer_got.values, layer_want.values)


def test_strict_export_and_generate_unchanged_inside_session():
    model, ids = _hf_default("llama"), example_ids()
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
    with adapters.patched_llama_modules():
        ep = torch.export.export(model, (ids,), strict=True)
        # generate passes its own cache: HF's behaviour, same tokens
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert circle_counts(ep)["attention"] == model.config.num_hidden_layers
    assert torch.equal(got, want)


def test_cache_patch_is_not_reported_unused():
    """The no-cache helper runs for any model of the family, so it must not mask (or
    cause) the unused-patch warning, which names only the patched layers."""
    with pytest.warns(adapters.UnusedPatchWarning) as record:
        with adapters.patched_llama_rmsnorm():
            pass
    message = str(record[0].message)
    assert "LlamaRMSNorm" in message and "LlamaModel" not in message


def test_registered_when_transformers_is_imported_after_circleops():
    """The pytree registration waits for transformers.cache_utils (importing circleops
    imports no transformers) and then happens by itself."""
    code = ("import sys, torch, circleops.passes\n"
            "assert 'transformers' not in sys.modules\n"
            "import transformers\n"
            "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,"
            " num_attention_heads=2, num_key_value_heads=1)\n"
            "model = transformers.LlamaForCausalLM(cfg).eval()\n"
            "ep = torch.export.export(model, (torch.tensor([[1, 2, 3]]),))\n"
            "print(len(ep.graph_signature.output_specs))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "3"  # logits, one layer's keys and values
