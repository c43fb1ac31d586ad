"""circleops' vision-language modules (adapters.vlm rows) against transformers, for every
family (SmolVLM, PaliGemma, Gemma 3, Qwen2-VL, Qwen2.5-VL): greedy decoding through the vision module, the image-merging prefill (runs that
never split an image block) and the decode step gives generate's tokens and logits, with
one image (the "full" cache form) and with two images placed where the processor places them
("rows": each form with one count, the two counts share every other line). The written
graphs of every family are run by tests/generate/test_vlm.py and test_converted_graphs.py."""
from __future__ import annotations

import copy

import pytest

from tiny_vlms import greedy

NEW = 8
QWEN = ("Look at <|vision_start|><|image_pad|><|vision_end|> please, what is it?",
        "Look <|vision_start|><|image_pad|><|vision_end|> and then at <|vision_start|><|image_pad|><|vision_end|> now!")
PROMPTS = {"gemma3": ("Look at <start_of_image> please, what is it?",
                      "Look <start_of_image> and then at <start_of_image> now, what is it?"),
           "qwen2_vl": QWEN, "qwen2_5_vl": QWEN,
           "smolvlm": ("Look at <image> please, what is it?", "Look <image> and then at <image> now, what is it?"),
           "paligemma": ("what is it?", "compare them")}
# fp32 through 2 vision + 2 text layers in another order (chunked prefill, masks built
# from pos): a few ulps of |logits|
LOGIT_TOL = 1e-4


def _tiles(inputs):
    px = inputs["pixel_values"]
    return [px[i:i + 1] for i in range(px.shape[0])]


def _close(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert float((g - w).abs().max()) <= LOGIT_TOL * max(1.0, float(w.abs().max())), f"step {i}"


@pytest.mark.parametrize("images, cache_update", [(1, "full"), (2, "rows")])
def test_greedy_equals_transformers(tiny_vlm, images, cache_update):
    inputs = tiny_vlm.inputs(PROMPTS[tiny_vlm.family][images - 1], tiny_vlm.images[:images])
    want, want_logits = tiny_vlm.hf_greedy(inputs, NEW)
    got, logits = greedy(copy.deepcopy(tiny_vlm.model), inputs, NEW, cache_update=cache_update)
    assert got == want
    _close(logits, want_logits)


def test_images_change_the_logits(tiny_vlm):
    """The image rows are live: the other image in the same place gives other logits."""
    text = PROMPTS[tiny_vlm.family][0]
    a, b = (tiny_vlm.inputs(text, [p]) for p in tiny_vlm.images)
    if a["input_ids"].shape != b["input_ids"].shape:  # Qwen: another size, other tokens
        b = tiny_vlm.inputs(text, [tiny_vlm.images[0]])
        b["pixel_values"] = b["pixel_values"].flip(0)
    la = greedy(copy.deepcopy(tiny_vlm.model), a, 1)[1][0]
    lb = greedy(copy.deepcopy(tiny_vlm.model), b, 1)[1][0]
    assert float((la - lb).abs().max()) > 1e-2


def test_mrope_positions_are_get_rope_index(mrope_vlm):
    """The prompt's 3-D positions and decode delta, computed without the model, equal
    transformers' get_rope_index for one and two images of different sizes."""
    from circleops.adapters.qwen_vision import mrope_positions
    tiny_vlm = mrope_vlm
    for images, text in ((1, PROMPTS[tiny_vlm.family][0]), (2, PROMPTS[tiny_vlm.family][1])):
        inputs = tiny_vlm.inputs(text, tiny_vlm.images[:images])
        want, delta = tiny_vlm.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                          inputs["image_grid_thw"])
        got, got_delta = mrope_positions(inputs["input_ids"][0].tolist(), tiny_vlm.model.config.image_token_id,
                                         inputs["image_grid_thw"].tolist(), 2)
        assert got == want[:, 0].tolist() and got_delta == int(delta)
