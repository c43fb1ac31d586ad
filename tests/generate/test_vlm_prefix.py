"""PaliGemma's prefix-LM: the image tokens, BOS, the prompt and "\\n" attend to each other
both ways (transformers' ``token_type_ids == 0``), what follows causally. The prefill graphs
take ``prefix_len`` and build that mask from it and ``pos``; the prefix goes through one run."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from circleops.generation import vision
from circleops.recipes import vlm
from circleops.cli import main
from vlm_fixtures import VLM_NEW

pytestmark = pytest.mark.parametrize("tiny_vlm_onert", ["paligemma"], indirect=True)


def _prefill_logits(out, ids, pixels, prefix_len: int, runtime=None):
    gen = vision.VisionGenerator(out, runtime=runtime)
    gen.attach_images(ids, 0, gen.image_features(pixels))
    gen.prefix_len = prefix_len
    return gen.feed(ids)


@pytest.mark.parametrize("target", ["onert", "circle"])
def test_the_prefix_mask_decides_the_logits(tiny_vlm_onert, tmp_path, target):
    """The prefill with prefix_len = the prompt gives transformers' logits with the
    processor's token_type_ids (0: prefix); with prefix_len 0 it is causal and gives
    transformers' logits with the prompt as a causal suffix (token_type_ids 1), which are
    far from them, and so are the greedy tokens. Target onert: the "rows" form (the C + S
    mask of circle.attention); target circle: the "full" form (the ATTENTION builtin)."""
    t = tiny_vlm_onert
    out = t.out
    if target == "circle":
        model, processor = vlm.load(t.model_dir)
        vlm.convert_vlm_graphs(model, tmp_path / "out", processor=processor, target=target, prefill_len=(48, 8),
                               max_cache_len=64)
        out = tmp_path / "out"
    ids, pixels = vision.prepare(t.processor, "Describe it", vision.read_image(t.photo))
    prefix, causal = (_prefill_logits(out, ids, pixels, p) for p in (len(ids), 0))
    want_prefix, want_causal = t.hf_logits(ids, pixels, token_type=0), t.hf_logits(ids, pixels, token_type=1)
    scale = max(1.0, float(np.abs(want_prefix).max()))
    assert np.abs(prefix - want_prefix).max() < 1e-4 * scale
    assert np.abs(causal - want_causal).max() < 1e-4 * scale
    assert np.abs(want_prefix - want_causal).max() > 0.05 * scale  # the mask matters to this model
    assert t.hf_greedy(ids, pixels) != t.hf_greedy(ids, pixels, token_type=1)
    assert vision.generate(out, "Describe it", t.photo, VLM_NEW).tokens == t.hf_greedy(ids, pixels)


def test_a_prefix_longer_than_the_prefill_graphs_names_seq_len(tiny_vlm_onert, tmp_path, capsys):
    """The prefix cannot be chunked (a chunk would not see the later prefix tokens): a prompt
    past the longest prefill graph, and a --seq-len shorter than the image, are one paragraph
    each, naming --seq-len; nothing is written."""
    t = tiny_vlm_onert
    prompt = " ".join(["word"] * 40)
    ids, _ = vision.prepare(t.processor, prompt, vision.read_image(t.photo))
    assert len(ids) > 48
    assert main(["generate", str(t.out), "--image", str(t.photo), "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert f"the prompt is {len(ids)} tokens" in err and f"--seq-len {len(ids)}" in err and "Traceback" not in err
    assert main(["convert", str(t.model_dir), "--graphs", "vision,prefill,decode", "--seq-len", "16,8",
                 "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 16,8" in err and "one prefill run" in err and "at least 19" in err
    assert not (tmp_path / "o").exists()


def test_the_text_model_counts_positions_from_one_and_stays_unchanged(tiny_vlm_onert):
    """PaliGemma's RoPE positions are cache slots + 1 (transformers' ``position_ids + 1``);
    exporting leaves the model's own layers as they were (is_causal False: SDPA's choice)."""
    from circleops.adapters.vlm import PALIGEMMA, TextLM

    model, _ = vlm.load(tiny_vlm_onert.model_dir)
    body = model.model.language_model
    x = torch.zeros(1, 3, 32)
    slots = torch.arange(5, 8)[None]
    got = TextLM(model).model.rotary_emb(x, slots)
    want = body.rotary_emb(x, slots + 1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, body.rotary_emb(x, slots)))
    with PALIGEMMA.explicit_mask(model):
        assert all(layer.self_attn.is_causal for layer in body.layers)
    assert not any(layer.self_attn.is_causal for layer in body.layers)
