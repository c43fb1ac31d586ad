"""The patch machinery: restores HF exactly (exceptions included), nests, reports misuse."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import circleops.adapters as adapters
from adapter_fixtures import built, circle_counts
from circleops.adapters import FAMILIES, UnusedPatchWarning
from families import BY_NAME

# sessions that run nothing warn; only the misuse tests below look at that warning
idle = pytest.mark.filterwarnings("ignore::circleops.adapters.UnusedPatchWarning")


def _snapshot() -> dict:
    """Identity of every attribute any adapter touches, as stored (not inherited)."""
    snap = {}
    for fam in FAMILIES:
        module = importlib.import_module(fam.module)
        for p in fam.patches():
            owner = module if p.owner is None else getattr(module, p.owner)
            snap[(fam.name, p.owner, p.attr)] = owner.__dict__.get(p.attr, "<inherited>")
    return snap


@idle
def test_patches_apply_and_restore_exactly():
    before = _snapshot()
    with adapters.patched_modules():
        during = _snapshot()
        assert all(during[k] is not before[k] for k in before)
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)


@idle
def test_patches_restored_after_exception():
    before = _snapshot()
    with pytest.raises(ZeroDivisionError):
        with adapters.patched_modules():
            1 / 0
    assert all(v is before[k] for k, v in _snapshot().items())


@idle
def test_patches_nest():
    from transformers.models.llama import modeling_llama as ml

    original_norm, original_rope = ml.LlamaRMSNorm.forward, ml.apply_rotary_pos_emb
    with adapters.patched_llama_rmsnorm():
        outer_norm = ml.LlamaRMSNorm.forward
        assert outer_norm is not original_norm and ml.apply_rotary_pos_emb is original_rope
        with adapters.patched_llama_modules():
            assert ml.LlamaRMSNorm.forward is not outer_norm
            assert ml.apply_rotary_pos_emb is not original_rope
        assert ml.LlamaRMSNorm.forward is outer_norm and ml.apply_rotary_pos_emb is original_rope
    assert ml.LlamaRMSNorm.forward is original_norm


@idle
def test_sessions_exited_out_of_order_still_restore_exactly():
    before = _snapshot()
    outer, inner = adapters.patched_modules(), adapters.patched_llama_modules()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # not the innermost one
    inner.__exit__(None, None, None)
    assert all(v is before[k] for k, v in _snapshot().items())


def test_nested_export_counts_for_both_levels():
    b = built("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPatchWarning)  # the outer rmsnorm patch ran via the inner one
        with adapters.patched_llama_rmsnorm():
            with adapters.patched_llama_modules(attention=False):
                ep = torch.export.export(b.model, (b.ids,))
    assert circle_counts(ep) == {"rms_norm": b.norm_calls, "rope": 2 * b.layers}


@idle
def test_a_session_cannot_be_entered_twice_at_once():
    session = adapters.patched_llama_rmsnorm()
    with session:
        with pytest.raises(RuntimeError, match="already active"):
            session.__enter__()
    with session:  # but it can be reused after it closed
        pass


def test_export_after_the_with_warns_naming_the_classes():
    with pytest.warns(UnusedPatchWarning, match=r"LlamaRMSNorm.*LlamaAttention") as record:
        with adapters.patched_llama_modules():
            model = BY_NAME["llama"].build()  # built inside, exported after: the misuse
    assert "modeling_llama.apply_rotary_pos_emb" in str(record[0].message)
    b = built("llama")
    ep = torch.export.export(model, (b.ids,))
    assert not circle_counts(ep)  # nothing was patched at export time


def test_adapters_of_another_family_warn():
    b = built("mistral")
    with pytest.warns(UnusedPatchWarning, match="LlamaRMSNorm"):
        with adapters.patched_llama_rmsnorm():
            b.model(b.ids)


def test_patched_modules_does_not_warn_about_other_families():
    b = built("qwen3")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedPatchWarning)
        with adapters.patched_modules():
            b.model(b.ids)


@pytest.mark.parametrize("kind,expected", [
    ("rmsnorm", {"rms_norm": 5}),
    ("rope", {"rope": 4}),
    ("attention", {"attention": 2}),
])
def test_single_adapters_work_alone(kind, expected):
    b = built("llama")
    with getattr(adapters, f"patched_llama_{kind}")():
        ep = torch.export.export(b.model, (b.ids,))
    assert circle_counts(ep) == expected
